"""The ``gemzoo`` command line.

    gemzoo train --config F [--plugins a,b] [--set k=v ...] [--steps N] [--out DIR] [--resume [PATH] | --overwrite]
    gemzoo plugins [--json]
    gemzoo list KIND [PATTERN]
    gemzoo config show|validate F [--plugins ...] [--set ...]
    gemzoo info
    gemzoo ablate F.toml [--steps N] [--out DIR]
    gemzoo plot RUN [RUN ...] [--out PNG]
    gemzoo eval --checkpoint PATH [--config F] [--split val|test]
    gemzoo new-plugin NAME --kind KIND [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys

from gemzoo.errors import GemzooError


def _prepare_registry(plugins: str | None) -> None:
    """Apply ``no:NAME`` blocks before any plugin is imported."""
    from gemzoo import registry
    from gemzoo.config import blocked_plugins
    from gemzoo.plugins import PluginHost, blocked_names

    blocked = blocked_plugins(plugins)
    if blocked:
        registry.reset(PluginHost(blocked=blocked | blocked_names()))


def _load(args):
    from gemzoo.config import load_config

    _prepare_registry(getattr(args, "plugins", None))
    overrides = list(args.set or [])
    if getattr(args, "steps", None) is not None:
        overrides.append(f"run.steps={args.steps}")
    return load_config(args.config, overrides=overrides, plugins=args.plugins)


def cmd_train(args) -> int:
    import shlex

    from gemzoo.train import run_folder
    from gemzoo.train.metrics import json_safe
    from gemzoo.train.trainer import TrainingInterrupted, train

    cfg = _load(args)
    if args.out:
        cfg.run.out_dir = args.out
    elif isinstance(args.resume, str) and run_folder.run_folder_of(args.resume) is not None:
        cfg.run.out_dir = str(run_folder.run_folder_of(args.resume))  # --resume RUN_FOLDER continues it there
    resume = args.resume if args.resume is not None else False
    try:
        result = train(cfg, resume=resume, progress=not args.quiet, overwrite=args.overwrite)
    except (TrainingInterrupted, KeyboardInterrupt) as exc:
        argv = [a for a in getattr(args, "argv", sys.argv[1:]) if a != "--overwrite"]
        again = shlex.join(["gemzoo", *argv, *([] if args.resume is not None else ["--resume"])])
        if isinstance(exc, TrainingInterrupted):
            print(f"gemzoo: {exc.signal_name}: stopped after step {exc.step}; checkpoint "
                  f"{exc.checkpoint or cfg.run.out_dir}. Resume with:\n  {again}", file=sys.stderr)
            return 128 + exc.signum
        print(f"gemzoo: interrupted at once, without a checkpoint; resume from the last one with:\n  {again}",
              file=sys.stderr)
        return 130
    if result.is_main:
        summary = {"final_loss": result.final_loss, "steps": result.steps, **result.eval,
                   "out_dir": str(result.out_dir)}
        print(json.dumps(json_safe(summary), allow_nan=False))
    return 0


def cmd_plugins(args) -> int:
    from gemzoo import registry

    _prepare_registry(None)
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
    from rich.console import Console
    from rich.table import Table

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
    from gemzoo import registry

    for name in registry.names(args.kind, args.pattern):
        obj = registry.get(args.kind, name)
        desc = getattr(obj, "description", "") or (obj.__doc__ or "").strip().split("\n")[0]
        print(f"{name:<20} {desc}")
    return 0


def cmd_config(args) -> int:
    from gemzoo.interfaces.precision import precision_report
    from gemzoo.train.trainer import build_on_meta

    cfg = _load(args)
    model = build_on_meta(cfg)  # the dataset, the model on meta, attention per site, the precision policy
    if args.action == "validate":
        print(f"{args.config}: OK (dataset, model on meta, attention kernels and precision policy built)")
        return 0
    out = cfg.to_dict()
    out["precision_by_module"] = precision_report(model)
    out["memory_selection"] = _memory_selection(cfg)
    print(json.dumps(out, indent=1, default=str))
    return 0


def _memory_selection(cfg) -> dict:
    """Each memory policy's ``selection()`` (e.g. which saved tensors act-quant quantizes), if it has one."""
    from gemzoo.train.trainer import configured

    out = {}
    for name in cfg.plugins.memory:
        selection = getattr(configured("memory", name, cfg), "selection", None)
        if callable(selection):
            out[name] = selection()
    return out


