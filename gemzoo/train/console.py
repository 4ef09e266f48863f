"""What a run shows on the terminal, and ``train.log``, which keeps all of it.

- The start banner: model and parameter count, the plugins per kind, device and world size, data and steps.
- On a terminal, a one-line progress bar that fits 80 columns (step, loss, samples/s, MFU, ETA); evaluation
  rows and every other line print above it and stay on screen.
- When stdout is not a terminal (a batch job, a pipe), plain lines instead: one per logged row.
- ``RunLog``: while a run trains, whatever it prints to stdout and stderr (on rank 0) is also written to
  ``<run folder>/train.log``, without the progress bar's redraws.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

LOG = "train.log"


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal's stream and to the run log. While a progress bar is live
    (``console`` set) whole lines go through the bar's console, which prints them above the bar."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log = stream, log
        self.console: Console | None = None
        self._pending = ""

    def write(self, text: str) -> int:
        if not self.log.closed:
            self.log.write(text)
            self.log.flush()
        if self.console is None:
            self.stream.write(text)
            return len(text)
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True, emoji=False)
        return len(text)

    def flush(self) -> None:
        if self.console is not None and self._pending:
            self.console.print(self._pending, markup=False, highlight=False, soft_wrap=True, emoji=False, end="")
            self._pending = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


class RunLog:
    """Copies stdout and stderr into ``<out_dir>/train.log`` until ``close`` (appends on resume). A disabled
    RunLog (ranks other than 0) does nothing."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, append: bool = False):
        self.path = Path(out_dir) / LOG
        self.enabled = enabled
        self._file: TextIO | None = None
        self._saved: tuple[TextIO, TextIO] | None = None
        self.out: _Tee | None = None
        self.err: _Tee | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        earlier = append and self.path.is_file()
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # closed by close()
        if earlier:
            self._file.write(f"\n--- resumed {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        self._saved = (sys.stdout, sys.stderr)
        self.out, self.err = _Tee(sys.stdout, self._file), _Tee(sys.stderr, self._file)
        sys.stdout, sys.stderr = self.out, self.err

    @property
    def terminal(self) -> TextIO:
        """The real stdout (the progress bar draws there, and its redraws stay out of the log)."""
        return self._saved[0] if self._saved else sys.stdout

    def attach(self, console: Console | None) -> None:
        """Route printed lines through ``console`` (a live progress bar's) until ``attach(None)``."""
        for tee in (self.out, self.err):
            if tee is not None:
                tee.flush()
                tee.console = console

    def note(self, line: str) -> None:
        """A line for the log alone: the rows the progress bar stands for on a terminal."""
        if self._file is not None and not self._file.closed:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._saved is None:
            return
        self.attach(None)
        for tee in (self.out, self.err):
            tee.flush()
        if (sys.stdout, sys.stderr) == (self.out, self.err):
            sys.stdout, sys.stderr = self._saved
        self._saved = None
        self._file.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def count(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def banner(*, name: str, model: str, parameters: int, plugins: dict[str, list[str]], device: str, world_size: int,
           data: str, batch_size: int, steps: int, start_step: int, out_dir: Path) -> str:
    """The lines that open a run: what is trained, with which plugins, where, on what, for how long."""
    plugin_text = "  ".join(f"{k} {','.join(v) or '-'}" for k, v in plugins.items())
    start = f" (resuming at step {start_step})" if start_step else ""
    rows = [f"gemzoo train: {name} -> {out_dir}",
            f"  model    {model}, {count(parameters)} parameters ({parameters:,})",
            f"  plugins  {plugin_text}",
            f"  device   {device}" + (f" x {world_size} ranks" if world_size > 1 else ""),
            f"  data     {data}, global batch {batch_size}",
            f"  steps    {steps}{start}"]
    return "\n".join(rows)


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def short_info(m: dict) -> str:
    """The progress bar's numbers: loss, samples/s, MFU (at most 34 characters)."""
    return f"loss {m['loss']:.4f} {count(m['samples_per_s']):>6} sam/s MFU {100 * m['mfu']:.1f}%"


def log_line(step: int, steps: int, m: dict, eta_s: float) -> str:
    """One plain line for logs that are not a terminal (torchtitan style)."""
    parts = [f"step {step:>{len(str(steps))}}/{steps}", f"loss {m['loss']:.4f}"]
    if "lr" in m:
        parts.append(f"lr {m['lr']:.3g}")
    if "grad_norm" in m:
        parts.append(f"grad_norm {m['grad_norm']:.3g}")
    parts += [f"samples/s {m['samples_per_s']:,.0f}", f"tokens/s {m['tokens_per_s']:,.0f}",
              f"tflops {m['tflops']:.3g}", f"mfu {100 * m['mfu']:.2f}%", f"mem {m['peak_mem_gib']:.2f} GiB",
              f"eta {clock(eta_s)}"]
    parts += [f"{k} {v:.4f}" for k, v in m.items() if k.startswith("eval/")]
    return "  ".join(parts)


def eval_line(step: int, steps: int, m: dict) -> str:
    """The row an evaluation prints (it stays on screen above the progress bar)."""
    evals = "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in m.items() if k.startswith("eval/"))
    return f"eval  step {step:>{len(str(steps))}}/{steps}  {evals}  (train loss {m['loss']:.4f})"


class _Bar(Progress):
    """rich's Progress, except that a disabled one prints nothing when it stops (rich's prints an empty line
    when stdout is not a terminal: one per rank, and one in every ``--quiet`` run's output)."""

    def stop(self) -> None:
        if not self.disable:
            super().stop()


def progress_bar(enabled: bool, file: TextIO | None = None) -> Progress:
    """The terminal's one-line progress bar (rich), at most 80 columns: ``step 120/400``, a bar,
    ``loss 0.6931  1.23k sam/s MFU 1.2%``, ``eta 0:01:23``. A no-op when ``enabled`` is false."""
    console = Console(file=file) if file is not None else None
    return _Bar(TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=12),
                    TextColumn("{task.fields[info]}"), TextColumn("eta"), TimeRemainingColumn(),
                    console=console, disable=not enabled, redirect_stdout=False, redirect_stderr=False)


def attached(progress: Progress, log: RunLog | None) -> Any:
    """A context in which printed lines go above ``progress``'s bar (and into the run log)."""

    class _Attach:
        def __enter__(self):
            if log is not None and not progress.disable:
                log.attach(progress.console)
            return self

        def __exit__(self, *exc):
            if log is not None:
                log.attach(None)

    return _Attach()
