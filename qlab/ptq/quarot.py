"""QuaRot's exact transformations of TinyLM: fold the LayerNorms, then rotate the residual
stream with a randomized Hadamard matrix (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456,
section 4; its Figure 3 shows the feed-forward block). Both return a NEW model that computes
the same function as the input; quarot_quantize then quantizes such a model as QuaRot does.

    folded = fold_layernorms(model)        # LayerNorm -> plain RMS norm, affines folded
    rotated = rotate(folded, seed=0)       # x -> x Q on the residual stream, Hadamard at fc2
    q = quarot_quantize(model, weights="int4", acts="int4", kv="hadamard_int4")  # 3. below

1. fold_layernorms (SliceGPT, Ashkboos et al. 2024, arXiv:2401.15024, section 3: LayerNorm
   transformers converted to RMSNorm). With C = I - 1 1^T / d (the centring matrix: x C =
   x - mean_i(x_i), C = C^T, C C = C), LayerNorm's variance is the mean square of x C, so

       LayerNorm(x) = (x C) / sqrt(mean((x C)^2) + eps) * g + b = rms(x C) * g + b,
       rms(z)       = z / sqrt(mean(z^2) + eps) = sqrt(d) z / sqrt(|z|^2 + d eps)

   (rms has no mean subtraction, gain or bias: nn.RMSNorm(d, eps, elementwise_affine=False)
   with LayerNorm's eps). The residual stream is a sum of writes (token and position
   embeddings, every attn.proj and mlp.fc2 output); centring each write (E -> E C for the
   embeddings' rows, W -> C W for the writers' (out, in) weights, b -> b C, so their
   outputs are y C) centres the sum, and a centred stream has x C = x, so every LayerNorm
   becomes rms(x) * g + b. LayerNorm only ever sees x C, so centring the writes does not
   change what it returns. The gain and bias then fold into each linear that reads the norm:
   (rms(x) * g + b) W^T = rms(x) (W diag(g))^T + W b, i.e. W -> W diag(g) (columns scaled)
   and a new bias W b: qkv, fc1, and the output head, which becomes an untied nn.Linear with
   weight E diag(g_f) and bias E b_f, E the ORIGINAL token embedding (the centring changes
   the embedding as a write to the stream, not the head, which reads the norm's output).

2. rotate. For an orthogonal Q (Q Q^T = I), rms(x Q) = rms(x) Q since |x Q| = |x|, so the
   folded model runs unchanged on the rotated stream x Q when
       embeddings E -> E Q                  (token and position rows)
       readers    W -> W Q                  (qkv, fc1, head: rms(x) Q (W Q)^T = rms(x) W^T)
       writers    W -> Q^T W, b -> b Q      (attn.proj, fc2: (h W^T + b) Q)
   with Q = diag(s) hadamard(d), s random signs from ``seed`` (QuaRot's randomized
   Hadamard). Inside the MLP, the GELU output h (width 4d) is rotated online by the
   orthonormal H = hadamard(4d) (``MLP.hidden_transform = online_hadamard``) and fc2's
   weight becomes Q^T W2 H: (h H)(Q^T W2 H)^T = h W2^T Q. H cannot be folded into fc1
   (GELU sits between). An identity in real arithmetic; float32 rounding differs.

3. quarot_quantize: the steps of QuaRot's fake_quant/main.py (spcl/QuaRot) on TinyLM, in
   its order: fold and rotate (or, with rotate=False, neither: main.py's unrotated baseline
   runs the same steps on the model as it is, except that its QKRotationWrapper still
   Hadamard-rotates queries and keys whenever k_bits < 16; kv="int4" here does not), then the
   weights of the block linears (GPTQ, sequential, on the inputs of the ROTATED model with
   float activations, as main.py runs GPTQ before it configures the activation quantizers;
   or RTN), then each block linear's input fake-quantized per token, then the KV cache
   (qlab.kv). The embeddings and the output head stay float (QuaRot's code keeps lm_head in
   16 bits: main.py, gptq_utils.py). Weights: one symmetric scale per output channel,
   QuaRot's main setting, with qlab's absmax scales (main.py's --w_clip searches a clipped
   scale instead).

Not done here (QuaRot does it): the Hadamard on values/attn.proj inputs (rotation_utils.py's
rotate_ov_proj folds a per-head Hadamard into v_proj's output and the full one into o_proj's
input; main.py runs only the part across heads online, before o_proj: the attn.proj input is
quantized unrotated here), the clipping ratios of activations and keys/values, and the
key/query rotation inside the model (qlab.kv's "hadamard" and "hadamard_int4" schemes rotate
keys and queries; values are not rotated).

Exactness: both are identities in real arithmetic. The new weights are computed in float64
and rounded to the model's dtype once per transformation (QuaRot's code, rotation_utils.py,
also rotates in float64 and casts back after each step, but then applies down_proj's
Hadamard in float32 and casts again); in float64 the logits of the shipped checkpoint are
reproduced to ~1e-13 (|logits| <= 23.5). In float32 the forward pass rounds differently: max
|diff| of the logits ~7e-5 on 8 validation windows, the same size as the float32 model's own
distance from its float64 evaluation (5.7e-5); the tests bound it by 1e-5 of max |logits|
(tests/ptq/test_quarot.py).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

import qlab.kv
from qlab.lm import quality
from qlab.lm.model import TinyLM
from qlab.ptq import calibrate
from qlab.ptq.rotation import fwht, hadamard
from qlab.schemes import get_scheme

__all__ = ["fold_layernorms", "rotate", "randomized_hadamard", "online_hadamard", "is_folded",
           "token_kurtosis", "quarot_quantize", "METHODS"]

METHODS = ("gptq", "rtn")  # how quarot_quantize rounds the weights


def _centre_rows(w: torch.Tensor) -> torch.Tensor:
    """Each row minus its mean: rows of an embedding times C."""
    w = w.detach().double()
    return w - w.mean(dim=-1, keepdim=True)


def _centre_outputs(w: torch.Tensor) -> torch.Tensor:
    """An (out, in) weight whose outputs are y C: C W, each column minus its mean."""
    w = w.detach().double()
    return w - w.mean(dim=0, keepdim=True)


def _folded_linear(w: torch.Tensor, ln: nn.LayerNorm,
                   old_bias: torch.Tensor | None = None) -> nn.Linear:
    """nn.Linear computing (z * g + b) W^T (+ old_bias) for ln's gain g and bias b:
    weight W diag(g), bias W b (+ old_bias)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=True, dtype=w.dtype)
    w, g, b = (t.detach().double() for t in (w, ln.weight, ln.bias))
    with torch.no_grad():
        lin.weight.copy_(w * g)
        lin.bias.copy_(w @ b + (0 if old_bias is None else old_bias.detach().double()))
    return lin


