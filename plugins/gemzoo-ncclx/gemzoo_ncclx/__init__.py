"""gemzoo-ncclx: the SM-free comms backend ``ncclx`` (see plugin.py and README.md)."""

from gemzoo_ncclx.plugin import IMPLEMENTS, NcclxComms, NcclxOptions
from gemzoo_ncclx.schedule import NcclxError

__all__ = ["IMPLEMENTS", "NcclxComms", "NcclxOptions", "NcclxError"]
