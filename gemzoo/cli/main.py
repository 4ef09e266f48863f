"""The ``gemzoo`` command line: the parser of every command, and the dispatch.

    gemzoo train --config F [--plugins a,b] [--set k=v ...] [--steps N] [--out DIR] [--resume [PATH] | --overwrite]
    gemzoo plugins [--json]
    gemzoo list KIND [PATTERN]
    gemzoo config show|validate F [--plugins ...] [--set ...]
    gemzoo info
    gemzoo ablate F.toml [--steps N] [--out DIR]
    gemzoo plot RUN [RUN ...] [--out PNG]
    gemzoo eval --checkpoint PATH [--config F] [--split val|test]
    gemzoo new-plugin NAME --kind KIND [--dir DIR]

Each command's code lives in its own module of ``gemzoo.cli``, named by its parser's ``func`` default as
``"module:function"`` and imported when that command runs, so that ``gemzoo --help`` or ``gemzoo list`` does not
import the trainer. Plugins add commands with ``gemzoo_register_commands``; their ``func`` is the callable itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gemzoo import __version__, kinds, registry
from gemzoo.cli.common import prepare_registry
from gemzoo.cli.new_plugin import KINDS as TEMPLATE_KINDS
from gemzoo.errors import GemzooError

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

RAW = argparse.RawDescriptionHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemzoo", description="Train LLM-scale recommendation models with plugins.",
                                formatter_class=RAW, epilog=EXAMPLES)
    p.add_argument("--version", action="version", version=f"gemzoo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_train, _plugins, _list, _config, _info, _ablate, _plot, _eval, _new_plugin):
        add(sub)
    return p


def _train(sub) -> None:
    t = sub.add_parser("train", help="train from a config", formatter_class=RAW, epilog=TRAIN_EXAMPLES,
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
    t.set_defaults(func="gemzoo.cli.train:cmd_train")


def _plugins(sub) -> None:
    pl = sub.add_parser("plugins", help="list installed plugins")
    pl.add_argument("--json", action="store_true", help="the same as JSON")
    pl.set_defaults(func="gemzoo.cli.info:cmd_plugins")


def _list(sub) -> None:
    kind_names = kinds.names()
    ls = sub.add_parser("list", help="list registered names of a kind")
    ls.add_argument("kind", help=f"{', '.join(kind_names[:-1])} or {kind_names[-1]}", choices=kind_names)
    ls.add_argument("pattern", nargs="?", help="fnmatch pattern on the names, e.g. 's*'")
    ls.set_defaults(func="gemzoo.cli.info:cmd_list")


def _config(sub) -> None:
    c = sub.add_parser("config", help="show or validate a config",
                       description="show: the resolved config and each module's precision. validate: build the "
                                   "dataset, the model on meta, each site's attention kernel and the precision "
                                   "policy, and report what train would reject.")
    c.add_argument("action", choices=["show", "validate"], help="show or validate")
    c.add_argument("config", metavar="FILE", help="TOML config, e.g. configs/gem-tiny.toml")
    c.add_argument("--plugins", help="comma-separated plugin names, as for train")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, as for train")
    c.set_defaults(func="gemzoo.cli.config_cmd:cmd_config")


def _info(sub) -> None:
    i = sub.add_parser("info", help="versions, and what the C++ extension provides")
    i.set_defaults(func="gemzoo.cli.info:cmd_info")


def _ablate(sub) -> None:
    a = sub.add_parser("ablate", help="train one config under several plugin sets; table, plots and report",
                       description="Train the config of an ablation file (configs/ablations/*.toml) under each of "
                       "its plugin sets, each in its own process and run folder, then write ablation.json, "
                       "ablation.csv, PNG plots and report.md into --out.")
    a.add_argument("ablation", metavar="F.toml", nargs="?", help="ablation file: config, runs, steps, warmup, set")
    a.add_argument("--steps", type=int, help="steps per run (default: the file's steps)")
    a.add_argument("--warmup", type=int, help="steps left out of the medians (default: the file's warmup)")
    a.add_argument("--out", help="ablation folder (default runs/ablations/<file stem>)")
    a.add_argument("--runs", nargs="+", metavar="PLUGINS", help="only these plugin sets of the file")
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    a.add_argument("--overwrite", action="store_true", help="replace an earlier ablation in --out")
    a.add_argument("--timeout", type=float, help="seconds one run may take before it is killed and marked failed")
    a.add_argument("--report", metavar="DIR", help="train nothing: redraw the plots and report.md of the ablation "
                   "folder DIR from its ablation.json and run folders (e.g. after copying it off a GPU machine)")
    a.set_defaults(func="gemzoo.cli.ablate:cmd_ablate")


def _plot(sub) -> None:
    p = sub.add_parser("plot", help="loss, throughput and eval curves of run folders into a PNG",
                       description="Plot the metrics.jsonl of one or more run folders: training loss, samples/s "
                       "and eval metrics against the step, one PNG with three panels.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (run.out_dir of a training run)")
    p.add_argument("--out", help="PNG to write (default: RUN/curves.png for one run, curves.png for several)")
    p.add_argument("--labels", help="comma-separated legend labels, one per run (default: folder names)")
    p.set_defaults(func="gemzoo.cli.plot:cmd_plot")


def _eval(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a checkpoint without training (AUC for gem; HR/NDCG/MRR for retrieval)",
                       description="Assemble the run a checkpoint was trained with (its manifest's config, or "
                       "--config), load the weights and run the trainer's evaluation; print and write JSON.")
    e.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a run folder (newest valid checkpoint), its checkpoints/ folder, or one step-* folder")
    e.add_argument("--config", metavar="F", help="config to assemble instead of the one in the manifest")
    e.add_argument("--split", choices=("val", "test"), default="val",
                   help="held-out split (test: datasets with eval_split)")
    e.add_argument("--batches", type=int, help="held-out batches (default: the config's eval.batches)")
    e.add_argument("--plugins", help="plugin names to evaluate with, e.g. reference (default: the run's)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    e.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's run.device)")
    e.add_argument("--json", metavar="FILE", help="where to write the result (default: RUN/eval-step-N-SPLIT.json)")
    e.set_defaults(func="gemzoo.cli.eval:cmd_eval")


def _new_plugin(sub) -> None:
    n = sub.add_parser("new-plugin", help="write a plugin distribution for a kind, ready to pip install -e",
                       description="Write gemzoo-NAME/: pyproject.toml with the gemzoo entry point, the hookimpl, an "
                       "implementation that works as generated, conformance tests and a README.")
    n.add_argument("name", metavar="NAME", help="the registered name, e.g. myattn (also gemzoo-NAME, gemzoo_NAME)")
    n.add_argument("--kind", required=True, choices=TEMPLATE_KINDS)
    n.add_argument("--dir", default=".", help="where to create gemzoo-NAME/ (default: the current folder)")
    n.set_defaults(func="gemzoo.cli.new_plugin:cmd_new_plugin")


def command(func):
    """The callable a parser's ``func`` names: gemzoo's commands as ``"module:function"``, plugins' as is."""
    if callable(func):
        return func
    module, name = func.split(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Plugins may add commands; blocked ones must not load, so honour no:NAME first.
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--plugins=")), None)
    if plugins_arg is None and "--plugins" in argv[:-1]:
        plugins_arg = argv[argv.index("--plugins") + 1]
    if plugins_arg is not None:
        prepare_registry(plugins_arg)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for plugin, error in registry.host().call_each("gemzoo_register_commands", cli=sub).items():
        print(f"gemzoo: warning: plugin {plugin!r} could not add its commands ({error}); the others work. "
              f"Block it with GEMZOO_DISABLE_PLUGINS={plugin}.", file=sys.stderr)
    args = parser.parse_args(argv)
    args.argv = argv  # gemzoo train prints the command that resumes an interrupted run
    try:
        return command(args.func)(args) or 0
    except GemzooError as exc:
        print(f"gemzoo: error: {exc}", file=sys.stderr)
        return 2
