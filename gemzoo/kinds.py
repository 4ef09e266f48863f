"""The one table of registry kinds.

Each kind says which hook registers it, the Protocol (or spec type) its entries satisfy, whether a run takes
one entry or a list, where a config names it and what it defaults to, and which conformance suite checks it.

    >>> from gemzoo.kinds import KINDS, kind
    >>> kind("memory").many, kind("memory").config_key
    (True, 'plugins.memory')
    >>> [k.name for k in KINDS if k.in_plugins]
    ['attention', 'precision', 'planner', 'comms', 'memory', 'batching']

Everything that lists kinds derives from this table: the registry (which hook fills which kind),
``config.PluginsConfig`` (one field per [plugins] kind, a list where ``many``) and ``--plugins``, the CLI's
``list`` choices and ``new-plugin --kind`` (the kinds it has a template for), the plugins a run records as
selected (:func:`selected`), and the kind keys of the config reference (``scripts/gen_docs.py``). Adding a kind
touches ``hookspecs.py``, this table and ``interfaces/`` only; ``tests/test_kinds.py`` adds one in a subprocess
to show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol

from gemzoo.interfaces.attention import AttentionKernel
from gemzoo.interfaces.batching import BatchingPolicy
from gemzoo.interfaces.comms import CommsBackend
from gemzoo.interfaces.memory import MemoryPolicy
from gemzoo.interfaces.models import Dataset, DatasetSpec, ModelSpec, RecModel
from gemzoo.interfaces.planner import Planner
from gemzoo.interfaces.precision import PrecisionPolicy


@dataclass(frozen=True)
class Kind:
    """One registry kind.

    ``protocol``: what every registered entry is (a runtime-checkable Protocol, or the spec dataclass for
    model and dataset, whose ``build`` returns a ``builds``). ``many``: a run takes a list of entries, applied
    in order (memory), else exactly one. ``config_key``: the dotted config key that names the run's
    entry (or entries). ``default``: the name(s) used when the config gives none; ``None`` when the config must
    name one ([model] family, [data] source). ``conformance``: the ``gemzoo.testing`` module whose suite
    every entry of the kind passes.
    """

    name: str
    hook: str
    protocol: type
    many: bool
    config_key: str
    default: str | tuple[str, ...] | None
    conformance: str
    builds: type | None = None
    description: str = ""

    @property
    def in_plugins(self) -> bool:
        """Chosen in the [plugins] table (and by ``--plugins``), not in [model] / [data]."""
        return self.config_key.startswith("plugins.")

    @property
    def slot(self) -> str:
        """The field of its config section: ``attention``, ``memory``, ``family``, ``source``."""
        return self.config_key.rpartition(".")[2]


KINDS: tuple[Kind, ...] = (
    Kind("attention", "gemzoo_register_attention", AttentionKernel, False, "plugins.attention", "reference",
         "gemzoo.testing.attention", description="jagged attention kernels (per attention site)"),
    Kind("precision", "gemzoo_register_precision", PrecisionPolicy, False, "plugins.precision", "fp32",
         "gemzoo.testing.precision", description="linear and attention-matmul precision policies"),
    Kind("planner", "gemzoo_register_planners", Planner, False, "plugins.planner", "torchrec",
         "gemzoo.testing.planner", description="embedding-table sharding planners"),
    Kind("comms", "gemzoo_register_comms", CommsBackend, False, "plugins.comms", "torch",
         "gemzoo.testing.comms", description="c10d communication backends"),
    Kind("memory", "gemzoo_register_memory", MemoryPolicy, True, "plugins.memory", (),
         "gemzoo.testing.memory", description="activation-memory policies, applied in list order"),
    Kind("batching", "gemzoo_register_batching", BatchingPolicy, False, "plugins.batching", "none",
         "gemzoo.testing.batching", description="policies that assign samples to data-parallel ranks"),
    Kind("model", "gemzoo_register_models", ModelSpec, False, "model.family", None,
         "gemzoo.testing.models", builds=RecModel, description="model families"),
    Kind("dataset", "gemzoo_register_datasets", DatasetSpec, False, "data.source", None,
         "gemzoo.testing.models", builds=Dataset, description="datasets"),
)



def kind(name: str) -> Kind:
    """The kind called ``name``; ``KeyError`` naming the kinds that exist."""
    for k in KINDS:
        if k.name == name:
            return k
    raise KeyError(f"unknown kind {name!r}; the kinds are: {', '.join(names())}")


def _protocol_members(proto: type) -> list[str]:
    """The attributes and methods a Protocol declares (its own and its bases'), ``__call__`` included."""
    out: list[str] = []
    for cls in proto.__mro__:
        if cls in (object, Protocol, Generic) or not getattr(cls, "_is_protocol", False):
            continue
        for name in [*getattr(cls, "__annotations__", {}), *vars(cls)]:
            public = not name.startswith("_") or name == "__call__"
            if public and name not in out:
                out.append(name)
    return out


def conformance_problem(kind_name: str, obj: Any) -> str | None:
    """Why ``obj`` cannot be a ``kind_name`` entry (a Protocol member it lacks, a spec of another type), or None.
    The registry asks it of every registered object, so a plugin that registers, say, a function as an
    attention kernel fails to load with this reason instead of failing in the middle of a run."""
    k = kind(kind_name)
    proto = k.protocol
    if not getattr(proto, "_is_protocol", False):
        if isinstance(obj, proto):
            return None
        return f"a {kind_name} entry must be a {proto.__name__}, got {type(obj).__name__}"
    missing = [m for m in _protocol_members(proto)
               if not hasattr(obj, m) or (callable(getattr(proto, m, None)) and not callable(getattr(obj, m)))]
    if not missing:
        return None
    return (f"a {kind_name} entry must be a {proto.__name__} (gemzoo.interfaces), but this "
            f"{type(obj).__name__} lacks {', '.join(missing)}")


def names() -> list[str]:
    """Every kind's name, in table order."""
    return [k.name for k in KINDS]


def plugin_kinds() -> list[Kind]:
    """The kinds a run picks in [plugins] (and ``--plugins``), in table order."""
    return [k for k in KINDS if k.in_plugins]


def hooks() -> dict[str, str]:
    """Kind name -> its registration hook, in table order."""
    return {k.name: k.hook for k in KINDS}


def selected(plugins) -> dict[str, list[str]]:
    """Kind name -> the entry names a ``PluginsConfig`` selects for it (one name, or the list of a ``many``
    kind), for every [plugins] kind in table order."""
    out = {}
    for k in plugin_kinds():
        value = getattr(plugins, k.slot)
        out[k.name] = list(value) if k.many else [value]
    return out


__all__ = ["Kind", "KINDS", "kind", "conformance_problem", "names", "plugin_kinds", "hooks", "selected"]
