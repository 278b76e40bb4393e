"""Chapter 12's methods on every linear layer of a model (MiniLM or TinyLM).

    stats = minilm.input_absmax(model, retrieval.calibration_texts())   # or, for TinyLM,
                                                                         # quality.input_absmax
    q = outliers.quantize_model(model, outliers.Recipe(acts="int8", act_granularity="tensor"),
                                stats)                                   # a new model

Each linear y = x W^T + b becomes a ``QuantLinear`` that runs, in this order:

    x / s              SmoothQuant, as the reference code (smoothquant/smooth.py) applies it:
                       only to the layers that read a LayerNorm output (q, k, v and fc1),
                       with ONE s per LayerNorm, shared by the layers that read it:
                       s = smooth_scales(act_absmax, max over those layers of
                       max_j |W[:, j]|, alpha); W <- W * s (offline; act_absmax from
                       calibration data). The attention output projection and fc2 are not
                       smoothed (their inputs come from attention and GELU, which no
                       LayerNorm can absorb 1/s into).
    x Q                rotation, online: Q = hadamard(K) (applied with fwht),
                       random_rotation(K), or D hadamard(K) with D a diagonal of random
                       signs ("random_hadamard", QuaRot's randomized Hadamard: fwht(x * d));
                       W <- W Q (offline). x W^T = (x Q)(W Q)^T.
    x_hat              activations fake-quantized, dynamically (scales from the input itself):
                       "token" = one scale per token, "tensor" = one scale for all the
                       activations of one sequence (a text, a window), None = the scheme's own
                       blocks (NVFP4 16, with its FP32 scale per sequence; MX 32)
    x_hat W_hat^T + b  W_hat = fake_quantize(W, weights, one scale per output channel, or the
                       scheme's blocks)

or, with ``int8_threshold``, y = mixed_precision_matmul(x, W, threshold) + b (LLM.int8()).

Per-tensor scales are per sequence (a text, a window): as when a server runs one request at
a time, they do not depend on what else is in the batch. LLM.int8()'s outlier columns and
NVFP4's FP32 tensor scale are taken over the whole input of one call (bitsandbytes does the
same); ``MiniLM.embed`` batches only texts of equal length, so no padding enters them.
All quantization goes through qlab.fake_quantize; each method is the qlab.ptq function.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn

from qlab.lm.minilm import swap_linears
from qlab.lm.quality import _qlab_granularity
from qlab.ptq.llm_int8 import mixed_precision_matmul, outlier_columns
from qlab.ptq.rotation import fwht, random_rotation
from qlab.ptq.smoothquant import smooth_scales, weight_absmax
from qlab.quantize import fake_quantize, quantize

__all__ = [
    "Recipe",
    "QuantLinear",
    "quantize_model",
    "bits_per_element",
    "model_bits",
    "rotation_ops",
    "rotation_overhead",
    "input_groups",
    "SMOOTHED",
    "random_signs",
]

# The layers SmoothQuant's reference smooths (those that read a LayerNorm output), by the end
# of their name -> the name of the input they share (one s per shared input).
SMOOTHED = {
    "attention.self.query": "attention.self",  # MiniLM (BERT): q, k, v read one LayerNorm
    "attention.self.key": "attention.self",
    "attention.self.value": "attention.self",
    "intermediate.dense": "intermediate.dense",  # MiniLM fc1
    "attn.qkv": "attn.qkv",  # TinyLM: q, k, v are one fused linear
    "mlp.fc1": "mlp.fc1",
}


def _shared_input(name: str) -> str:
    """The name of the input a linear reads: q, k and v of one attention share one."""
    for end, shared in SMOOTHED.items():
        if name.endswith(end):
            return name[: len(name) - len(end)] + shared
    return name


def input_groups(names) -> dict[str, list[str]]:
    """{input name: [the linear layers that read it]}: MiniLM's query, key and value of one
    layer read the same LayerNorm output; every other linear has an input of its own."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(_shared_input(n), []).append(n)
    return groups


@dataclass(frozen=True)
class Recipe:
    """How every linear layer is quantized (see the module docstring for the order)."""

    weights: str | None = "int8"  # qlab scheme of W; None keeps float32
    weight_granularity: str | int | None = None  # None: per output channel (or the blocks)
    acts: str | None = "int8"  # qlab scheme of the input x; None keeps float32
    act_granularity: str | None = "token"  # "token", "tensor" (per sequence) or None (blocks)
    smooth_alpha: float | None = None  # SmoothQuant migration strength in [0, 1]
    rotation: str | None = None  # "hadamard", "random" or "random_hadamard"
    int8_threshold: float | None = None  # LLM.int8(): weights/acts above are not used
    seed: int = 0  # of the random rotation (or of the random signs)

    def __post_init__(self) -> None:
        if self.rotation not in (None, "hadamard", "random", "random_hadamard"):
            raise ValueError(f"rotation must be None, 'hadamard', 'random' or "
                             f"'random_hadamard', got {self.rotation!r}")
        if self.act_granularity not in ("token", "tensor", None):
            raise ValueError("act_granularity must be 'token', 'tensor' or None")


