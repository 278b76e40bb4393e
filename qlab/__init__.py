"""qlab: reference implementations for the quantization course.

A quantization scheme = an element grid + a scale rule + a granularity.
See docs/CONTRACT.md for the public API and the numeric conventions.
"""

from qlab import cost, formats, metrics
from qlab.packing import pack_int4, unpack_int4
from qlab.quantize import QTensor, dequantize, fake_quantize, quantize
from qlab.schemes import SCHEME_NAMES, SCHEMES, Scheme, get_scheme, int_scheme

__version__ = "0.1.0"
__all__ = [
    "quantize",
    "dequantize",
    "fake_quantize",
    "QTensor",
    "Scheme",
    "SCHEMES",
    "SCHEME_NAMES",
    "get_scheme",
    "int_scheme",
    "pack_int4",
    "unpack_int4",
    "formats",
    "cost",
    "metrics",
]
