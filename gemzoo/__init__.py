"""gemzoo: a plugin-based toolkit for training LLM-scale recommendation models (GEM, HSTU, SASRec)."""

from gemzoo import errors, jagged, registry
from gemzoo.plugins import hookimpl

try:
    from importlib.metadata import version as _version

    __version__ = _version("gemzoo")
except Exception:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["errors", "hookimpl", "jagged", "registry", "__version__"]
