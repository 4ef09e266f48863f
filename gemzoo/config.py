"""TOML config -> dataclasses. Unknown keys are errors; ``--set a.b=c`` overrides; plugin lists.

    cfg = load_config("configs/gem-tiny.toml", overrides=["run.steps=50"], plugins="jfa,mxfp8")

[model] and [data] take the fields of the chosen family's / dataset's own config dataclass;
[plugins.options.NAME] takes the fields of plugin NAME's ``options_cls``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import tomllib

from gemzoo import kinds
from gemzoo import registry as default_registry
from gemzoo.distributed.dense import check_mesh_table
from gemzoo.errors import ConfigError, PluginError
from gemzoo.interfaces.options import bounded


@dataclass
class RunConfig:
    name: str = "run"
    steps: int = bounded(100, min=1)
    seed: int = bounded(0, min=0)
    out_dir: str = "runs/run"
    device: str = bounded("auto", pattern=r"auto|cpu|cuda(:\d+)?", means="auto, cpu, cuda or cuda:N")
    log_every: int = bounded(10, min=1)
    # steps left out of the run's mean throughput (compiles, allocator and cache warm-up); compiles after them are
    # counted in the metrics (compiles_after_warmup) and named in a warning
    warmup: int = bounded(5, min=0)
    # when the loop waits for the device: "step" synchronizes after every step and reads its numbers (each step
    # timed alone); "log" only at steps that write a row, evaluate, checkpoint or stop, so the host queues the
    # next steps' work while the device runs (the steps between two such points share their mean time)
    sync: str = bounded("step", choices=("step", "log"))
    compile: bool = False
    # what run.compile compiles: "blocks" compiles each transformer block on its own (regional compilation: the
    # blocks share one compiled graph, so compile time does not grow with depth); "model" the whole forward
    compile_scope: str = bounded("blocks", choices=("blocks", "model"))
    peak_tflops: float | None = bounded(None, min=1e-9)  # overrides the device table for MFU
    # torch.set_float32_matmul_precision for the run: "highest" (torch's default) multiplies fp32 in full fp32,
    # "high" in TF32 (GPU), in torch's matmuls, Inductor's kernels and gemzoo's attention kernels alike
    matmul_precision: str = bounded("highest", choices=("highest", "high", "medium"))
    # several ranks: "fsdp" shards transformer blocks (FSDP2), "ddp" replicates them
    dense_parallel: str = bounded("fsdp", choices=("fsdp", "ddp"))
    # 3D dense layout, e.g. {replicate = 2, shard = 2, tp = 2}: HSDP (FSDP2 over shard, replicated over replicate)
    # and tensor parallelism over tp; product = world size (shard defaults to the rest); {}: dense_parallel over all
    mesh: dict[str, int] = field(default_factory=dict)
    tensorboard: bool = False  # also write metrics.jsonl's rows as TensorBoard scalars (pip install gemzoo[tensorboard])

    def __post_init__(self):
        check_mesh_table(self.mesh, self.dense_parallel)


@dataclass
class OptimConfig:
    lr: float = bounded(1e-3, min=0)
    weight_decay: float = bounded(0.0, min=0)
    sparse_lr: float = bounded(0.05, min=0)
    grad_clip: float = bounded(1.0, min=0)  # 0: no clipping
    betas: list[float] = bounded([0.9, 0.999], min=0, below=1, length=2)  # dense AdamW (beta1, beta2)
    warmup_steps: int = bounded(0, min=0)


def _kind_slot(k) -> tuple[str, str, dataclasses.Field]:
    """A [plugins] kind's field: a list of names where the kind takes several (memory), else one name."""
    if k.many:
        return k.slot, "list[str]", field(default_factory=lambda default=k.default: list(default))
    return k.slot, "str", field(default=k.default)


# One field per [plugins] kind of the kinds table (gemzoo.kinds), in its order, with its default.
_PluginSlots = dataclasses.make_dataclass("_PluginSlots", [_kind_slot(k) for k in kinds.plugin_kinds()])
_PluginSlots.__module__ = __name__


