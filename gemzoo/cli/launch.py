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


def check_command(command: list[str]) -> None:
    """The gemzoo command after ``--``: a known command whose arguments parse (argparse exits 2 naming a bad one)
    and, for ``train``, whose config loads with its overrides and plugins, so a mistake is reported once here
    rather than by every worker."""
    from gemzoo.cli.main import _add_plugin_commands, build_parser

    if not command:
        raise ConfigError(f"gemzoo launch: no command after --; e.g. {EXAMPLE}")
    parser = build_parser()
    sub = parser._subparsers._group_actions[0]
    if command[0] not in sub.choices:
        _add_plugin_commands(parser)  # a command a plugin adds
    if command[0] == "launch":
        raise ConfigError("gemzoo launch: the command after -- is run by every worker; give it train (or another "
                          f"command), not launch; e.g. {EXAMPLE}")
    if command[0] not in sub.choices:
        raise ConfigError(f"gemzoo launch: {command[0]!r} is not a gemzoo command (one of: "
                          f"{', '.join(sorted(sub.choices))}); e.g. {EXAMPLE}")
    args = parser.parse_args(command)
    if command[0] == "train":  # its config, overrides and plugin names: refused here once, not by every worker
        from gemzoo.cli.common import load_run_config

        load_run_config(args)


def cmd_launch(args) -> int:
    from gemzoo.distributed.launch import run_torchrun  # torchrun's agent: torch

    check_command(args.command)
    options = ["--nproc-per-node", str(args.nproc_per_node), *args.torchrun]
    return run_torchrun(options, args.command, argv0=sys.argv[0])
