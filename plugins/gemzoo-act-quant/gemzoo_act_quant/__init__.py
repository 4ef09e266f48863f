"""gemzoo-act-quant: tensors saved for backward kept in fp8 (memory policy ``act-quant``)."""

from gemzoo_act_quant.plugin import ActQuantOptions, ActQuantPolicy
from gemzoo_act_quant.quant import Packed, dequantize, quantize

__all__ = ["ActQuantOptions", "ActQuantPolicy", "Packed", "quantize", "dequantize"]
__version__ = "0.1.0"
