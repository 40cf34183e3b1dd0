"""Block formats: the layout table, the numpy reference dequantization (the oracle for every kernel) and the
quantizers."""

from quanta.quant.formats import FORMATS, QuantFormat, UnsupportedTypeError, get_format
from quanta.quant.quantize import QUANTIZABLE_TYPES, quantize
from quanta.quant.reference import dequantize, dequantize_raw, dequantize_rows

__all__ = [
    "FORMATS", "QUANTIZABLE_TYPES", "QuantFormat", "UnsupportedTypeError", "dequantize", "dequantize_raw",
    "dequantize_rows", "get_format", "quantize",
]
