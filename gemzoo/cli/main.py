"""The ``gemzoo`` command line: the parser of every command, and the dispatch.

    gemzoo train --config F [--plugins a,b] [--set k=v ...] [--steps N] [--out DIR] [--resume [PATH] | --overwrite]
    gemzoo launch --nproc-per-node N [torchrun options] -- train ...
    gemzoo plugins [--verbose | --json]
    gemzoo runs [DIR]
    gemzoo list KIND [PATTERN]
    gemzoo config show|validate F [--plugins ...] [--set ...]
    gemzoo info
    gemzoo ablate F.toml [--steps N] [--out DIR]
    gemzoo plot RUN [RUN ...] [--out PNG]
    gemzoo eval --checkpoint PATH [--config F] [--split val|test]
    gemzoo new-plugin NAME --kind KIND [--dir DIR]

Each command's code lives in its own module of ``gemzoo.cli``, named by its parser's ``func`` default as
``"module:function"`` and imported when that command runs. Building the parser imports neither torch nor a
plugin: the kinds ``list`` and ``new-plugin --kind`` accept are read when an argument is checked or their help is
shown, and plugins are loaded for their commands (``gemzoo_register_commands``, whose ``func`` is the callable
itself) only when the command named is not one of gemzoo's. So ``gemzoo --version``, ``gemzoo --help``,
``gemzoo plugins`` and ``gemzoo runs`` start in well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from gemzoo import __version__
from gemzoo.errors import GemzooError

EXAMPLES = """examples:
  gemzoo train --config configs/gem-tiny.toml --plugins jfa,mxfp8
  gemzoo train --config configs/gem-tiny.toml --resume          # continue runs/gem-tiny
  gemzoo launch --nproc-per-node 2 -- train --config configs/gem-tiny.toml
  gemzoo config validate configs/gem-tiny.toml --set model.num_heads=4
  gemzoo list attention 's*'
  gemzoo plugins --verbose
  gemzoo runs runs/

Commands that plugins add (gemzoo_register_commands) run as `gemzoo NAME`; they are loaded only when a
command that is not gemzoo's own is named, so they are not listed above.
"""

TRAIN_EXAMPLES = """examples:
  gemzoo train --config configs/gem-tiny.toml --plugins jfa,mxfp8 --out runs/tiny-jfa
  gemzoo train --config configs/gem-tiny.toml --out runs/tiny-jfa --resume --steps 800
  gemzoo train --config configs/gem-tiny.toml --overwrite --set optim.lr=1e-3

A run folder holds one run (metrics.jsonl, checkpoints/step-*/): a fresh run refuses a folder that
is not empty; --resume continues it, --overwrite replaces it, --out DIR starts a new one. SIGTERM or
Ctrl-C finishes the step, writes a checkpoint and prints the command that resumes.
"""

LAUNCH_EXAMPLES = """examples:
  gemzoo launch --nproc-per-node 2 -- train --config configs/gem-tiny.toml --set run.device=cpu
  gemzoo launch --nproc-per-node 8 -- train --config configs/gem-bench.toml --plugins jfa,bf16 --out runs/bench8
  gemzoo launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 -- \\
      train --config configs/gem-bench.toml --out runs/bench16

The options before -- are torchrun's (torchrun --help lists them), the words after it the gemzoo command every
worker runs. Ctrl-C (or SIGTERM) stops the workers after their step with a checkpoint; rank 0 prints the one
line that resumes (this command with --resume), no rank prints a traceback, and gemzoo launch exits 130 (143).
A second Ctrl-C stops the workers at once, without a checkpoint.
"""

RAW = argparse.RawDescriptionHelpFormatter

PLUGINS_EXAMPLES = """examples:
  gemzoo plugins                 # installed plugins, read from package metadata (no plugin is imported)
  gemzoo plugins --verbose       # loads every plugin: its hooks and the names it registers, or its error
  gemzoo plugins --json | jq '.[].registered'
"""

RUNS_EXAMPLES = """examples:
  gemzoo runs                    # the run folders under runs/
  gemzoo runs runs/ablations/gem-tiny
  gemzoo runs runs/gem-tiny --json
"""

LIST_EXAMPLES = """examples:
  gemzoo list attention
  gemzoo list attention 's*'
  gemzoo list model
"""

CONFIG_EXAMPLES = """examples:
  gemzoo config show configs/gem-tiny.toml --plugins jfa,mxfp8
  gemzoo config validate configs/gem-tiny.toml --set model.num_heads=4
"""

INFO_EXAMPLES = """examples:
  gemzoo info
  gemzoo info | jq .extension
"""

ABLATE_EXAMPLES = """examples:
  gemzoo ablate configs/ablations/gem-tiny.toml --steps 40
  gemzoo ablate configs/ablations/gem-tiny.toml --runs sdpa-padded,fp32 jfa,bf16 --overwrite
  gemzoo ablate --report runs/ablations/gem-tiny

