"""How this process was launched, as a command a shell takes back: ``gemzoo train ...``, ``python -m gemzoo.cli
train ...``, or under torchrun ``torchrun --nnodes N --nproc-per-node M -m gemzoo.cli train ...`` rebuilt from
the environment torchrun gives each worker (``TORCHELASTIC_RUN_ID``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``). The resume hint and ``command.txt`` print it."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
    nnodes = env.get("GROUP_WORLD_SIZE", "1")
    nproc = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE", "1")
    words = ["torchrun", "--nnodes", nnodes, "--nproc-per-node", nproc]
    if nnodes != "1" and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
        words += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return [*words, "-m", "gemzoo.cli", *argv]  # torchrun runs gemzoo's command line as a module
