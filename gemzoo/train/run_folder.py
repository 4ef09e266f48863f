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

A running trainer holds an exclusive ``fcntl`` lock on ``<run folder>/.lock`` (rank 0 only under torchrun;
the other ranks wait for it at the first barrier); the file records its PID and host. A second trainer into the
same folder (fresh, ``--resume`` or ``--overwrite``) fails at once naming them. The kernel releases the lock
when its holder exits, however it exits, so a crash leaves no stale lock to clean up.

Resuming at step S supersedes whatever the folder holds after S: those metrics rows are dropped (a
``resume`` event marks the point), and so are temporary folders a crash left behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from gemzoo.errors import ConfigError

METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"  # the running trainer's lock file (PID and host); not part of the run's results
# what gemzoo writes into a run folder (--overwrite deletes these, nothing else; never the lock)
RUN_ENTRIES = (METRICS, CHECKPOINTS, "config.toml", "command.txt", "provenance.json", "train.log")


class RunFolderBusy(ConfigError):
    """Another trainer holds the run folder's lock."""


class RunLock:
    """The exclusive lock of one run folder, held from ``acquire`` until ``release`` or the process's end."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, folder: str | Path) -> RunLock:
        """Create ``folder`` if needed and lock it; RunFolderBusy naming the holder, or ConfigError when the
        folder cannot be written."""
        folder = Path(folder)
        path = folder / LOCK
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot write to run folder {folder}: {exc.strerror or exc}. Choose a writable "
                              "folder with --out DIR (or run.out_dir)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise ConfigError(f"cannot lock run folder {folder} ({path}): {exc.strerror or exc}") from None
            raise RunFolderBusy(_busy_message(folder, holder)) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode() + b"\n")
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock; the file stays (it is not state)
            self._fd = None

    __del__ = release


def _busy_message(folder: Path, holder: str) -> str:
    try:
        info = json.loads(holder)
        who = f"PID {info['pid']} on host {info['host']} (since {info.get('since', '?')})"
    except (ValueError, TypeError, KeyError):
        who = "another process (it recorded no PID)"
    return (f"run folder {folder} is in use: a trainer holds its lock, {who}. Wait for it to finish, stop it, "
            "or write this run to another folder with --out DIR; two runs in one folder would mix their "
            "metrics and checkpoints.")


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
    entries = sorted(p.name for p in path.iterdir() if p.name != LOCK)
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


def trim_metrics(path: str | Path, step: int) -> list[str]:
    """Drop the rows of ``metrics.jsonl`` a resume at ``step`` supersedes; returns what went and why, one
    phrase per reason (``end`` events not counted: a finished run that goes on drops its own).

    Superseded: step rows after ``step`` (the resumed run writes them again), ``end`` events (the run goes on),
    and lines that are not a JSON object: cut short by a kill, or not text at all. The file is rewritten
    atomically (temporary file, fsync, rename)."""
    path = Path(path)
    if not path.is_file():
        return []
    kept: list[bytes] = []
    dropped: dict[str, list[int]] = {}
    rewrite = False
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            rewrite = rewrite or bool(line)
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            dropped.setdefault("not UTF-8 text", []).append(number)
            continue
        except json.JSONDecodeError:
            dropped.setdefault("not JSON (cut short by a kill, or overwritten)", []).append(number)
            continue
        if not isinstance(record, dict):
            dropped.setdefault("not a JSON object", []).append(number)
            continue
        row_step = record.get("step")
        if isinstance(row_step, int) and row_step > step:
            dropped.setdefault(f"after step {step}, where the run resumes (it writes them again)", []).append(number)
        elif record.get("event") == "end":
            rewrite = True
        else:
            kept.append(line)
    if dropped or rewrite:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return [f"{len(lines)} row(s) {_line_numbers(lines)}: {why}" for why, lines in dropped.items()]


def _line_numbers(numbers: list[int]) -> str:
    """[3, 4, 5, 9] -> "(lines 3-5, 9)"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:6]) + (", ..." if len(spans) > 6 else "")
    return f"(line{'s' if len(numbers) > 1 else ''} {text})"


def run_folder_of(path: str | Path) -> Path | None:
    """The run folder ``--resume PATH`` names: PATH itself, or the parent of a ``checkpoints/`` folder;
    None for one ``step-*`` checkpoint folder (that run continues in --out / run.out_dir) or a missing path."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir() or (path / METRICS).is_file():
        return path
    if path.name == CHECKPOINTS and path.is_dir():
        return path.parent
    return None
