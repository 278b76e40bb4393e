"""Put quantizers into a model for training (prepare_qat) and take the quantized model out
(convert).

    qat = prepare_qat(model, "int3", 64)            every nn.Linear -> QATLinear
    ... train qat: its forward sees int3 weights, its backward goes straight through ...
    ptq_style = convert(qat)                        every QATLinear -> QuantLinear (QTensor)

A QATLinear keeps float32 "latent" weights (what the optimizer updates) and quantizes them
in every forward pass: with LSQ (learned per-group steps, integer schemes) or with
fake_quantize_ste (qlab's scale rule recomputed from the weights each step, any scheme).
Its input can be quantized too (W4A4): dynamically per token / per tensor through
fake_quantize_ste, exactly what ``qlab.lm.quality.quantize_activations`` does at
evaluation, or with an LSQ step per layer.

``convert`` returns the same kind of model ``qlab.lm.quality.quantize_weights`` returns:
nn.Linear modules whose weight is the dequantized QTensor (kept as ``.qweight``), plus the
trained input quantizer. ``convert(prepare_qat(m, ...))`` before any training equals
qlab's round-to-nearest PTQ of m, bit for bit (tests/qat).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from qlab.qat.lsq import LSQQuantizer
from qlab.qat.ste import fake_quantize_ste
from qlab.quantize import QTensor, dequantize, quantize
from qlab.schemes import Granularity, Scheme, get_scheme

__all__ = ["DynamicQuantizer", "QATLinear", "QuantLinear", "prepare_qat", "convert",
           "with_qtensors"]

# Activation granularity names as qlab.lm.quality spells them -> qlab's.
ACT_GRANULARITY = {"token": "channel", "tensor": "tensor"}  # token = one scale per row of x


class DynamicQuantizer(nn.Module):
    """fake_quantize_ste(x, scheme, granularity): the scale is recomputed from x every call
    (qlab's scale rule), the gradient is straight through. No parameters."""

    def __init__(self, scheme: str | Scheme, granularity: Granularity | None) -> None:
        super().__init__()
        self.scheme, self.granularity = get_scheme(scheme), granularity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_ste(x, self.scheme, self.granularity)

    def quantize(self, x: torch.Tensor) -> QTensor:
        return quantize(x, self.scheme, self.granularity)

    def extra_repr(self) -> str:
        return f"{self.scheme.name}, granularity={self.granularity!r}"


def _weight_quantizer(weight: torch.Tensor, scheme: Scheme, granularity, learn: bool | None):
    is_int = scheme.scale_rule == "absmax" and scheme.grid.kind == "int"
    if learn is None:
        learn = is_int
    if learn and not is_int:
        raise ValueError(f"learned scales (LSQ) need a symmetric integer scheme, not "
                         f"{scheme.name!r}; pass learn_weight_scales=False (dynamic scales)")
    if learn:
        return LSQQuantizer(scheme, granularity, init=weight.detach())
    return DynamicQuantizer(scheme, granularity)


class QATLinear(nn.Linear):
    """nn.Linear whose forward multiplies (optionally quantized) inputs by quantized weights.

    weight: the float32 latent weights (out, in) the optimizer updates.
    weight_quantizer: LSQQuantizer or DynamicQuantizer. input_quantizer: None, a
    DynamicQuantizer (per token / tensor) or an activation LSQQuantizer.
    """

    def __init__(self, linear: nn.Linear, weight_quantizer: nn.Module,
                 input_quantizer: nn.Module | None = None) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
        self.weight_quantizer = weight_quantizer
        self.input_quantizer = input_quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x)
        return F.linear(x, self.weight_quantizer(self.weight), self.bias)


class QuantLinear(nn.Linear):
    """The converted layer: ``qweight`` (a QTensor) is the stored weight; ``weight`` is its
    dequantized float32 copy, so this is an ordinary nn.Linear to any code that reads it
    (qlab.lm.quality included). An input quantizer, if any, runs before the matmul."""

    def __init__(self, qweight: QTensor, bias: torch.Tensor | None = None,
                 input_quantizer: nn.Module | None = None) -> None:
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias=bias is not None)
        self.qweight = qweight
        self.weight.requires_grad_(False)
        with torch.no_grad():
            self.weight.copy_(dequantize(qweight))
            if bias is not None:
                self.bias.copy_(bias)
        self.input_quantizer = input_quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            with torch.no_grad():
                x = self.input_quantizer(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, qweight={self.qweight.scheme.name} "
                f"granularity={self.qweight.granularity!r}")