Every run entry (its plugin names and set overrides) is checked before the first run trains.
"""

PLOT_EXAMPLES = """examples:
  gemzoo plot runs/gem-tiny
  gemzoo plot runs/tiny-ref runs/tiny-jfa --labels reference,jfa --out compare.png
"""

EVAL_EXAMPLES = """examples:
  gemzoo eval --checkpoint runs/gem-tiny
  gemzoo eval --checkpoint runs/gem-tiny/checkpoints/step-00000200 --split test --plugins reference
"""

NEW_PLUGIN_EXAMPLES = """examples:
  gemzoo new-plugin myattn --kind attention
  gemzoo new-plugin my-fp8 --kind precision --dir plugins/
"""


class LazyChoices:
    """Choices read on first use (``in``, iteration), so that building the parser imports no torch."""

    def __init__(self, load):
        self._load, self._values = load, None

    def _get(self) -> tuple[str, ...]:
        if self._values is None:
            self._values = tuple(self._load())
        return self._values

    def __contains__(self, value) -> bool:
        return value in self._get()

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _kind_names() -> list[str]:
    from gemzoo import kinds  # the kinds table names each kind's Protocol, which imports torch

    return kinds.names()


def _template_kinds() -> tuple[str, ...]:
    from gemzoo.cli.new_plugin import KINDS  # reads the kinds table: torch

    return KINDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemzoo", description="Train LLM-scale recommendation models with plugins.",
                                formatter_class=RAW, epilog=EXAMPLES)
    p.add_argument("--version", action="version", version=f"gemzoo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_train, _launch, _plugins, _runs, _list, _config, _info, _ablate, _plot, _eval, _new_plugin):
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
    t.add_argument("--verbose", action="store_true",
                   help="show the third-party warnings gemzoo silences as known to be harmless")
    t.set_defaults(func="gemzoo.cli.train:cmd_train")


def _launch(sub) -> None:
    la = sub.add_parser("launch", help="run a command (train) on several processes through torchrun",
                        formatter_class=RAW, epilog=LAUNCH_EXAMPLES, allow_abbrev=False,
                        usage="gemzoo launch [-h] [--nproc-per-node N] [TORCHRUN OPTION ...] -- COMMAND ...",
                        description="Run torchrun (torch.distributed.run) with `-m gemzoo.cli COMMAND` as each "
                        "worker's program: the options before -- go to torchrun, the words after it are the "
                        "gemzoo command. Ctrl-C gives one message, from rank 0, with the command that resumes.")
    la.add_argument("--nproc-per-node", "--nproc_per_node", default="1", metavar="N",
                    help="workers on this node: a number, or gpu / cpu / auto as torchrun takes (default 1)")
    la.set_defaults(func="gemzoo.cli.launch:cmd_launch", torchrun=[], command=[])


def _parse_launch(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``gemzoo launch OPTIONS -- COMMAND``: torchrun's options (any, in their order) before ``--``, the gemzoo
    command after it; ``-h`` before ``--`` shows launch's help."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args, torchrun = parser.parse_known_args(argv[:cut])
    if cut == len(argv) and "-h" not in argv and "--help" not in argv:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["launch"].error("put the gemzoo command after --, e.g. gemzoo launch --nproc-per-node 2 -- "
                                    "train --config configs/gem-tiny.toml")
    args.torchrun, args.command = torchrun, argv[cut + 1:]
    return args


def _plugins(sub) -> None:
    pl = sub.add_parser("plugins", help="list installed plugins", formatter_class=RAW, epilog=PLUGINS_EXAMPLES,
                        description="List gemzoo's built-in plugins and the installed ones (entry-point group "
                        "'gemzoo'). Without --verbose or --json nothing is imported: the hooks, the names each "
                        "plugin registers and load errors need every plugin loaded, so only those two show them.")
    pl.add_argument("--verbose", "-v", action="store_true",
                    help="load every plugin: its hooks, the names it registers, or why it failed to load")
    pl.add_argument("--json", action="store_true", help="what --verbose shows, as JSON")
    pl.set_defaults(func="gemzoo.cli.info:cmd_plugins")


def _runs(sub) -> None:
    r = sub.add_parser("runs", help="list run folders: status, steps, final metrics, plugins", formatter_class=RAW,
                       epilog=RUNS_EXAMPLES,
                       description="List the run folders at or under DIR (any folder holding metrics.jsonl), "
                       "with each run's status (finished, interrupted, running or stopped), its step, final "
                       "metrics and plugins, read from metrics.jsonl and provenance.json.")
    r.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="a run folder or a folder of them "
                   "(default: runs)")
    r.add_argument("--json", action="store_true", help="one JSON object per run, as a list")
    r.set_defaults(func="gemzoo.cli.runs:cmd_runs")


def _list(sub) -> None:
    ls = sub.add_parser("list", help="list registered names of a kind", formatter_class=RAW, epilog=LIST_EXAMPLES)
    ls.add_argument("kind", metavar="KIND", help="one of: %(choices)s", choices=LazyChoices(_kind_names))
    ls.add_argument("pattern", nargs="?", help="fnmatch pattern on the names, e.g. 's*'")
    ls.set_defaults(func="gemzoo.cli.info:cmd_list")


def _config(sub) -> None:
    c = sub.add_parser("config", help="show or validate a config", formatter_class=RAW, epilog=CONFIG_EXAMPLES,
                       description="show: the resolved config and each module's precision. validate: build the "
                                   "dataset, the model on meta, each site's attention kernel and the precision "
                                   "policy, and report what train would reject.")
    c.add_argument("action", choices=["show", "validate"], help="show or validate")
    c.add_argument("config", metavar="FILE", help="TOML config, e.g. configs/gem-tiny.toml")
    c.add_argument("--plugins", help="comma-separated plugin names, as for train")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, as for train")
    c.set_defaults(func="gemzoo.cli.config_cmd:cmd_config")


def _info(sub) -> None:
    i = sub.add_parser("info", help="versions, and what the C++ extension provides", formatter_class=RAW,
                       epilog=INFO_EXAMPLES)
    i.set_defaults(func="gemzoo.cli.info:cmd_info")


def _ablate(sub) -> None:
    a = sub.add_parser("ablate", help="train one config under several plugin sets; table, plots and report",
                       formatter_class=RAW, epilog=ABLATE_EXAMPLES,
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
                       formatter_class=RAW, epilog=PLOT_EXAMPLES,
                       description="Plot the metrics.jsonl of one or more run folders against the step: the "
                       "training loss with its smoothed trend, samples/s, and each eval metric on its own panel.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (run.out_dir of a training run)")
    p.add_argument("--out", help="PNG to write (default: RUN/curves.png for one run, curves.png for several)")
    p.add_argument("--labels", help="comma-separated legend labels, one per run (default: folder names)")
    p.set_defaults(func="gemzoo.cli.plot:cmd_plot")


def _eval(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a checkpoint without training (AUC for gem; HR/NDCG/MRR for retrieval)",
                       formatter_class=RAW, epilog=EVAL_EXAMPLES,
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
                       formatter_class=RAW, epilog=NEW_PLUGIN_EXAMPLES,
                       description="Write gemzoo-NAME/: pyproject.toml with the gemzoo entry point, the hookimpl, an "
                       "implementation that works as generated, conformance tests and a README.")
    n.add_argument("name", metavar="NAME", help="the registered name, e.g. myattn (also gemzoo-NAME, gemzoo_NAME)")
    n.add_argument("--kind", required=True, metavar="KIND", choices=LazyChoices(_template_kinds),
                   help="one of: %(choices)s")
    n.add_argument("--dir", default=".", help="where to create gemzoo-NAME/ (default: the current folder)")
    n.set_defaults(func="gemzoo.cli.new_plugin:cmd_new_plugin")


def command(func):
    """The callable a parser's ``func`` names: gemzoo's commands as ``"module:function"``, plugins' as is."""
    if callable(func):
        return func
    module, name = func.split(":")
    return getattr(importlib.import_module(module), name)


