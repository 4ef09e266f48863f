"""Compiles after warm-up: which Triton kernel or TorchDynamo graph compiled again, and when.

A compile inside a training run's steady state stalls the step for seconds (a Triton kernel specialised again on
an integer argument that changed from batch to batch, or a graph that Dynamo traced again on a new shape). The
trainer counts them after its warm-up steps, writes the running count into each metrics row
(``compiles_after_warmup``) and warns once per kernel or graph with its name, so a stall in the step times has a
named cause.

Triton: ``triton.knobs.runtime.jit_cache_hook`` is called before every in-process compile of a ``@triton.jit``
kernel (a miss of the kernel's in-memory cache, whether or not the on-disk cache then serves it); the watcher
chains any hook installed before it. Dynamo: its ``unique_graphs`` counter. Neither exists under the Triton
interpreter or without torch.compile; the watcher then simply sees nothing.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def _triton_runtime_knobs() -> Any | None:
    try:
        from triton import knobs
    except Exception:  # triton missing, or a version without knobs: nothing to watch
        return None
    return getattr(knobs, "runtime", None)


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # a torch without Dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])


@dataclass
class CompileWatch:
    """Counts Triton JIT compiles by kernel name and Dynamo graphs, from ``start()`` to ``close()``.

    ``arm()`` marks the end of warm-up: only compiles after it count in ``after_warmup`` and in ``new_events()``.
    """

    triton: Counter = field(default_factory=Counter)
    _armed: bool = False
    _after: Counter = field(default_factory=Counter)
    _reported: set = field(default_factory=set)
    _signatures: dict = field(default_factory=dict)  # kernel -> the last compile's specialisation, for the warning
    _changes: dict = field(default_factory=dict)  # kernel -> what differed at its first compile after warm-up
    _graphs_at_arm: int = 0
    _graphs_reported: int = 0
    _previous: Any = None
    _knobs: Any = None
    _installed: bool = False
    _excluded: int = 0  # depth of ``excluded()`` blocks in progress
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> CompileWatch:
        knobs = _triton_runtime_knobs()
        if knobs is not None and hasattr(knobs, "jit_cache_hook"):
            self._knobs = knobs
            self._previous = knobs.jit_cache_hook
            knobs.jit_cache_hook = self._hook
            self._installed = True
        return self

    def __enter__(self) -> CompileWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._installed and self._knobs.jit_cache_hook == self._hook:
            self._knobs.jit_cache_hook = self._previous
        self._installed = False

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = str(getattr(fn, "name", None) or kwargs.get("key", "?")).rsplit(".", 1)[-1]  # local kernels' qualname
        self.record_triton(name, str(kwargs.get("repr", "")))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def record_triton(self, name: str, signature: str = "") -> None:
        """One compile of the Triton kernel ``name`` with its specialisation ``signature`` (Triton's
        ``kernel[options](arg: type, ...)`` text; what the hook calls, public for tests)."""
        with self._lock:
            self.triton[name] += 1
            before = self._signatures.get(name)
            self._signatures[name] = signature
            if self._armed and not self._excluded:
                self._after[name] += 1
                if name not in self._changes and before is not None:
                    self._changes[name] = _difference(before, signature)

    def arm(self) -> None:
        """Warm-up is over: count from here on."""
        with self._lock:
            self._armed = True
            self._after.clear()
            self._reported.clear()
            self._graphs_at_arm = _dynamo_graphs()
            self._graphs_reported = self._graphs_at_arm

    @contextmanager
    def excluded(self):
        """Compiles inside the block are not the training steps' stalls (an evaluation's own graph in eval mode,
        traced once): neither counted nor reported."""
        with self._lock:
            self._excluded += 1
            graphs = _dynamo_graphs()
        try:
            yield self
        finally:
            with self._lock:
                self._excluded -= 1
                new = _dynamo_graphs() - graphs
                self._graphs_at_arm += new
                self._graphs_reported += new

    @property
    def graphs_after_warmup(self) -> int:
        return max(0, _dynamo_graphs() - self._graphs_at_arm) if self._armed else 0

    @property
    def after_warmup(self) -> int:
        """Compiles after warm-up so far: Triton kernels plus Dynamo graphs."""
        with self._lock:
            return sum(self._after.values()) + self.graphs_after_warmup

    def new_events(self) -> list[str]:
        """What compiled after warm-up and was not reported yet, one line each (kernel names, or the number of new
        Dynamo graphs)."""
        lines = []
        with self._lock:
            for name, count in sorted(self._after.items()):
                if name not in self._reported:
                    self._reported.add(name)
                    changed = self._changes.get(name)
                    why = (f"specialisation changed: {changed}; a batch-varying argument is specialised (mark it "
                           "do_not_specialize)" if changed else
                           "a new tile configuration, or an integer argument that Triton specialises (on "
                           "divisibility by 16 or == 1) met a new value class; mark batch-varying counts "
                           "do_not_specialize")
                    lines.append(f"Triton kernel {name} compiled again after warm-up ({count}x so far): {why}")
        if self._armed:
            graphs = _dynamo_graphs()
            if graphs > self._graphs_reported:
                lines.append(f"torch.compile traced {graphs - self._graphs_reported} new graph(s) after warm-up "
                             "(a new shape or mode; TORCH_LOGS=recompiles names the guard)")
                self._graphs_reported = graphs
        return lines


def _difference(before: str, after: str) -> str:
    """The arguments whose specialisation differs between two of Triton's ``kernel[options](a: t, ...)`` texts,
    as ``a t -> t'`` ("" when only the options or constexprs differ)."""
    def args(text: str) -> dict[str, str]:
        inner = text[text.find("](") + 2:].rstrip(")") if "](" in text else ""
        pairs = (part.split(": ", 1) for part in inner.split(", ") if ": " in part)
        return {k.strip(): v.strip() for k, v in pairs}

    a, b = args(before), args(after)
    return ", ".join(f"{k} {a[k]} -> {b[k]}" for k in a if k in b and a[k] != b[k])
