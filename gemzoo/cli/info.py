"""What is installed: ``gemzoo plugins`` (every plugin; with ``--verbose``/``--json`` what each registers),
``gemzoo list KIND`` (the names of a kind) and ``gemzoo info`` (versions, and what the C++ extension provides).

Plain ``gemzoo plugins`` reads package metadata only (the built-in modules and the ``gemzoo`` entry points) and
imports neither torch nor a plugin; the hooks and registered names need every plugin loaded.
"""

from __future__ import annotations

import json
import platform
from importlib import metadata

from gemzoo import __version__
from gemzoo.plugins import BUILTIN_MODULES, ENTRY_POINT_GROUP, blocked_names
from gemzoo.train.provenance import dist_version


def installed_plugins() -> list[dict[str, str]]:
    """Every plugin gemzoo would load, from metadata alone: name, distribution, version, module, status."""
    blocked = blocked_names()
    rows = [{"name": m, "distribution": "gemzoo", "version": __version__, "module": m,
             "status": "blocked" if f"builtin.{m.rsplit('.', 1)[-1]}" in blocked else "built-in"}
            for m in BUILTIN_MODULES]
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist is not None else "?"
        rows.append({"name": ep.name, "distribution": dist, "version": ep.dist.version if ep.dist else "?",
                     "module": ep.value, "status": "blocked" if {ep.name, dist} & blocked else "installed"})
    return rows


def plain_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell: nothing is cut, whatever the terminal's width."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines)


def cmd_plugins(args) -> int:
    if not (args.json or getattr(args, "verbose", False)):
        rows = installed_plugins()
        print(plain_table(("plugin", "distribution", "version", "module", "status"),
                          [tuple(r.values()) for r in rows]))
        print("\nRead from package metadata; gemzoo plugins --verbose (or --json) loads every plugin to show its "
              "hooks, the names it registers and load errors.")
        return 0
    from gemzoo import registry  # loads plugins, which import torch: plain `plugins` does not
    from gemzoo.cli.common import prepare_registry  # the config module: torch

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
    # one block per plugin: every name whole at any terminal width
    for r in rows:
        print(f"{r['name'].replace('gemzoo.builtin.', 'builtin.')}  ({r['distribution']} {r['version']})")
        if r["error"]:
            print(f"  FAILED to load: {r['error']}")
            continue
        print(f"  hooks: {', '.join(h.removeprefix('gemzoo_') for h in r['hooks']) or '-'}")
        for k, v in sorted(r["registered"].items()):
            print(f"  {k}: {', '.join(v)}")
        for n, c in r.get("comms", {}).items():
            runs = ", ".join(c["implements"]) or "none (all c10d)"
            print(f"  {n}: sm_free = {'yes' if c['sm_free'] else 'no'}; runs itself: {runs}")
    return 0


def cmd_list(args) -> int:
    from gemzoo import registry  # as in cmd_plugins: only this command loads the plugins

    for name in registry.names(args.kind, args.pattern):
        obj = registry.get(args.kind, name)
        desc = getattr(obj, "description", "") or (obj.__doc__ or "").strip().split("\n")[0]
        print(f"{name:<20} {desc}")
    return 0


def cmd_info(args) -> int:
    import torch  # only `gemzoo info` needs torch and the extension

    from gemzoo import ops  # loads the C++ extension: only `gemzoo info` reports it

    info = {"gemzoo": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "triton": dist_version("triton", "pytorch-triton"), "torchrec": dist_version("torchrec"),
            "fbgemm": dist_version("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly"),
            "cuda": torch.cuda.is_available(), "cuda_version": torch.version.cuda,
            "extension": ops.extension_info()}
    print(json.dumps(info, indent=1, default=str))
    return 0
