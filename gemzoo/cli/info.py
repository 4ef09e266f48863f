"""What is installed: ``gemzoo plugins`` (every plugin and what it registers), ``gemzoo list KIND`` (the names of
a kind) and ``gemzoo info`` (versions, and what the C++ extension provides)."""

from __future__ import annotations

import json
import platform
from importlib import metadata

import torch
from rich.console import Console
from rich.table import Table

from gemzoo import __version__, ops, registry
from gemzoo.cli.common import prepare_registry


def cmd_plugins(args) -> int:
    prepare_registry(None)
    registry.clashes()  # load everything; a name clash is shown in its row, not raised
    infos = sorted(registry.host().infos.values(), key=lambda i: (i.distribution != "gemzoo", i.name))
    rows = [{"name": i.name, "distribution": i.distribution, "version": i.version, "hooks": i.hooks,
             "registered": i.registered, "error": i.error} for i in infos]
    for r in rows:  # comms backends: sm_free and the collectives each runs itself (the rest go to c10d)
        comms = {}
        for n in r["registered"].get("comms", []):
            try:
                comms[n] = registry.get("comms", n).capabilities.summary()
            except Exception:  # a clashing or broken entry keeps its row as it is
                pass
        if comms:
            r["comms"] = comms
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table("plugin", "distribution", "version", "hooks", "registers")
    for r in rows:
        regs = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r["registered"].items()))
        for n, c in r.get("comms", {}).items():
            runs = ", ".join(c["implements"]) or "none (all c10d)"
            regs += f" ({n}: sm_free = {'yes' if c['sm_free'] else 'no'}; runs itself: {runs})"
        name = r["name"].replace("gemzoo.builtin.", "builtin.")
        hooks = ", ".join(h.removeprefix("gemzoo_") for h in r["hooks"])
        table.add_row(name, r["distribution"], r["version"], hooks, "[red]FAILED[/red]" if r["error"] else regs)
    console = Console()
    console.print(table)
    for r in rows:
        if r["error"]:
            console.print(f"[red]{r['name']} ({r['distribution']}) failed to load:[/red] {r['error']}", soft_wrap=True)
    return 0


def cmd_list(args) -> int:
    for name in registry.names(args.kind, args.pattern):
        obj = registry.get(args.kind, name)
        desc = getattr(obj, "description", "") or (obj.__doc__ or "").strip().split("\n")[0]
        print(f"{name:<20} {desc}")
    return 0


def dist_version(*names: str) -> str | None:
    """The version of the first installed distribution of ``names``; None if none is."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cmd_info(args) -> int:
    info = {"gemzoo": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "triton": dist_version("triton", "pytorch-triton"), "torchrec": dist_version("torchrec"),
            "fbgemm": dist_version("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly"),
            "cuda": torch.cuda.is_available(), "cuda_version": torch.version.cuda,
            "extension": ops.extension_info()}
    print(json.dumps(info, indent=1, default=str))
    return 0