def _rms_norm(ln: nn.LayerNorm) -> nn.RMSNorm:
    return nn.RMSNorm(ln.normalized_shape, eps=ln.eps, elementwise_affine=False)


def is_folded(model: TinyLM) -> bool:
    """True for a model returned by fold_layernorms (or rotate): plain RMS norms, untied head."""
    norms = [m for b in model.blocks for m in (b.ln1, b.ln2)] + [model.ln_f]
    return model.head is not None and all(
        isinstance(n, nn.RMSNorm) and not n.elementwise_affine for n in norms)


@torch.no_grad()
def fold_layernorms(model: TinyLM) -> TinyLM:
    """A copy of TinyLM ``model`` whose LayerNorms are affine-free RMS norms (nn.RMSNorm with
    the same eps), with the residual stream centred and each LayerNorm's gain and bias folded
    into the linears that read it (see the module docstring for the algebra).

    The copy computes the same logits (an identity in real arithmetic; float32 rounding
    differs, see tests/ptq/test_quarot.py) with or without the KV cache; it keeps the
    model's dtype. qkv, fc1 and the new untied ``head`` get biases. Fold the float model
    before attaching quantizers: qkv and fc1 are new modules, hooks on the old ones are
    not carried over."""
    if any(not isinstance(m, nn.LayerNorm) for b in model.blocks for m in (b.ln1, b.ln2)) \
            or not isinstance(model.ln_f, nn.LayerNorm) or model.head is not None:
        raise ValueError("fold_layernorms needs a TinyLM with LayerNorms and the tied head "
                         "(e.g. qlab.lm.quality.load_model()); this one is already folded")
    out = copy.deepcopy(model)
    e_tok = model.tok_emb.weight.detach()
    out.tok_emb.weight.copy_(_centre_rows(e_tok))
    out.pos_emb.weight.copy_(_centre_rows(model.pos_emb.weight.detach()))
    for blk, src in zip(out.blocks, model.blocks, strict=True):
        for writer in (blk.attn.proj, blk.mlp.fc2):
            writer.weight.copy_(_centre_outputs(writer.weight))
            if writer.bias is not None:
                writer.bias.copy_(writer.bias - writer.bias.double().mean())
        blk.attn.qkv = _folded_linear(src.attn.qkv.weight, src.ln1, src.attn.qkv.bias)
        blk.mlp.fc1 = _folded_linear(src.mlp.fc1.weight, src.ln2, src.mlp.fc1.bias)
        blk.ln1, blk.ln2 = _rms_norm(src.ln1), _rms_norm(src.ln2)
    out.head = _folded_linear(e_tok, model.ln_f)
    out.ln_f = _rms_norm(model.ln_f)
    return out.eval()


def _hadamard(n: int, dtype: torch.dtype) -> torch.Tensor:
    """hadamard(n) in ``dtype``: its +-1 entries rounded back exactly, then / sqrt(n) in
    ``dtype`` (float64 gets a float64-orthogonal matrix, not float32's rounded entries)."""
    return (hadamard(n).double() * math.sqrt(n)).round().to(dtype) / math.sqrt(n)


def randomized_hadamard(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, n) orthogonal Q = diag(s) @ hadamard(n), s in {-1, +1}^n drawn from ``seed``
    (QuaRot's randomized Hadamard), in ``dtype``; n = 2^k or 12 * 2^k."""
    g = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (n,), generator=g).to(dtype) * 2 - 1
    return signs[:, None] * _hadamard(n, dtype)


