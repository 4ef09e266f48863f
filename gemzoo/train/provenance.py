"""How a run was made, written into its run folder when it starts (and again when it resumes):

    config.toml       the resolved config, every default filled in (``gemzoo train --config`` takes it back)
    command.txt       the command line that started (or resumed) the run
    provenance.json   one entry per start or resume: time, command, git commit and dirty flag (when gemzoo runs
                      from a checkout), versions of gemzoo, the selected and the installed plugins, torch,
                      triton and CUDA, and the hardware

``toml_text`` is a small TOML writer for a config's plain types (strings, numbers, booleans, lists and tables);
``None`` values are left out, which is what a config that does not set them means.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from gemzoo.plugins import ENTRY_POINT_GROUP

CONFIG = "config.toml"
COMMAND = "command.txt"
PROVENANCE = "provenance.json"

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _string(key)


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x, f"{where}[{i}]") for i, x in enumerate(v) if x is not None) + "]"
    if isinstance(v, dict):
        items = [f"{_key(str(k))} = {_value(x, f'{where}.{k}')}" for k, x in v.items() if x is not None]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"{where}: a {type(v).__name__} has no TOML form; a config holds strings, numbers, booleans, "
                    "lists and tables")


def toml_text(data: dict[str, Any]) -> str:
    """``data`` as a TOML document: scalars and lists first, then one ``[table]`` per nested dict."""
    lines: list[str] = []

    def table(d: dict, path: list[str]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict) and v is not None}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        if path and (scalars or not tables):
            if lines:
                lines.append("")
            lines.append("[" + ".".join(_key(p) for p in path) + "]")
        for k, v in scalars.items():
            lines.append(f"{_key(str(k))} = {_value(v, '.'.join([*path, str(k)]))}")
        for k, v in tables.items():
            table(v, [*path, str(k)])

    table(data, [])
    return "\n".join(lines) + "\n"


def git_state(folder: str | Path | None = None, timeout: float = 5.0) -> dict[str, Any] | None:
    """The commit of the git checkout gemzoo runs from (or ``folder``) and whether it has uncommitted changes;
    None when it is not a checkout or git is missing or slow."""
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parent.parent.parent
    if not (folder / ".git").exists():
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=timeout,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def dist_version(*names: str) -> str | None:
    """The version of the first installed distribution of ``names``; None if none is."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions(plugins: dict[str, str] | None = None) -> dict[str, Any]:
    """gemzoo, python, torch, triton, torchrec, CUDA and cuDNN, ``plugins`` (the run's selected plugins'
    distribution -> version) and every installed plugin distribution's version."""
    import torch  # here, not at the top: gemzoo plugins reads dist_version of this module without torch

    return {"gemzoo": dist_version("gemzoo") or "0+unknown", "python": platform.python_version(),
            "torch": torch.__version__, "triton": dist_version("triton", "pytorch-triton"),
            "torchrec": dist_version("torchrec"), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "plugins": dict(sorted((plugins or {}).items())), "installed_plugins": installed_plugins()}


def installed_plugins() -> dict[str, str]:
    """Every installed plugin distribution (entry-point group ``gemzoo``) -> its version, from metadata."""
    found = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is not None:
            found[ep.dist.name] = ep.dist.version
    return dict(sorted(found.items()))


def hardware(device: Any = None) -> dict[str, Any]:
    """The host (machine, CPU count, platform) and its GPUs by name and memory."""
    import torch  # as in versions()

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "capability": f"{p.major}.{p.minor}"})
    return {"host": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "device": None if device is None else str(device), "gpus": gpus}


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process, as a shell would take it back (``torchrun ...`` under torchrun)."""
    from gemzoo.distributed.launch import launch_command  # gemzoo.distributed imports torch (see versions())

    return shlex.join(launch_command(list(sys.argv[1:] if argv is None else argv)))


def write_provenance(out_dir: str | Path, config: dict[str, Any], *, command: str, device: Any = None,
                     world_size: int = 1, plugins: dict[str, str] | None = None, start_step: int = 0) -> None:
    """Write ``config.toml``, ``command.txt`` and one more entry of ``provenance.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text("# the resolved config of this run, every default filled in\n" + toml_text(config))
    (out / COMMAND).write_text(command + "\n")
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "event": "resume" if start_step else "start",
             "step": start_step, "command": command, "cwd": os.getcwd(), "git": git_state(),
             "world_size": world_size, "versions": versions(plugins), "hardware": hardware(device)}
    path = out / PROVENANCE
    entries = read_provenance(out) if start_step else []
    path.write_text(json.dumps({"runs": [*entries, entry]}, indent=1, default=str) + "\n")


def read_provenance(out_dir: str | Path) -> list[dict[str, Any]]:
    """The entries of a run folder's ``provenance.json`` (oldest first); [] when it has none or it is unreadable."""
    try:
        data = json.loads((Path(out_dir) / PROVENANCE).read_text())
    except (OSError, json.JSONDecodeError):
        return []
    runs = data.get("runs") if isinstance(data, dict) else None
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []
