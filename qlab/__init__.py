"""qlab: reference implementations for the quantization course.

A quantization scheme = an element grid + a scale rule + a granularity.
See docs/CONTRACT.md for the public API and the numeric conventions.
"""

from qlab import cost, formats, metrics
from qlab._tensor import apply_thread_policy
from qlab.packing import pack_int4, unpack_int4
from qlab.quantize import QTensor, dequantize, fake_quantize, quantize
from qlab.schemes import SCHEME_NAMES, SCHEMES, Scheme, get_scheme, int_scheme

# Subpackages load on first use (PEP 562), so `import qlab` stays light and
# `qlab.ptq.gptq(...)` works without an explicit `import qlab.ptq`.
_SUBPACKAGES = (
    "data", "gguf", "grading", "kernels", "kv", "lm", "pipelines", "ptq", "qat", "widgets"
)


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"qlab.{name}")
    raise AttributeError(f"module 'qlab' has no attribute {name!r}")


# torch threads capped at the CPUs this process may use (affinity, cgroup quota) unless
# the user set OMP_NUM_THREADS: qlab/_tensor.py's thread policy
apply_thread_policy()

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
