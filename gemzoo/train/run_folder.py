"""The run folder: everything one training run writes under ``run.out_dir`` (or ``--out``).

    <run folder>/metrics.jsonl                  one JSON object a line: start / resume / end events and step rows
    <run folder>/checkpoints/step-00000100/     atomic safetensors checkpoints + manifest.json (train/checkpoint.py)
    <run folder>/config.toml, command.txt,      how the run was made (train/provenance.py)
                 provenance.json
    <run folder>/train.log                      everything the run printed (train/console.py)

One folder holds one run. A fresh run refuses a folder that is not empty unless it is told what to do:
``--resume`` continues the run in it, ``--overwrite`` deletes the old run's files (``metrics.jsonl`` and
``checkpoints/``, nothing else) first. Otherwise two runs would mix their metrics and checkpoints, and
``checkpoint.keep`` would delete the new run's checkpoints because the old ones sort higher.

Resuming at step S supersedes whatever the folder holds after S: those metrics rows are dropped (a
``resume`` event marks the point), and so are temporary folders a crash left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gemzoo.errors import ConfigError

METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# what gemzoo writes into a run folder (--overwrite deletes these, nothing else)
RUN_ENTRIES = (METRICS, CHECKPOINTS, "config.toml", "command.txt", "provenance.json", "train.log")


def check_run_folder(path: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a non-empty run folder for a fresh run (neither ``resume`` nor ``overwrite``)."""
    path = Path(path)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{path}, --overwrite deletes it; pass one of them")
    if resume or overwrite or not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"run folder {path} is a file; choose another folder with --out DIR (or run.out_dir)")
    entries = sorted(p.name for p in path.iterdir())
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(
            f"run folder {path} is not empty ({shown}). Pass --resume to continue the run in it, "
            f"--overwrite to delete its {METRICS} and {CHECKPOINTS}/ and start again, or --out DIR "
            "(or --set run.out_dir=DIR) to start a new run in another folder."
        )


def clear_run_folder(path: str | Path) -> list[str]:
    """``--overwrite``: delete the files a previous run wrote (only those); returns what was deleted."""
    path = Path(path)
    removed = []
    for name in RUN_ENTRIES:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()
        else:
            continue
        removed.append(name)
    return removed


def trim_metrics(path: str | Path, step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` a resume at ``step`` supersedes; returns how many went
    (``end`` events not counted: a finished run that goes on drops its own).

    Superseded: step rows after ``step``, ``end`` events (the run goes on) and lines a kill cut short.
    The file is rewritten atomically (temporary file, fsync, rename)."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped, rewrite = [], 0, False
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if not isinstance(record, dict):
            dropped += 1
            continue
        row_step = record.get("step")
        if isinstance(row_step, int) and row_step > step:
            dropped += 1
        elif record.get("event") == "end":
            rewrite = True
        else:
            kept.append(line)
    if dropped or rewrite:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def run_folder_of(path: str | Path) -> Path | None:
    """The run folder ``--resume PATH`` names: PATH itself, or the parent of a ``checkpoints/`` folder;
    None for one ``step-*`` checkpoint folder (that run continues in --out / run.out_dir) or a missing path."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir() or (path / METRICS).is_file():
        return path
    if path.name == CHECKPOINTS and path.is_dir():
        return path.parent
    return None
