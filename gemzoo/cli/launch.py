"""``gemzoo launch [torchrun options] -- COMMAND ...``: run a gemzoo command on several processes through torchrun.

The options before ``--`` are torchrun's (``--nproc-per-node``, ``--nnodes``, ``--rdzv-endpoint``, ...), the words
after it a gemzoo command (``train --config F ...``), checked here once before any worker starts. The workers
know they were launched so (``GEMZOO_LAUNCH``): on Ctrl-C or SIGTERM rank 0 prints the one message with the
``gemzoo launch ... -- train ... --resume`` line, no rank prints a traceback, and the launcher exits 130 (143).
``gemzoo.distributed.launch`` has the details.
"""

from __future__ import annotations

import sys

from gemzoo.errors import ConfigError

EXAMPLE = "gemzoo launch --nproc-per-node 2 -- train --config configs/gem-tiny.toml"


def check_command(command: list[str]):
    """The gemzoo command after ``--``: a known command whose arguments parse (argparse exits 2 naming a bad one)
    and, for ``train``, whose config loads with its overrides and plugins, so a mistake is reported once here
    rather than by every worker."""
    from gemzoo.cli.main import _add_plugin_commands, build_parser

    if not command:
        raise ConfigError(f"launch: no command after --; e.g. {EXAMPLE}")
    parser = build_parser()
    sub = parser._subparsers._group_actions[0]
    if command[0] not in sub.choices:
        _add_plugin_commands(parser)  # a command a plugin adds
    if command[0] == "launch":
        raise ConfigError("launch: the command after -- is run by every worker; give it train (or another "
                          f"command), not launch; e.g. {EXAMPLE}")
    if command[0] not in sub.choices:
        raise ConfigError(f"launch: {command[0]!r} is not a gemzoo command (one of: "
                          f"{', '.join(sorted(sub.choices))}); e.g. {EXAMPLE}")
    args = parser.parse_args(command)
    if command[0] == "train":  # its config, overrides and plugin names: refused here once, not by every worker
        from gemzoo.cli.common import load_run_config

        return load_run_config(args)
    return None


def check_devices(cfg, nproc_per_node: str) -> None:
    """``run.device`` against this node: cuda where no GPU is visible, or more workers than GPUs, is refused once
    here (each worker would fail on it, some inside the process group's start)."""
    import torch

    device = str(cfg.run.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("launch: run.device asks for cuda but no GPU is visible on this node; set "
                          "run.device = \"cpu\" (--set run.device=cpu, the workers then talk over gloo) or \"auto\"")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    visible = torch.cuda.device_count() if cuda else 0
    if cuda and ":" not in device and nproc_per_node.isdigit() and int(nproc_per_node) > visible:
        raise ConfigError(f"launch: --nproc-per-node {nproc_per_node} workers but this node shows {visible} "
                          f"GPU(s), one a worker; start at most {visible} (--nproc-per-node gpu takes them all) or "
                          "train on CPU with --set run.device=cpu")


def cmd_launch(args) -> int:
    from gemzoo.distributed.launch import run_torchrun  # torchrun's agent: torch

    cfg = check_command(args.command)
    if cfg is not None:
        check_devices(cfg, str(args.nproc_per_node))
    options = ["--nproc-per-node", str(args.nproc_per_node), *args.torchrun]
    return run_torchrun(options, args.command, argv0=sys.argv[0])
