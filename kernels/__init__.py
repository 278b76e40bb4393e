"""qlab.kernels: the Triton kernels of the kernel labs (notebooks 08-11).

Same source, three ways: natively on a CUDA GPU; on any Linux CPU through the Triton
interpreter (picked automatically when no GPU is present); and compiled ahead of time
for sm_80/sm_89/sm_90/sm_100 on any CPU (compile_for). Every kernel is tested against qlab.

    dequantize_int4(packed, scales, group_size)      the primer (bit-exact with qlab)
    pack_w4a16(weight, group_size) / w4a16_linear    weight-only int4, 16-bit activations
    W4A16Weight.from_qtensor(qt)                     pack a GPTQ / qlab int4 QTensor
    pack_fp8(weight, granularity) / fp8_linear       W8A8 FP8 E4M3 with on-the-fly act quant
    compile_for(kernel, M, N, K, arch=90)            PTX, registers, spills, shared, grid, config
    configs.chosen()                                 the launch config each shape picked

docs/KERNELS.md explains the design; kernels/bench.py is the benchmark.
"""

# _backend first: it sets TRITON_INTERPRET before any @triton.jit runs.
from qlab.kernels._backend import DEVICE, HAS_CUDA, INTERPRET  # isort: skip
from qlab.kernels import configs
from qlab.kernels.aot import compile_for
from qlab.kernels.dequant import dequantize_int4
from qlab.kernels.fp8 import FP8Weight, fp8_linear, fp8_scaled_mm, pack_fp8, quantize_act_fp8
from qlab.kernels.w4a16 import W4A16Weight, pack_w4a16, w4a16_linear

__all__ = [
    "DEVICE",
    "HAS_CUDA",
    "INTERPRET",
    "configs",
    "compile_for",
    "dequantize_int4",
    "W4A16Weight",
    "pack_w4a16",
    "w4a16_linear",
    "FP8Weight",
    "pack_fp8",
    "fp8_linear",
    "fp8_scaled_mm",
    "quantize_act_fp8",
]