@dataclass
class PluginsConfig(_PluginSlots):
    """[plugins]: one field per [plugins] kind of ``gemzoo.kinds`` (a list for a kind that takes several, such
    as memory), then the plugins' options and the per-site attention kernels."""

    options: dict[str, Any] = field(default_factory=dict)  # plugin name -> its options dataclass
    # attention site (a name such as "cross", a dotted module path or an fnmatch pattern) -> its kernel;
    # sites not named here use ``attention``
    attention_sites: dict[str, str] = field(default_factory=dict)


@dataclass
class PrecisionSection:
    keep: list[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    every: int = bounded(100, min=0)  # 0: no evaluation
    batches: int = bounded(8, min=1)


@dataclass
class CheckpointConfig:
    every: int = bounded(100, min=0)  # 0: a checkpoint only when SIGTERM / Ctrl-C stops the run
    keep: int = bounded(2, min=0)  # 0: keep every checkpoint


@dataclass
class Config:
    run: RunConfig
    model: Any
    data: Any
    optim: OptimConfig = field(default_factory=OptimConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    source: str = "<dict>"

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name == "source":
                continue
            out[f.name] = _to_plain(getattr(self, f.name))
        return out


SECTIONS = {
    "run": RunConfig,
    "optim": OptimConfig,
    "precision": PrecisionSection,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
}


def _to_plain(value):
    if is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value


def _unknown_key(section: str, key: str, valid: list[str], source: str) -> ConfigError:
    msg = f"{source}: unknown key {section}.{key}. Valid keys in [{section}]: {', '.join(sorted(valid))}."
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        msg += f" Did you mean {section}.{close[0]}?"
    return ConfigError(msg)


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}
_LIST = re.compile(r"^(?:list|tuple)\[\s*(\w+)\s*(?:,\s*\.\.\.\s*)?\]$")


def _hint(f: dataclasses.Field) -> str:
    """The field's annotation as text: ``"int"``, ``"float | None"``, ``"list[int]"``."""
    if isinstance(f.type, str):
        return f.type
    return str(f.type) if hasattr(f.type, "__origin__") else getattr(f.type, "__name__", str(f.type))


def _coerce(want: str, value: Any, name: str, source: str) -> Any:
    """``value`` as a ``want`` (int -> float is the one coercion); ConfigError naming the field otherwise."""
    typ = _SCALARS.get(want)
    if typ is None or value is None:
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {name} must be {want}, got {value!r} ({type(value).__name__})")
    return value


def _check_type(section: str, f: dataclasses.Field, value: Any, source: str) -> Any:
    """The annotation's type, with the obvious coercion (int -> float), for a scalar and for each element of a
    ``list[T]``; NaN and infinities are refused in any float."""
    want = _hint(f).split("|")[0].strip()
    name = f"{section}.{f.name}"
    if want.startswith(("list", "tuple")):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {name} must be a list, got {value!r}")
        m = _LIST.match(want)
        if m is not None:
            value = [_coerce(m.group(1), v, f"{name}[{i}]", source) for i, v in enumerate(value)]
    else:
        value = _coerce(want, value, name, source)
    for i, v in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(v, float) and not math.isfinite(v):
            where = f"{name}[{i}]" if isinstance(value, list) else name
            raise ConfigError(f"{source}: {where} must be a finite number, got {v!r}")
    return value


def _bound_text(meta: dict) -> str:
    """The range a field's metadata allows, in words: ">= 0", "in [0, 1)", "<= 8"."""
    low, high, below = meta.get("min"), meta.get("max"), meta.get("below")
    top = f"{high}]" if high is not None else (f"{below})" if below is not None else None)
    if low is not None and top is not None:
        return f"in [{low}, {top}"
    if low is not None:
        return ">= 0" if low == 0 else (f">= {low}" if low >= 1 else "> 0")
    return f"<= {high}" if high is not None else f"< {below}"


def _in_range(meta: dict, v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return True
    low, high, below = meta.get("min"), meta.get("max"), meta.get("below")
    return not ((low is not None and v < low) or (high is not None and v > high)
                or (below is not None and v >= below))


def _check_range(section: str, f: dataclasses.Field, value: Any, source: str) -> None:
    """The bounds a ``bounded`` field declares: for a list its length, and each element's range."""
    meta = f.metadata
    if value is None or not meta:
        return
    name = f"{source}: {section}.{f.name}"
    items = value if isinstance(value, (list, tuple)) else None
    length = meta.get("length")
    if items is not None and length is not None:
        lo, hi = (length, length) if isinstance(length, int) else length
        if len(items) < lo or (hi and len(items) > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if not hi else f"{lo} to {hi}")
            raise ConfigError(f"{name} must list {want} value(s), got {len(items)}: {value!r}")
    for i, v in enumerate(items if items is not None else [value]):
        if not _in_range(meta, v):
            where = f"{name}[{i}]" if items is not None else name
            raise ConfigError(f"{where} must be {_bound_text(meta)}, got {v!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    pattern = meta.get("pattern")
    if pattern is not None and not (isinstance(value, str) and re.fullmatch(pattern, value)):
        raise ConfigError(f"{name} must be {meta.get('means') or pattern}, got {value!r}")


def build_dataclass(cls, table: dict, section: str, source: str = "<config>"):
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{section}] must be a table, got {table!r}")
    valid = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in table.items():
        if key not in valid:
            raise _unknown_key(section, key, list(valid), source)
        kwargs[key] = _check_type(section, valid[key], value, source)
        _check_range(section, valid[key], kwargs[key], source)
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # a rule between fields (the dataclass's __post_init__)
        text = str(exc)
        raise ConfigError(text if text.startswith(source) else f"{source}: {text}") from None
    except TypeError as exc:
        missing = [f.name for f in fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in kwargs]
        raise ConfigError(f"{source}: [{section}] is missing required keys {missing} ({exc})") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """'model.d_model=256' -> (['model', 'd_model'], 256); the value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set run.steps=50")
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {text!r}: the key must be SECTION.NAME, e.g. run.steps")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides or []:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {part} is not a table")
        node[path[-1]] = value
    return raw


def _plugin_names(plugin_list: str | list[str] | None) -> list[str]:
    """``--plugins a,b,no:c`` (or its list) as stripped names, empty ones dropped."""
    names = plugin_list.split(",") if isinstance(plugin_list, str) else list(plugin_list or [])
    return [n.strip() for n in names if n.strip()]


def blocked_plugins(plugin_list: str | list[str] | None) -> set[str]:
    """The names ``--plugins`` blocks with ``no:NAME``."""
    return {n[3:] for n in _plugin_names(plugin_list) if n.startswith("no:")}


def apply_plugin_list(plugins_table: dict, plugin_list: str | list[str] | None, registry) -> tuple[dict, set[str]]:
    """Apply ``--plugins a,b,no:c``: each name sets its kind's slot (a kind that takes a list appends, dropping
    ``none``). Returns the blocked names."""
    if not plugin_list:
        return plugins_table, set()
    blocked = blocked_plugins(plugin_list)
    slots = {k.name: k for k in kinds.plugin_kinds()}
    chosen: dict[str, str] = {}  # kind -> the name --plugins gave it (one per kind; a list kind may take several)
    for name in _plugin_names(plugin_list):
        if name.startswith("no:"):
            continue
        entry = registry.find(name)
        if entry is None or entry.kind not in slots:
            listing = "; ".join(f"{k}: {', '.join(registry.names(k)) or '(none)'}" for k in slots)
            if entry is not None:
                raise PluginError(f"--plugins: {name!r} is a {entry.kind}, which a config names in "
                                  f"{kinds.kind(entry.kind).config_key}, not in --plugins. --plugins takes: {listing}.")
            try:
                registry.get("attention", name.split(":")[-1])
                detail = ""
            except PluginError as exc:  # its message suggests a close name or the distribution to install
                detail = f" ({exc})"
            raise PluginError(f"--plugins: no plugin named {name!r} is registered. Registered plugins by kind: "
                              f"{listing}.{detail}")
        k = slots[entry.kind]
        if k.many:
            current = _as_list(plugins_table.get(k.slot, k.default))
            if entry.name not in current:
                current.append(entry.name)
            plugins_table[k.slot] = [m for m in current if m != "none"]
            continue
        if chosen.get(k.name, entry.name) != entry.name:
            raise PluginError(
                f"--plugins names two {k.name} plugins, {chosen[k.name]!r} and {entry.name!r}; a run uses "
                f"one {k.name}: keep one of them"
            )
        chosen[k.name] = entry.name
        plugins_table[k.slot] = entry.name
    for k in slots.values():
        value = plugins_table.get(k.slot, k.default)
        if k.many:
            plugins_table[k.slot] = [m for m in _as_list(value) if m not in blocked]
        elif value in blocked:
            raise PluginError(f"--plugins no:{value} blocks the {k.name} the config selects; choose another {k.name}")
    return plugins_table, blocked


def _as_list(value) -> list:
    """A list kind's value as a list: a single name (``memory = "full-ac"``) is a one-name list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def read_toml(path: str | Path, what: str, examples: str) -> dict:
    """A TOML file as a dict; a missing or malformed file is a ConfigError that says which."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {path} does not exist; see {examples} for examples")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); a {what} is a TOML file "
                          "in UTF-8; see " + examples) from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None


def load_config(path: str | Path | None = None, *, raw: dict | None = None, overrides: list[str] | None = None,
                plugins: str | None = None, registry=None) -> Config:
    """Read, override and validate a config against the registries."""
    if registry is None:
        registry = default_registry
    source = str(path) if path is not None else "<dict>"
    if raw is None:
        raw = read_toml(path, "config file", "configs/")
    raw = apply_overrides(_deepcopy(raw), overrides or [])
    known = set(SECTIONS) | {"model", "data", "plugins"}
    for section in raw:
        if section not in known:
            close = difflib.get_close_matches(section, sorted(known), n=1)
            hint = f" Did you mean [{close[0]}]?" if close else ""
            raise ConfigError(f"{source}: unknown section [{section}]. Valid sections: {', '.join(sorted(known))}.{hint}")
    built = {name: build_dataclass(cls, raw.get(name, {}), name, source) for name, cls in SECTIONS.items()}

    model_cfg = _registered_section(raw, kinds.kind("model"), registry, source)
    data_cfg = _registered_section(raw, kinds.kind("dataset"), registry, source)

    plugins_table = dict(raw.get("plugins", {}))
    options_raw = plugins_table.pop("options", {})
    sites_raw = plugins_table.pop("attention_sites", {})
    for k in kinds.plugin_kinds():  # a list kind given one name (memory = "full-ac") takes it as a one-name list
        if k.many and isinstance(plugins_table.get(k.slot), str):
            plugins_table[k.slot] = [plugins_table[k.slot]]
    plugins_table, _ = apply_plugin_list(plugins_table, plugins, registry)
    plugins_cfg = build_dataclass(PluginsConfig, plugins_table, "plugins", source)
    for kind, chosen in kinds.selected(plugins_cfg).items():
        for name in chosen:
            _lookup(registry, kind, name, source)
    if not isinstance(sites_raw, dict) or not all(isinstance(v, str) for v in sites_raw.values()):
        raise ConfigError(f"{source}: [plugins.attention_sites] maps site names to attention kernel names, "
                          f'e.g. cross = "gdpa"; got {sites_raw!r}')
    for kernel in sites_raw.values():
        _lookup(registry, "attention", kernel, source)
    plugins_cfg.attention_sites = dict(sites_raw)
    plugins_cfg.options = {}
    for name, table in options_raw.items():
        entry = registry.find(name)
        if entry is None:
            raise ConfigError(f"{source}: [plugins.options.{name}] names no registered plugin")
        options_cls = getattr(entry.obj, "options_cls", None)
        if options_cls is None:
            raise ConfigError(f"{source}: plugin {name!r} takes no options; remove [plugins.options.{name}]")
        plugins_cfg.options[name] = build_dataclass(options_cls, table, f"plugins.options.{name}", source)
    return Config(model=model_cfg, data=data_cfg, plugins=plugins_cfg, source=source, **built)


def _registered_section(raw: dict, kind, registry, source: str):
    """[model] / [data]: the kind's key (``family``, ``source``) names a registry entry whose ``config_cls``
    defines the section's other keys."""
    section, key = kind.config_key.split(".")
    table = dict(raw.get(section, {}))
    name = table.get(key)
    if not name:
        raise ConfigError(f"{source}: [{section}] needs {key} = one of {', '.join(registry.names(kind.name))}")
    spec = _lookup(registry, kind.name, name, source)
    return build_dataclass(spec.config_cls, table, section, source)


def _lookup(registry, kind: str, name: str, source: str):
    try:
        return registry.get(kind, name)
    except PluginError as exc:
        raise PluginError(f"{source}: {exc}") from None


def _deepcopy(raw: dict) -> dict:
    import copy

    return copy.deepcopy(raw)


# ------------------------------------------------------------------------------------------ ablations
@dataclass
class Ablation:
    """One config trained under several plugin sets (configs/ablations/*.toml; run by ``gemzoo ablate``).

    ``runs`` lists plugin sets, each a string (``"jfa,bf16"``) or a table that also changes options for that
    run alone: ``{ plugins = "block-attention,bf16", set = ["model.attention_block_size=64"], name = "block 64" }``
    (``name`` defaults to the plugins, plus the overrides when there are any). After loading, every entry is
    an :class:`AblationRun`."""

    config: str
    runs: list
    steps: int = 50
    warmup: int = 5
    set: list[str] = field(default_factory=list)  # --set overrides applied to every run


@dataclass
class AblationRun:
    """One row of an ablation: a plugin set, the overrides of this run only, and its unique name."""

    plugins: str
    set: list[str] = field(default_factory=list)
    name: str = ""

    def __post_init__(self):
        if not self.name:
            self.name = self.plugins + "".join(f" + {o}" for o in self.set)


def _ablation_run(item, where: str) -> AblationRun:
    if isinstance(item, str):
        return AblationRun(item)
    if not isinstance(item, dict):
        raise ConfigError(f"{where} must be a plugin set such as \"jfa,bf16\" or a table "
                          f"{{ plugins = \"...\", set = [...], name = \"...\" }}, got {item!r}")
    run = build_dataclass(AblationRun, item, where.split(": ", 1)[-1], where.split(": ", 1)[0])
    if not isinstance(run.plugins, str):
        raise ConfigError(f"{where}.plugins must be a string such as \"jfa,bf16\", got {run.plugins!r}")
    if not all(isinstance(o, str) for o in run.set):
        raise ConfigError(f"{where}.set must list overrides such as \"model.attention_block_size=64\", got {run.set!r}")
    return run


def load_ablation(path: str | Path, registry=None) -> Ablation:
    """Read an ablation file and check every run's plugin set and overrides against the registries."""
    p = Path(path)
    raw = read_toml(p, "ablation file", "configs/ablations/")
    ablation = build_dataclass(Ablation, raw, "ablation", str(path))
    if not ablation.runs:
        raise ConfigError(f"{path}: runs is empty; list plugin sets such as \"jfa,bf16\"")
    ablation.runs = [_ablation_run(item, f"{path}: runs[{i}]") for i, item in enumerate(ablation.runs)]
    names = [r.name for r in ablation.runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{path}: runs {', '.join(map(repr, twice))} appear more than once; give each a "
                          "different name (runs = [{ plugins = ..., set = [...], name = \"...\" }])")
    if not Path(ablation.config).is_file() and (p.parent / ablation.config).is_file():
        ablation.config = str(p.parent / ablation.config)
    for run in ablation.runs:
        try:
            load_config(ablation.config, overrides=[*ablation.set, *run.set], plugins=run.plugins, registry=registry)
        except (ConfigError, PluginError) as exc:
            raise ConfigError(f"{path}: run {run.name!r}: {exc}") from None
    return ablation

