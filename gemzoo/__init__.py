"""gemzoo: a plugin-based toolkit for training LLM-scale recommendation models (GEM, HSTU, SASRec).

``errors``, ``jagged``, ``registry`` and ``hookimpl`` load on first use, so that ``import gemzoo`` (and
``gemzoo --version``) does not import torch.
"""

import importlib

try:
    from importlib.metadata import version as _version

    __version__ = _version("gemzoo")
except Exception:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["errors", "hookimpl", "jagged", "registry", "__version__"]

_LAZY_MODULES = ("errors", "jagged", "registry")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"gemzoo.{name}")
    if name == "hookimpl":
        from gemzoo.plugins import hookimpl  # pluggy only, but plugins.py loads the hookspecs: kept lazy

        return hookimpl
    raise AttributeError(f"module 'gemzoo' has no attribute {name!r}")