@lru_cache(maxsize=8)
def _random_rotation(n: int, seed: int) -> torch.Tensor:
    return random_rotation(n, seed)  # one QR per size, shared by the layers of that size


def random_signs(n: int, seed: int = 0) -> torch.Tensor:
    """(n,) float32 of +-1, seeded: the diagonal D of the randomized Hadamard D H."""
    return torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2.0 - 1


class QuantLinear(nn.Module):
    """A linear layer quantized by a Recipe: y = x_hat W_hat^T + b, float32 in and out.
    Input (..., T, K): the last-but-one axis is the sequence (a 2-d input is one sequence).

    ``outliers_seen``: bool (K,), the input channels LLM.int8() has sent to 16 bit so far."""

    def __init__(self, linear: nn.Linear, recipe: Recipe,
                 act_absmax: torch.Tensor | None = None,
                 smooth_weight_absmax: torch.Tensor | None = None) -> None:
        """smooth_weight_absmax: (K,) the weight statistic of SmoothQuant's s; default this
        layer's own max |W[:, j]|; quantize_model passes the max over the layers that share
        the input (q, k, v), so they share one s."""
        super().__init__()
        self.recipe = recipe
        w = linear.weight.detach().float().clone()  # shape: (N, K)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.smooth = None
        if recipe.smooth_alpha is not None:
            if act_absmax is None:
                raise ValueError("SmoothQuant needs calibration statistics: pass act_absmax "
                                 "(max |x| per input channel, e.g. minilm.input_absmax)")
            w_absmax = weight_absmax(w) if smooth_weight_absmax is None else smooth_weight_absmax
            self.smooth = smooth_scales(act_absmax, w_absmax, recipe.smooth_alpha)
            w = w * self.smooth
        self.rotation = self.signs = None
        if recipe.rotation == "hadamard":
            w = fwht(w)  # W Q with Q = hadamard(K): each row of W transformed
        elif recipe.rotation == "random_hadamard":
            self.signs = random_signs(self.in_features, recipe.seed)
            w = fwht(w * self.signs)  # W D H
        elif recipe.rotation == "random":
            self.rotation = _random_rotation(self.in_features, recipe.seed)
            w = w @ self.rotation
        if recipe.int8_threshold is None and recipe.weights is not None:
            gran = _qlab_granularity(recipe.weights, recipe.weight_granularity, "weights")
            w = fake_quantize(w, recipe.weights, gran)
        self.weight_hat = w
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.outliers_seen = torch.zeros(self.in_features, dtype=torch.bool)

    def _transform(self, x: torch.Tensor) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth
        if self.recipe.rotation == "hadamard":
            x = fwht(x)
        elif self.signs is not None:
            x = fwht(x * self.signs)
        elif self.rotation is not None:
            x = x @ self.rotation
        return x

    def _quantize_acts(self, x: torch.Tensor) -> torch.Tensor:
        """x (S, T, K): S sequences -> fake-quantized x, statistics per sequence."""
        r = self.recipe
        if r.acts is None:
            return x
        if r.act_granularity == "tensor":  # one scale per sequence = per row of (S, T * K)
            return fake_quantize(x.reshape(x.shape[0], -1), r.acts, "channel").reshape(x.shape)
        # per token / per block (NVFP4: with one FP32 tensor scale for the call)
        return fake_quantize(x, r.acts, _qlab_granularity(r.acts, r.act_granularity, "act"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.recipe
        K = self.in_features
        seqs = self._transform(x.float().reshape(-1, x.shape[-2] if x.ndim > 1 else 1, K))
        if r.int8_threshold is not None:  # shape of seqs: (S, T, K)
            self.outliers_seen |= outlier_columns(seqs, r.int8_threshold)
            y = mixed_precision_matmul(seqs, self.weight_hat, r.int8_threshold)
        else:
            y = self._quantize_acts(seqs) @ self.weight_hat.T
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.recipe}"


def quantize_model(model: nn.Module, recipe: Recipe,
                   act_absmax: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``model`` (MiniLM or TinyLM: anything with ``linear_layers()``) with every
    linear layer replaced by a QuantLinear(recipe); act_absmax: {name: (K,)} calibration
    maxima of each layer's input (needed for SmoothQuant).

    With ``recipe.smooth_alpha``, SmoothQuant smooths only the layers in SMOOTHED (those
    that read a LayerNorm output), with one s per shared input (q, k, v: the weight
    statistic is the max over the three), as the reference code does; the other layers get
    the recipe without smoothing."""
    layers = model.linear_layers()
    stats = act_absmax or {}
    missing = [n for n in layers if n not in stats]
    if act_absmax is not None and missing:
        raise KeyError(f"act_absmax has no statistics for {missing[:3]} ...; compute them on "
                       "this model (minilm.input_absmax / quality.input_absmax)")
    plain = replace(recipe, smooth_alpha=None)
    swapped = {}
    for group in input_groups(layers).values():
        smoothed = recipe.smooth_alpha is not None and any(
            group[0].endswith(end) for end in SMOOTHED)
        w_absmax = (torch.stack([weight_absmax(layers[n].weight.detach().float())
                                 for n in group]).amax(0) if smoothed else None)
        for n in group:  # the layers of a group read one input: its statistics are group[0]'s
            swapped[n] = QuantLinear(layers[n], recipe if smoothed else plain,
                                     stats.get(group[0]), w_absmax)
    return swap_linears(model, swapped)


# --------------------------------------------------------------------------- what it costs


def bits_per_element(recipe: Recipe, weight: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(weight bits, activation bits) per element of one layer, scales included, from
    qlab's QTensor.bits_per_element; x: the layer's calibration input (tokens, K).

    LLM.int8(): the outlier columns of x (and of W) are 16-bit, the rest int8 with its
    per-token (per-channel) fp16 scales. float32 where the recipe leaves a side alone.
    Bits depend on the row length and the scheme, not on the values: one row of each is
    quantized (per-tensor metadata is not counted, as in QTensor.bits_per_element)."""
    w_row, x_row = weight.detach()[:1], x[:1]
    if recipe.int8_threshold is not None:
        frac = float(outlier_columns(x, recipe.int8_threshold).double().mean())
        w8 = quantize(w_row, "int8", "channel").bits_per_element
        a8 = quantize(x_row, "int8", "channel").bits_per_element
        return (1 - frac) * w8 + 16 * frac, (1 - frac) * a8 + 16 * frac
    w_bits = a_bits = 32.0
    if recipe.weights is not None:
        gran = _qlab_granularity(recipe.weights, recipe.weight_granularity, "weights")
        w_bits = quantize(w_row, recipe.weights, gran).bits_per_element
    if recipe.acts is not None:
        gran = _qlab_granularity(recipe.acts, recipe.act_granularity, "act")
        a_bits = quantize(x_row, recipe.acts, gran).bits_per_element
    return w_bits, a_bits


def model_bits(model: nn.Module, recipe: Recipe,
               inputs: dict[str, torch.Tensor]) -> tuple[float, float]:
    """bits_per_element averaged over every linear layer of ``model``: weights weighted by
    their size, activations by K (each layer reads K activations per token).
    inputs: {name: (tokens, K)} calibration inputs (minilm.capture_inputs)."""
    w_sum = a_sum = w_n = a_n = 0.0
    for name, lin in model.linear_layers().items():
        wb, ab = bits_per_element(recipe, lin.weight, inputs[name])
        w_sum, w_n = w_sum + wb * lin.weight.numel(), w_n + lin.weight.numel()
        a_sum, a_n = a_sum + ab * lin.in_features, a_n + lin.in_features
    return w_sum / w_n, a_sum / a_n


def rotation_ops(k: int, rotation: str) -> int:
    """Operations per token to rotate one K-vector online: a dense matrix K^2 multiply-adds
    ("random"); the FWHT K log2(2^k) adds plus, for K = 12 * 2^k, 12 multiply-adds per
    element for the 12-point mix ("hadamard")."""
    if rotation == "random":
        return k * k
    m, p = (12, k // 12) if k % 12 == 0 else (1, k)
    return k * (p.bit_length() - 1) + (12 * k if m == 12 else 0)


def rotation_overhead(model: nn.Module, rotation: str) -> float:
    """Extra operations of rotating every linear layer's input online, as a fraction of the
    layers' own multiply-adds (K * N per token each). An input read by several layers (q, k
    and v) is rotated once (``input_groups``)."""
    layers = model.linear_layers()
    extra = sum(rotation_ops(layers[group[0]].in_features, rotation)
                for group in input_groups(layers).values())
    return extra / sum(lin.in_features * lin.out_features for lin in layers.values())