def online_hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ hadamard(n) along the last axis, in x's dtype: fwht for float32, a matmul otherwise
    (fwht computes in float32). TinyLM's ``MLP.hidden_transform`` in a rotated model."""
    if x.dtype == torch.float32:
        return fwht(x)
    return x @ _hadamard(x.shape[-1], x.dtype)


@torch.no_grad()
def rotate(model: TinyLM, seed: int = 0) -> TinyLM:
    """A copy of a folded TinyLM (``fold_layernorms``) with the residual stream rotated by
    Q = randomized_hadamard(d_model, seed) and the online Hadamard H = hadamard(4 d_model)
    before fc2 (``MLP.hidden_transform = online_hadamard``); see the module docstring. Same
    logits as the folded model up to rounding; keeps the model's dtype."""
    if not is_folded(model):
        raise ValueError("rotate needs a model whose LayerNorms are folded: call "
                         "rotate(fold_layernorms(model), seed)")
    if any(b.mlp.hidden_transform is not None for b in model.blocks):
        raise ValueError("this model is already rotated (MLP.hidden_transform is set); "
                         "rotate the folded model instead")
    out = copy.deepcopy(model)
    q = randomized_hadamard(out.cfg.d_model, seed, torch.float64)
    h = _hadamard(out.blocks[0].mlp.fc2.in_features, torch.float64)
    for emb in (out.tok_emb, out.pos_emb):
        emb.weight.copy_(emb.weight.double() @ q)
    out.head.weight.copy_(out.head.weight.double() @ q)
    for blk in out.blocks:
        for reader in (blk.attn.qkv, blk.mlp.fc1):
            reader.weight.copy_(reader.weight.double() @ q)
        blk.attn.proj.weight.copy_(q.T @ blk.attn.proj.weight.double())
        blk.mlp.fc2.weight.copy_(q.T @ blk.mlp.fc2.weight.double() @ h)
        for writer in (blk.attn.proj, blk.mlp.fc2):
            if writer.bias is not None:
                writer.bias.copy_(writer.bias.double() @ q)
        blk.mlp.hidden_transform = online_hadamard
    return out.eval()


def token_kurtosis(x: torch.Tensor) -> float:
    """Kurtosis E[(x - mean)^4] / var^2 of each token's channels (last axis), averaged over
    the tokens: about 3 for Gaussian channels, large when a few channels are outliers. A rotation
    keeps each token's norm, so this (not the kurtosis of the whole tensor, which also sees
    tokens of different norms) is what it can flatten. Computed in float64."""
    z = x.detach().double().flatten(0, -2)
    z = z - z.mean(dim=-1, keepdim=True)
    return float(((z**4).mean(-1) / (z**2).mean(-1) ** 2).mean())


def _fold_and_rotate(model: TinyLM, seed: int) -> TinyLM:
    return rotate(fold_layernorms(model), seed)


def quarot_quantize(model: TinyLM, *, rotate: bool = True, weights: str | None = "int4",
                    acts: str | None = "int4", kv: str | None = None, method: str = "gptq",
                    seed: int = 0, calib: torch.Tensor | None = None,
                    progress: bool = False) -> TinyLM:
    """A new TinyLM quantized as QuaRot does it (module docstring, 3.); ``model`` untouched.

    rotate:  fold_layernorms, then the rotation Q = randomized_hadamard(d_model, seed)
             with the online Hadamard before fc2; False quantizes ``model`` as it is (the
             unrotated baseline, through the same steps).
    weights: qlab scheme of the block linears' weights, one scale per output channel
             (None: float). method "gptq" (sequential, qlab.ptq.calibrate.quantize_model;
             an integer scheme) or "rtn" (round to nearest, quality.quantize_weights).
    calib:   GPTQ's calibration windows of TRAINING text (default
             calibration_windows(): 32 x 256 bytes); unused by RTN.
    acts:    qlab scheme of every block linear's input, one scale per token (None: float).
    kv:      a qlab.kv scheme name (KV_SCHEME_NAMES) for the cache, or None.
    """
    if not isinstance(model, TinyLM):
        raise TypeError(f"quarot_quantize takes a TinyLM, got {type(model).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for scheme in (weights, acts):
        if scheme is not None:
            get_scheme(scheme)  # an unknown name fails here, before any calibration
    if method == "gptq" and weights is not None and get_scheme(weights).grid.kind != "int":
        raise ValueError(f"GPTQ takes integer weight schemes (int2..int8), got {weights!r}; "
                         "use method='rtn' for other formats")
    if kv is not None:
        qlab.kv.get_kv_scheme(kv)
    q = _fold_and_rotate(model, seed) if rotate else copy.deepcopy(model)
    if weights is not None and method == "gptq":
        q = calibrate.quantize_model(q, "gptq", weights, group_size=None, calib=calib,
                                     progress=progress).model
    elif weights is not None:
        q = quality.quantize_weights(q, weights, "channel")
    if acts is not None:
        q = quality.quantize_activations(q, acts, "token")
    if kv is not None:
        q = qlab.kv.quantize_cache(q, kv)
    return q.eval()
