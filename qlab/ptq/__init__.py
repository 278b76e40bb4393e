"""qlab.ptq: post-training quantization methods that use calibration data.

Chapter 12 (outliers):  hadamard, fwht, random_rotation (rotations), smooth_scales
                        (SmoothQuant), mixed_precision_matmul (LLM.int8())
Chapter 13 (rounding):  hessian, gptq (GPTQ), awq (AWQ); qlab.ptq.calibrate quantizes a
                        whole model layer by layer (quantize_model, gptq_model), and
                        qlab.ptq.ch13_results rebuilds the results notebook 13 ships
QuaRot:                 fold_layernorms, rotate (qlab.ptq.quarot: exact transformations of
                        TinyLM, LayerNorm folding and a randomized Hadamard)

Each is a small reference implementation in plain torch that takes and returns torch
tensors (or qlab QTensors) and checks its inputs.
"""

from qlab.ptq.awq import awq
from qlab.ptq.gptq import gptq, hessian
from qlab.ptq.llm_int8 import mixed_precision_matmul
from qlab.ptq.quarot import fold_layernorms, rotate
from qlab.ptq.rotation import fwht, hadamard, random_rotation
from qlab.ptq.smoothquant import smooth_scales

__all__ = [
    "hadamard",
    "fwht",
    "random_rotation",
    "smooth_scales",
    "mixed_precision_matmul",
    "hessian",
    "gptq",
    "awq",
    "fold_layernorms",
    "rotate",
]
