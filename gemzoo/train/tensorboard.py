"""TensorBoard logging (``run.tensorboard = true``; optional dependency: ``pip install gemzoo[tensorboard]``).

Every step row the trainer writes to ``metrics.jsonl`` is mirrored as scalars (same names: ``loss``,
``samples_per_s``, ``mfu``, ``eval/auc_click``, ...) into ``<run folder>/tensorboard/``, and the resolved
config is written once as text. ``metrics.jsonl`` stays the source of truth; the event files are a view.
A resumed run purges the event files' points after the resume step, as ``metrics.jsonl`` drops its rows.

    tensorboard --logdir runs/
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gemzoo.errors import ConfigError

TB_DIR = "tensorboard"


def require_tensorboard():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(f"run.tensorboard = true needs the tensorboard package ({exc}). Install it with "
                          "pip install 'gemzoo[tensorboard]' (or set run.tensorboard = false)") from None
    return SummaryWriter


def scalars(record: dict) -> dict[str, float]:
    """The finite numeric entries of one step row (``step`` and ``time`` excluded)."""
    out = {}
    for key, value in record.items():
        if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoardLog:
    """Wraps the trainer's MetricsLog: each ``write`` goes to metrics.jsonl first, then to TensorBoard."""

    def __init__(self, log, out_dir: str | Path, config: dict, *, start_step: int = 0):
        SummaryWriter = require_tensorboard()
        self.log = log
        self.dir = Path(out_dir) / TB_DIR
        self.writer = SummaryWriter(str(self.dir), purge_step=start_step + 1 if start_step > 0 else None)
        text = json.dumps(config, indent=1, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), start_step)

    def write(self, record: dict) -> None:
        self.log.write(record)
        if "event" in record or not isinstance(record.get("step"), int):
            return
        step = record["step"]
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.log.close()
        self.writer.close()

    def __getattr__(self, name):  # everything else is the MetricsLog's
        return getattr(self.log, name)


def maybe_tensorboard(log, cfg, out_dir: str | Path, start_step: int = 0):
    """``log`` itself, or ``log`` mirrored into TensorBoard when ``run.tensorboard`` is on (main rank only)."""
    if log is None or not getattr(cfg.run, "tensorboard", False):
        return log
    return TensorBoardLog(log, out_dir, cfg.to_dict(), start_step=start_step)