def _named_command(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def _add_plugin_commands(parser: argparse.ArgumentParser) -> None:
    from gemzoo import registry  # loads every plugin

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for plugin, error in registry.host().call_each("gemzoo_register_commands", cli=sub).items():
        print(f"gemzoo: warning: plugin {plugin!r} could not add its commands ({error}); the others work. "
              f"Block it with GEMZOO_DISABLE_PLUGINS={plugin}.", file=sys.stderr)


def _stdout_closed() -> int:
    """The reader of stdout went away (``gemzoo plugins --json | head``): stop quietly, as a Unix tool does."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a pipe closed early


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    named = _named_command(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if named is not None and named not in sub.choices:
        # Plugins may add commands; blocked ones must not load, so honour no:NAME first.
        plugins_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--plugins=")), None)
        if plugins_arg is None and "--plugins" in argv[:-1]:
            plugins_arg = argv[argv.index("--plugins") + 1]
        if plugins_arg is not None:
            from gemzoo.cli.common import prepare_registry  # reads the config module: torch

            prepare_registry(plugins_arg)
        _add_plugin_commands(parser)
    args = _parse_launch(parser, argv) if named == "launch" else parser.parse_args(argv)
    args.argv = argv  # gemzoo train prints the command that resumes an interrupted run
    try:
        return command(args.func)(args) or 0
    except GemzooError as exc:
        print(f"gemzoo: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which handles its own): no traceback
        if os.environ.get("RANK", "0") == "0":  # under torchrun every worker gets the signal: one message
            print("gemzoo: interrupted", file=sys.stderr)
        return 130