def cmd_info(args) -> int:
    import torch

    from gemzoo import __version__, ops

    import platform
    from importlib import metadata

    def dist_version(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    info = {"gemzoo": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "triton": dist_version("triton", "pytorch-triton"), "torchrec": dist_version("torchrec"),
            "fbgemm": dist_version("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly"),
            "cuda": torch.cuda.is_available(), "cuda_version": torch.version.cuda,
            "extension": ops.extension_info()}
    print(json.dumps(info, indent=1, default=str))
    return 0


EXAMPLES = """examples:
  gemzoo train --config configs/gem-tiny.toml --plugins jfa,mxfp8
  gemzoo train --config configs/gem-tiny.toml --resume          # continue runs/gem-tiny
  gemzoo config validate configs/gem-tiny.toml --set model.num_heads=4
  gemzoo list attention 's*'
  gemzoo plugins --json
"""

TRAIN_EXAMPLES = """examples:
  gemzoo train --config configs/gem-tiny.toml --plugins jfa,mxfp8 --out runs/tiny-jfa
  gemzoo train --config configs/gem-tiny.toml --out runs/tiny-jfa --resume --steps 800
  gemzoo train --config configs/gem-tiny.toml --overwrite --set optim.lr=1e-3

A run folder holds one run (metrics.jsonl, checkpoints/step-*/): a fresh run refuses a folder that
is not empty; --resume continues it, --overwrite replaces it, --out DIR starts a new one. SIGTERM or
Ctrl-C finishes the step, writes a checkpoint and prints the command that resumes.
"""


def build_parser() -> argparse.ArgumentParser:
    from gemzoo import __version__, kinds

    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="gemzoo", description="Train LLM-scale recommendation models with plugins.",
                                formatter_class=raw, epilog=EXAMPLES)
    p.add_argument("--version", action="version", version=f"gemzoo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a config", formatter_class=raw, epilog=TRAIN_EXAMPLES,
                       description="Train from a TOML config into a run folder (run.out_dir, or --out).")
    t.add_argument("--config", required=True, metavar="FILE", help="TOML config, e.g. configs/gem-tiny.toml")
    t.add_argument("--plugins", help="comma-separated plugin names, e.g. jfa,mxfp8; no:NAME blocks one")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. run.steps=50")
    t.add_argument("--steps", type=int, metavar="N", help="train until step N (the same as --set run.steps=N)")
    t.add_argument("--out", metavar="DIR", help="run folder (overrides run.out_dir)")
    t.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                   help="continue the run in the run folder from its newest valid checkpoint; PATH: another run "
                        "folder (continued there), its checkpoints/ folder, or one step-* checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the run folder's metrics.jsonl and checkpoints/ first, then start from step 0")
    t.add_argument("--quiet", action="store_true", help="no progress bar and no log lines")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plugins", help="list installed plugins")
    pl.add_argument("--json", action="store_true", help="the same as JSON")
    pl.set_defaults(func=cmd_plugins)

    kind_names = kinds.names()
    ls = sub.add_parser("list", help="list registered names of a kind")
    ls.add_argument("kind", help=f"{', '.join(kind_names[:-1])} or {kind_names[-1]}", choices=kind_names)
    ls.add_argument("pattern", nargs="?", help="fnmatch pattern on the names, e.g. 's*'")
    ls.set_defaults(func=cmd_list)

    c = sub.add_parser("config", help="show or validate a config",
                       description="show: the resolved config and each module's precision. validate: build the "
                                   "dataset, the model on meta, each site's attention kernel and the precision "
                                   "policy, and report what train would reject.")
    c.add_argument("action", choices=["show", "validate"], help="show or validate")
    c.add_argument("config", metavar="FILE", help="TOML config, e.g. configs/gem-tiny.toml")
    c.add_argument("--plugins", help="comma-separated plugin names, as for train")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, as for train")
    c.set_defaults(func=cmd_config)

    i = sub.add_parser("info", help="versions, and what the C++ extension provides")
    i.set_defaults(func=cmd_info)

    from gemzoo import ablate, evaluate, plotting, scaffold  # each adds its sub-command (light imports)

    for module in (ablate, plotting, evaluate, scaffold):
        module.add_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from gemzoo import registry

    parser = build_parser()
    # Plugins may add commands; blocked ones must not load, so honour no:NAME first.
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--plugins=")), None)
    if plugins_arg is None and "--plugins" in argv[:-1]:
        plugins_arg = argv[argv.index("--plugins") + 1]
    if plugins_arg is not None:
        _prepare_registry(plugins_arg)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for plugin, error in registry.host().call_each("gemzoo_register_commands", cli=sub).items():
        print(f"gemzoo: warning: plugin {plugin!r} could not add its commands ({error}); the others work. "
              f"Block it with GEMZOO_DISABLE_PLUGINS={plugin}.", file=sys.stderr)
    args = parser.parse_args(argv)
    args.argv = argv  # cmd_train prints the command that resumes an interrupted run
    try:
        return args.func(args) or 0
    except GemzooError as exc:
        print(f"gemzoo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
