"""How this process was launched, as a command a shell takes back, and ``gemzoo launch``, which runs torchrun.

:func:`launch_command` gives ``gemzoo train ...``, ``python -m gemzoo.cli train ...``, under ``gemzoo launch`` the
launch line itself (``gemzoo launch --nproc-per-node M -- train ...``, from :data:`LAUNCH_ENV`, which the launcher
sets for its workers), or under a plain torchrun ``torchrun --nnodes N --nproc-per-node M -m gemzoo.cli train ...``
rebuilt from the environment torchrun gives each worker (``TORCHELASTIC_RUN_ID``, ``LOCAL_WORLD_SIZE``,
``GROUP_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). The resume hint and ``command.txt`` print it.

:func:`run_torchrun` is ``gemzoo launch``: torchrun's elastic agent (``torch.distributed.run``) in this process,
with ``-m gemzoo.cli COMMAND`` as the workers' program. torchrun starts each worker in its own session, so a
Ctrl-C at the terminal reaches the agent alone, and the agent hands the signal to every worker once; the workers
finish their step and write a checkpoint, rank 0 prints the one message that names the command that resumes.
What plain torchrun adds on top (its log lines about the signal, the ``SignalException`` traceback, exit code 1)
this launcher leaves out: it exits 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM). A second Ctrl-C
goes to the workers at once, which then stop without a checkpoint. Nothing here imports torch until it runs.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
from pathlib import Path

LAUNCH_ENV = "GEMZOO_LAUNCH"  # the launch command's words before the gemzoo command, set for the workers
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's grace period before it SIGKILLs the workers
SHUTDOWN_S = 600  # gemzoo launch's default: a slow step plus a large checkpoint (torchrun's own is 30 s)


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)


def program(argv0: str | None = None) -> list[str]:
    """How gemzoo's command line was run in this process: ``python -m gemzoo.cli`` when ``sys.argv[0]`` is that
    package's ``__main__.py``, else ``gemzoo`` (the console script, or a program that calls its ``main``)."""
    path = Path(sys.argv[0] if argv0 is None else argv0)
    if path.name == "__main__.py" and path.parent.name == "cli":
        return ["python", "-m", "gemzoo.cli"]
    return ["gemzoo"]


def launch_command(argv: list[str], environ: dict[str, str] | None = None, argv0: str | None = None) -> list[str]:
    """The command (a list of words) that runs gemzoo with ``argv`` as this process was run, torchrun included."""
    env = os.environ if environ is None else environ
    if not under_torchrun(env):
        return [*program(argv0), *argv]
    if env.get(LAUNCH_ENV):  # a worker of `gemzoo launch`: the launch line, which starts torchrun again
        return [*shlex.split(env[LAUNCH_ENV]), *argv]
    nnodes = env.get("GROUP_WORLD_SIZE", "1")
    nproc = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE", "1")
    words = ["torchrun", "--nnodes", nnodes, "--nproc-per-node", nproc]
    if nnodes != "1" and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
        words += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return [*words, "-m", "gemzoo.cli", *argv]  # torchrun runs gemzoo's command line as a module


def launch_prefix(torchrun_options: list[str], argv0: str | None = None) -> list[str]:
    """``gemzoo launch OPTIONS --``: what comes before the gemzoo command in the line that launches it."""
    return [*program(argv0), "launch", *torchrun_options, "--"]


def torchrun_argv(torchrun_options: list[str], command: list[str]) -> list[str]:
    """torchrun's own command line for ``gemzoo launch OPTIONS -- COMMAND``: the workers run ``-m gemzoo.cli``."""
    return [*torchrun_options, "-m", "gemzoo.cli", *command]


def parse_torchrun(argv: list[str]):
    """torchrun's arguments, parsed by torchrun's own parser; a bad option is a ConfigError with its message."""
    from torch.distributed.run import get_args_parser

    from gemzoo.errors import ConfigError

    parser = get_args_parser()

    def refuse(message: str):
        raise ConfigError(f"launch: torchrun does not take these options: {message}; see torchrun --help "
                          "(the options before --) and gemzoo launch --help")

    parser.error = refuse
    return parser.parse_args(argv)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; [] where there is none)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields and int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


class Interruption:
    """The agent's signal handler while ``gemzoo launch`` runs. The first SIGINT or SIGTERM silences torchrun's
    logging and raises torchrun's ``SignalException``, whose handling sends that signal to every worker once
    and waits for them; a second SIGINT goes to the workers straight away (they stop without a checkpoint)."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.signum is None:
            self.signum = signum
            quiet_torchrun()
            raise SignalException(f"gemzoo launch got {signal.Signals(signum).name}", sigval=signal.Signals(signum))
        if signum == signal.SIGINT:  # again: the workers (each leads its own process group) stop at once
            for pid in children(os.getpid()):
                try:
                    os.killpg(pid, signal.SIGINT)
                except (ProcessLookupError, PermissionError):
                    pass


def quiet_torchrun() -> None:
    """torchrun's agent logs each step of its shutdown as a warning; after a signal the workers speak for it."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def run_torchrun(torchrun_options: list[str], command: list[str], argv0: str | None = None) -> int:
    """``gemzoo launch``: run torchrun's agent here over ``-m gemzoo.cli COMMAND``; the exit code to return."""
    import torch.distributed.elastic.multiprocessing.api as mp_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = parse_torchrun(torchrun_argv(torchrun_options, command))
    os.environ[LAUNCH_ENV] = shlex.join(launch_prefix(torchrun_options, argv0))
    os.environ.setdefault(SHUTDOWN_ENV, str(SHUTDOWN_S))
    handler = Interruption()
    saved = mp_api._terminate_process_handler
    mp_api._terminate_process_handler = handler  # what the agent installs for SIGINT, SIGTERM, SIGHUP, SIGQUIT
    try:
        run(args)
    except mp_api.SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        if handler.signum is not None:
            return 128 + handler.signum
        rank, failure = exc.get_first_failure()  # the others were stopped because of it
        how = f"with code {failure.exitcode}" if failure.exitcode > 0 else f"on {failure.signal_name()}"
        print(f"gemzoo launch: rank {rank} failed first, exiting {how}; its message is above (torchrun then "
              f"stopped the other workers)", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    finally:
        mp_api._terminate_process_handler = saved
    return 128 + handler.signum if handler.signum is not None else 0
