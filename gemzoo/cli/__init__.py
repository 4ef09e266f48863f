"""The ``gemzoo`` command line, one module per command; ``main`` (the console script) and its parser."""

from gemzoo.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
