"""``gemzoo train``: train from a config into a run folder; on SIGTERM or Ctrl-C, print the command that resumes.

Under torchrun only rank 0 prints, and the command it prints is the whole ``torchrun ... --resume`` line
(``gemzoo.distributed.launch``). An interrupted run exits with 128 + the signal's number (130 for Ctrl-C).
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from gemzoo import registry
from gemzoo.cli.common import load_run_config
from gemzoo.distributed.launch import launch_command
from gemzoo.errors import GemzooError
from gemzoo.train import run_folder
from gemzoo.train.console import LOG
from gemzoo.train.loop import TrainingInterrupted
from gemzoo.train.metrics import json_safe
from gemzoo.train.trainer import train
from gemzoo.train.warnings_filter import quiet_known_warnings


def resume_command(argv: list[str], resumed: bool) -> str:
    """The command that continues the run ``argv`` started: the same words without ``--overwrite``, with
    ``--resume`` (and under torchrun, torchrun's own)."""
    words = [a for a in argv if a != "--overwrite"]
    return shlex.join(launch_command([*words, *([] if resumed else ["--resume"])]))


def cmd_train(args) -> int:
    if not getattr(args, "verbose", False):
        quiet_known_warnings()
    cfg = load_run_config(args)
    for name, info in registry.host().failed().items():  # one line each: the run goes on without them
        print(f"gemzoo: warning: plugin {name!r} ({info.distribution}) failed to load and is left out: {info.error}",
              file=sys.stderr)
    if args.out:
        cfg.run.out_dir = args.out
    elif isinstance(args.resume, str) and run_folder.run_folder_of(args.resume) is not None:
        cfg.run.out_dir = str(run_folder.run_folder_of(args.resume))  # --resume RUN_FOLDER continues it there
    resume = args.resume if args.resume is not None else False
    argv = list(getattr(args, "argv", sys.argv[1:]))
    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        result = train(cfg, resume=resume, progress=not args.quiet, overwrite=args.overwrite,
                       command=shlex.join(launch_command(argv)))
    except (TrainingInterrupted, KeyboardInterrupt) as exc:
        if not main_rank:
            return 128 + (exc.signum if isinstance(exc, TrainingInterrupted) else 2)
        again = resume_command(argv, args.resume is not None)
        if isinstance(exc, TrainingInterrupted):
            message = (f"gemzoo: {exc.signal_name}: stopped after step {exc.step}; checkpoint "
                       f"{exc.checkpoint or cfg.run.out_dir}. Resume with:\n  {again}")
            code = 128 + exc.signum
        else:
            message = f"gemzoo: interrupted at once, without a checkpoint; resume from the last one with:\n  {again}"
            code = 130
        print(message, file=sys.stderr)
        _append_log(cfg.run.out_dir, message)
        return code
    except GemzooError as exc:  # printed by the command line; the run's log keeps it too
        if main_rank:
            _append_log(cfg.run.out_dir, f"gemzoo: error: {exc}")
        raise
    if result.is_main:
        summary = {"final_loss": result.final_loss, "steps": result.steps, **result.eval, **result.throughput,
                   "out_dir": str(result.out_dir)}
        line = json.dumps(json_safe(summary), allow_nan=False)
        print(line)
        _append_log(str(result.out_dir), line)
    return 0


def _append_log(out_dir: str, message: str) -> None:
    """The interruption message belongs in train.log too (the log is closed by then)."""
    path = os.path.join(out_dir, LOG)
    if os.path.isfile(path):
        with open(path, "a", encoding="utf-8") as f:
            f.write(message + "\n")
