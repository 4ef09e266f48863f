"""gemzoo-mxfp8: MXFP8 training precision for gemzoo (policies ``mxfp8``, ``fp8-rowwise``, ``fp8-tensorwise``)."""

from gemzoo_mxfp8.cast import dequantize_mx, quantize_mx
from gemzoo_mxfp8.linear import MXLinear, MXLinearConfig, mx_linear
from gemzoo_mxfp8.rowwise import FP8RowwiseLinear
from gemzoo_mxfp8.tensorwise import FP8TensorwiseLinear

__all__ = ["quantize_mx", "dequantize_mx", "MXLinear", "MXLinearConfig", "mx_linear", "FP8RowwiseLinear",
           "FP8TensorwiseLinear"]
__version__ = "0.1.0"
