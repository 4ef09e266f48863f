"""gemzoo-mxfp8: MXFP8 training precision for gemzoo (policies ``mxfp8`` and ``fp8-rowwise``)."""

from gemzoo_mxfp8.cast import dequantize_mx, quantize_mx
from gemzoo_mxfp8.linear import MXLinear, MXLinearConfig, mx_linear
from gemzoo_mxfp8.rowwise import FP8RowwiseLinear

__all__ = ["quantize_mx", "dequantize_mx", "MXLinear", "MXLinearConfig", "mx_linear", "FP8RowwiseLinear"]
__version__ = "0.1.0"
