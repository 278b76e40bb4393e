"""qlab.qat: quantization-aware training (chapter 14).

    fake_quantize_ste(x, scheme, granularity)   qlab.fake_quantize forward, straight-through
                                                backward (zero where x was clamped)
    lsq_fake_quantize(x, scale, bits, g)        LSQ: a learned step with LSQ's gradient
    LSQQuantizer(scheme, granularity, init)     the module holding a learned step
    prepare_qat(model, weight_scheme, weight_granularity, act_scheme=None)
                                                every nn.Linear -> QATLinear (a copy)
    convert(model)                              QATLinear -> QuantLinear (QTensor weights)
    with_qtensors(model, {name: QTensor})       QuantLinear layers from given QTensors (GPTQ's)
    save_quantized / load_quantized             a converted TinyLM as codes + scales
    python -m qlab.qat.train --weights int3 --group 64     the shipped runs (see README.md)
    python -m qlab.qat.baselines                           their GPTQ baselines

Conventions (boundaries included) are stated in ste.py and lsq.py.
"""

from qlab.qat.checkpoint import load_quantized, save_quantized
from qlab.qat.lsq import LSQQuantizer, lsq_fake_quantize, lsq_grad_scale
from qlab.qat.modules import (
    DynamicQuantizer,
    QATLinear,
    QuantLinear,
    convert,
    prepare_qat,
    with_qtensors,
)
from qlab.qat.ste import fake_quantize_ste, representable_mask, representable_range

__all__ = [
    "fake_quantize_ste",
    "representable_mask",
    "representable_range",
    "lsq_fake_quantize",
    "lsq_grad_scale",
    "LSQQuantizer",
    "DynamicQuantizer",
    "QATLinear",
    "QuantLinear",
    "prepare_qat",
    "convert",
    "with_qtensors",
    "save_quantized",
    "load_quantized",
]