def prepare_qat(
    model: nn.Module,
    weight_scheme: str | Scheme = "int4",
    weight_granularity: Granularity = "channel",
    act_scheme: str | Scheme | None = None,
    act_granularity: str = "token",
    learn_weight_scales: bool | None = None,
) -> nn.Module:
    """A copy of ``model`` with every nn.Linear replaced by a QATLinear (the input model is
    not modified).

    weight_granularity: "tensor" | "channel" (one scale per output row) | group size.
    learn_weight_scales: LSQ steps (default for int2..int8) or, with False, qlab's scale
    rule recomputed every step (the only choice for NF4 / FP8 / MX / NVFP4).
    act_scheme: quantize each linear's input too (e.g. "int4" for W4A4); act_granularity
    "token" (one dynamic scale per token), "tensor" (one dynamic scale per batch) or
    "lsq" (one learned step per layer, int schemes; set by the first batch).
    """
    scheme = get_scheme(weight_scheme)
    if act_scheme is not None and act_granularity not in (*ACT_GRANULARITY, "lsq"):
        raise ValueError(f"act_granularity must be 'token', 'tensor' or 'lsq', "
                         f"got {act_granularity!r}")
    qat = copy.deepcopy(model)
    targets = [(name, m) for name, m in qat.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, (QATLinear, QuantLinear))]
    if not targets:
        raise ValueError("the model has no nn.Linear to quantize")
    for name, lin in targets:
        wq = _weight_quantizer(lin.weight, scheme, weight_granularity, learn_weight_scales)
        aq = None
        if act_scheme is not None:
            aq = (LSQQuantizer(act_scheme, "tensor") if act_granularity == "lsq"
                  else DynamicQuantizer(act_scheme, ACT_GRANULARITY[act_granularity]))
        _set_module(qat, name, QATLinear(lin, wq, aq))
    return qat


def convert(model: nn.Module) -> nn.Module:
    """A copy of a prepare_qat model with every QATLinear replaced by a QuantLinear holding
    the quantized weight as a QTensor (and the trained input quantizer, if any), in eval
    mode. Its forward equals the QAT model's forward, bit for bit."""
    targets = {n: m for n, m in model.named_modules() if isinstance(m, QATLinear)}
    if not targets:
        raise ValueError("no QATLinear in the model: convert takes what prepare_qat returned")
    for name, lin in targets.items():
        aq = lin.input_quantizer
        if isinstance(aq, LSQQuantizer) and not bool(aq.initialized):
            raise RuntimeError(f"{name}: its activation quantizer has not seen a batch yet, so "
                               "it has no step; run the model once (the first batch sets it)")
    return with_qtensors(model, {n: lin.weight_quantizer.quantize(lin.weight)
                                 for n, lin in targets.items()},
                         {n: lin.input_quantizer for n, lin in targets.items()})


def with_qtensors(model: nn.Module, qweights: dict[str, QTensor],
                  input_quantizers: dict[str, nn.Module | None] | None = None) -> nn.Module:
    """A copy of ``model`` (eval mode) whose named linears are QuantLinear layers holding
    the given QTensors (e.g. GPTQ's, from qlab.ptq.calibrate) and input quantizers."""
    out = copy.deepcopy(model)
    for name, qt in qweights.items():
        old = out.get_submodule(name)
        bias = None if getattr(old, "bias", None) is None else old.bias.detach()
        aq = None if input_quantizers is None else input_quantizers.get(name)
        _set_module(out, name, QuantLinear(qt, bias, copy.deepcopy(aq)))
    return out.eval()


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise ValueError("the model is a bare nn.Linear; wrap it (e.g. nn.Sequential(linear)) "
                         "so that its layer can be replaced")
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
