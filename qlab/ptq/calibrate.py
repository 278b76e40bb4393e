"""Calibrate a whole model, one linear layer after another (GPTQ, AWQ or RTN).

    from qlab.ptq import calibrate
    q = calibrate.gptq_model(model, "int4", 64)                # a TinyLM, ready to measure
    r = calibrate.quantize_model(model, "awq", "int3", 64)     # + QTensors, scales, errors

Sequential, as in the reference GPTQ's ``--true-sequential`` mode: the layers are taken in
the order the forward pass meets them, and each one is calibrated on the inputs it
receives in the model whose EARLIER layers are already quantized, so it also corrects
for the error those layers pass on. (llm-awq searches its scales on the float model
instead; here all three methods see the same inputs so that only the rounding differs.)

"awq" here is AWQ's scale search only (qlab.ptq.awq.awq), not the whole method of llm-awq:
one scale vector per linear, scored on that linear's output (llm-awq shares one among the
linears that read the same input, such as q, k and v, because one LayerNorm can hold only
one, and scores it on the output of the block they feed); no clipping search afterwards
(llm-awq runs auto_clip, qlab's ``awq_clip``); qlab's symmetric integer grids (llm-awq's
default has a zero point per group).

Calibration text comes from the TRAIN split only (``calibration_windows``); the
evaluation windows of ``qlab.lm.quality`` come from the validation split.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from qlab.lm.data import load_splits, random_batch
from qlab.ptq.awq import awq
from qlab.ptq.gptq import gptq, hessian, layer_error
from qlab.quantize import QTensor, quantize

__all__ = ["calibration_windows", "capture_inputs", "TinyLMInputs", "MiniLMInputs",
           "quantize_model", "gptq_model", "Calibrated", "METHODS", "W4A16Linear",
           "with_w4a16_kernel"]

Method = Literal["rtn", "awq", "gptq"]
METHODS = ("rtn", "awq", "gptq")
CALIB_SEED = 0  # the calibration windows' generator seed
# Inputs of linear `name` in `model`: (samples, K) float32.
InputsFn = Callable[[nn.Module, str], torch.Tensor]


def calibration_windows(n_windows: int = 32, block_size: int = 256,
                        seed: int = CALIB_SEED) -> torch.Tensor:
    """int64 (n_windows, block_size): random windows of TinyLM's TRAINING text (seeded).
    The validation split, where quality is measured, is never used for calibration."""
    train, _ = load_splits()
    x, _ = random_batch(train, n_windows, block_size, torch.Generator().manual_seed(seed))
    return x


class _Stop(Exception):
    """Raised by the capturing hook: the rest of the forward pass is not needed."""


@torch.no_grad()
def capture_inputs(model: nn.Module, name: str, batches, batch_size: int = 16,
                   run: Callable[[nn.Module, torch.Tensor], object] | None = None) -> torch.Tensor:
    """The inputs linear ``name`` receives when ``model`` reads ``batches``: float32
    (samples, K). batches: a tensor (e.g. int64 token windows (n, T)), read in chunks of
    batch_size along its first axis, or an iterable of model inputs (e.g. MiniLM's
    length_batches). Each forward pass (``run(model, chunk)``, default ``model(chunk)``)
    stops at the layer: nothing after it is needed."""
    lin = dict(model.named_modules())[name]
    seen: list[torch.Tensor] = []

    def hook(_mod, args):
        seen.append(args[0].detach().reshape(-1, args[0].shape[-1]).float().clone())
        raise _Stop

    handle = lin.register_forward_pre_hook(hook)
    try:
        for chunk in batches.split(batch_size) if isinstance(batches, torch.Tensor) else batches:
            try:
                model(chunk) if run is None else run(model, chunk)
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(seen)


class TinyLMInputs:
    """Calibration inputs of TinyLM's linears, asked for in forward order, without running
    the blocks already done again: the hidden state entering the current block is kept
    and moved one block on (through that block's now-quantized weights) once the next
    block's linears are asked for. About 3x cheaper than capture_inputs from the start."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows, self.block, self.h = windows, 0, None

    @torch.no_grad()
    def __call__(self, model: nn.Module, name: str) -> torch.Tensor:
        b = int(name.split(".")[1])  # "blocks.{b}.attn.qkv"
        if self.h is None or b < self.block:  # (re)start at the embeddings
            pos = torch.arange(self.windows.shape[1])
            self.h, self.block = model.tok_emb(self.windows) + model.pos_emb(pos), 0
        while self.block < b:
            self.h = model.blocks[self.block](self.h, self.block, None)
            self.block += 1
        block = model.blocks[b]
        return capture_inputs(block, name.split(".", 2)[2], self.h, run=lambda m, h: m(h, b, None))


class MiniLMInputs:
    """The same for MiniLM (qlab.lm.minilm) reading a list of token-id batches without
    padding (e.g. the ids of its ``length_batches``): each batch's hidden state entering
    the current encoder layer is kept. Each batch goes through the same operations as in
    capture_inputs, so the inputs are the same bit for bit (tests/ptq/test_calibrate.py)
    as long as the layers already passed are not changed afterwards and a new model starts
    at a layer below the last one asked for (a layer below restarts from the embeddings;
    like TinyLMInputs, it keeps no note of which model it read). quantize_model asks in
    forward order, which is what makes it cheap.
    Measured on one thread, GPTQ int4 over MiniLM's 36 linears (6 layers): 8.3 s, against
    27 s with capture_inputs from the embeddings for each linear."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches, self.layer, self.h = batches, 0, None

    @torch.no_grad()
    def __call__(self, model: nn.Module, name: str) -> torch.Tensor:
        from qlab.lm.minilm import key_bias

        def run(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
            return layer(h, key_bias(torch.ones(h.shape[:2], device=h.device)))

        b = int(name.split(".")[2])  # "encoder.layer.{b}.attention.self.query"
        layers = model.encoder.layer
        if self.h is None or b < self.layer:  # (re)start at the embeddings
            self.h, self.layer = [model.embeddings(ids) for ids in self.batches], 0
        while self.layer < b:
            self.h = [run(layers[self.layer], h) for h in self.h]
            self.layer += 1
        return capture_inputs(layers[b], name.split(".", 3)[3], self.h, run=run)


@dataclass
class Calibrated:
    """What quantize_model returns.

    model:        a copy of the model; each linear's weight is what the quantized layer
                  computes with (qt.dequantize(), or Q(W * s) / s for AWQ), so
                  qlab.lm.quality measures it like quantize_weights' models
    qtensors:     layer name -> QTensor (codes, group scales: pack them for a kernel)
    input_scales: layer name -> AWQ's s (float32 (K,)); the layer computes (x / s) @ W_q^T
    rel_errors:   layer name -> ||X W^T - X W_hat^T||^2 / ||X W^T||^2 on its calibration
                  inputs (the layer objective, relative)
    seconds:      wall time of the whole calibration
    """

    model: nn.Module
    qtensors: dict[str, QTensor] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    rel_errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _linear_names(model: nn.Module) -> list[str]:
    if hasattr(model, "linear_layers"):
        return list(model.linear_layers())
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def quantize_model(model: nn.Module, method: Method = "gptq", scheme="int4",
                   group_size: int | None = 64, calib: torch.Tensor | None = None,
                   inputs: InputsFn | None = None, act_order: bool = False,
                   damp: float = 0.01, block_size: int = 128, n_grid: int = 20,
                   progress: bool = True) -> Calibrated:
    """Quantize every linear of ``model`` (a copy) sequentially with ``method``.

    calib: TinyLM token windows (default: calibration_windows(), 32 x 256 training bytes).
    inputs: for other models, a function (model, layer name) -> that layer's calibration
    inputs (samples, K) in the model as it is now (e.g. MiniLM on calibration sentences).
    group_size 64 by default: TinyLM's K = 192 is not a multiple of 128.
    act_order, damp, block_size: GPTQ's (qlab.ptq.gptq); n_grid: AWQ's (qlab.ptq.awq).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    start = time.perf_counter()
    if inputs is None:
        inputs = TinyLMInputs(calibration_windows() if calib is None else calib)
    out = Calibrated(model=copy.deepcopy(model))
    layers = dict(out.model.named_modules())
    names = _linear_names(out.model)
    for name in tqdm(names, desc=f"{method} {scheme}", disable=not progress, leave=False):
        lin = layers[name]
        w = lin.weight.detach().float().clone()
        x = inputs(out.model, name)
        h = hessian(x)
        if method == "gptq":
            qt = gptq(w, h, scheme, group_size, damp, block_size, act_order)
            w_hat = qt.dequantize()
        elif method == "awq":
            qt, s = awq(w, x, scheme, group_size, n_grid)
            out.input_scales[name] = s
            w_hat = qt.dequantize() / s[None, :]
        else:
            qt = quantize(w, scheme, "channel" if group_size is None else group_size)
            w_hat = qt.dequantize()
        out.qtensors[name] = qt
        out.rel_errors[name] = layer_error(w, w_hat, h) / layer_error(w, torch.zeros_like(w), h)
        lin.weight.copy_(w_hat.to(lin.weight.dtype))
    out.seconds = time.perf_counter() - start
    return out


def gptq_model(model: nn.Module, scheme="int4", group_size: int | None = 64,
               **kwargs) -> nn.Module:
    """One call: a copy of ``model`` (e.g. TinyLM) with every linear GPTQ-quantized
    sequentially on training-split calibration windows, ready for qlab.lm.quality
    (like quality.quantize_weights for RTN). kwargs: those of quantize_model."""
    return quantize_model(model, "gptq", scheme, group_size, **kwargs).model


# --------------------------------------------------------------------------- end to end


class W4A16Linear(nn.Module):
    """An nn.Linear replacement that runs the W4A16 Triton kernel (qlab.kernels) on the int4
    codes and fp16 group scales of a QTensor, packed once (buffers: .to(device) moves them).
    Activations are cast to fp16 on the way in, the output back to their dtype. (Importing
    qlab.kernels starts Triton; without a GPU it runs on the interpreter.)"""

    def __init__(self, qt: QTensor) -> None:
        from qlab.kernels import W4A16Weight

        super().__init__()
        w = W4A16Weight.from_qtensor(qt)
        self.register_buffer("packed", w.packed)  # uint8 (N, K // 2)
        self.register_buffer("scales", w.scales)  # float16 (N, K // group_size)
        self.register_buffer("words", w.words)  # int32 decode layout, or None
        self.group_size, self.shape = w.group_size, w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from qlab.kernels import W4A16Weight, w4a16_linear

        w = W4A16Weight(self.packed, self.scales, self.group_size, self.shape, self.words)
        return w4a16_linear(x.to(torch.float16), w).to(x.dtype)


def with_w4a16_kernel(model: nn.Module, qtensors: dict[str, QTensor]) -> nn.Module:
    """A copy of ``model`` whose named linears run the W4A16 kernel on their int4 QTensors
    (GPTQ's or RTN's, scheme "int4" with an integer group size)."""
    q = copy.deepcopy(model)
    for name, qt in qtensors.items():
        parent, _, child = name.rpartition(".")
        setattr(q.get_submodule(parent), child, W4A16Linear(qt))
    return q
