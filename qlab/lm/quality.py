"""Measuring what quantization does to a language model.

Every function takes a TinyLM and returns a NEW model (the input is never modified),
so a notebook can hold the baseline and several variants side by side:

    quantize_weights(model, "int4", "channel")        weight-only (W4A16-style)
    quantize_activations(model, "int8", "token")      inputs of every linear (the A of W8A8)
    quantize_kv_cache(model, "int4", "token")         K and V as stored in the KV cache
    kv_entry_errors(model, windows, "int4", "token")  how the cache's error builds up
    prune_magnitude(model, 0.5)                       neighbour: zero the smallest weights
    low_rank(model, 32)                               neighbour: truncated SVD of each linear
    move_scale_into_layernorm(model, c, 30.0)         same function, one outlier channel

and the measurements compare logits of a variant against the baseline on the same
windows of held-out text:

    ref = logits(base, windows); q = logits(variant, windows)
    compare(ref, q, windows)   -> Comparison(ppl_ref, ppl, kl, flip_rate, ..., 95 % intervals)
    bootstrap_mean_ci(per_window_values)                    -> (lo, hi) over windows
    kl_per_token(ref, q)       -> (N, T) KL(ref || q) of every next-byte prediction
    worst_examples(ref, q, windows, k)
    layer_sensitivity(base, windows, transform)

All quantization goes through ``qlab.fake_quantize`` and all distances through
``qlab.metrics``: this module only decides WHERE a quantizer is applied.

Which tensors: the "linear weights" are the four nn.Linear of each block (qkv, proj,
fc1, fc2). The byte embedding (tied to the output head), position embedding and
LayerNorms stay in float32, as in most weight-only LLM quantizers.

Granularity names used here, mapped onto qlab's:
    weights      "channel" = one scale per output row; "tensor"; an int group size
    activations  "token"   = one scale per token (row of the (B, T, C) input) -> qlab "channel"
                 "tensor"  = one scale for the whole (B, T, C) batch (dynamic per-tensor)
    KV cache     "token"   = one scale per token per head (the D-vector)        -> qlab "channel"
                 an int g  = groups of g along the head dimension
    None         the natural choice: the scheme's fixed block (MX 32, NVFP4 16), NF4's 64,
                 else one scale per row ("channel" for weights, "token" for activations/KV)
A per-tensor KV scale is refused: a real cache is written one token at a time, so a
scale that depends on tokens not yet generated cannot exist at decode time.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

import qlab
import qlab.metrics
from qlab.lm.data import decode, eval_windows, load_splits
from qlab.lm.model import TinyLM, load_checkpoint
from qlab.lm.train import CHECKPOINT

Granularity = str | int | None


# --------------------------------------------------------------------------- loading


def load_model(path=CHECKPOINT) -> TinyLM:
    """The shipped TinyLM checkpoint, in eval mode, float32."""
    model, _ = load_checkpoint(path)
    return model


def checkpoint_meta(path=CHECKPOINT) -> dict:
    """What the training run recorded (steps, losses, val perplexity, seconds)."""
    return load_checkpoint(path)[1]


def validation_windows(n_windows: int = 16, block_size: int = 256) -> torch.Tensor:
    """int64 (n_windows, block_size + 1): fixed, evenly spaced windows of held-out text."""
    return eval_windows(load_splits()[1], n_windows, block_size)


@torch.no_grad()
def logits(model: TinyLM, windows: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """float32 (N, T, vocab) next-byte logits for the inputs windows[:, :-1]."""
    model.eval()
    return torch.cat([model(w[:, :-1]) for w in windows.split(batch)])


def nll(lg: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """float32 (N, T): negative log-likelihood (nats) of each actual next byte."""
    return F.cross_entropy(lg.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(
        lg.shape[:2]
    )


def perplexity(lg: torch.Tensor, windows: torch.Tensor) -> float:
    """exp(mean next-byte NLL): per-byte perplexity."""
    return math.exp(nll(lg, windows).mean().item())


# --------------------------------------------------------------------------- metrics


def kl_per_token(ref_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """(N, T): KL(softmax(ref) || softmax(q)) of every prediction, via qlab.metrics."""
    return qlab.metrics.kl_divergence(ref_logits, q_logits, reduction="none")


@dataclass
class Comparison:
    """Baseline vs variant on the same windows. Each *_ci is a 95 % percentile-bootstrap
    interval over windows (resampled with replacement, the same windows for both models),
    so it shows how much a figure could move with other text of the same kind; with few
    windows a percentile bootstrap runs too narrow (notebook 07): use many windows, or a
    t-interval."""

    ppl_ref: float  # perplexity of the baseline on the windows
    ppl: float  # perplexity of the variant
    kl: float  # mean KL(baseline || variant) per next-byte prediction, nats
    kl_max: float  # the worst single prediction's KL
    flip_rate: float  # fraction of positions whose top-1 next byte changed
    ppl_change_ci: tuple[float, float] = (math.nan, math.nan)  # of ppl / ppl_ref - 1
    kl_ci: tuple[float, float] = (math.nan, math.nan)
    flip_rate_ci: tuple[float, float] = (math.nan, math.nan)

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change, e.g. 0.01 = +1 %."""
        return self.ppl / self.ppl_ref - 1.0

    def row(self) -> str:
        return (f"ppl {self.ppl:7.3f} ({100 * self.ppl_change:+6.2f} %)  KL {self.kl:.4f}  "
                f"max KL {self.kl_max:6.3f}  flips {100 * self.flip_rate:5.2f} %")

    def row_ci(self) -> str:
        """row() with the 95 % bootstrap intervals."""
        (p0, p1), (k0, k1), (f0, f1) = self.ppl_change_ci, self.kl_ci, self.flip_rate_ci
        return (f"ppl {self.ppl:7.3f} ({100 * self.ppl_change:+6.2f} % "
                f"[{100 * p0:+.2f}, {100 * p1:+.2f}])  KL {self.kl:.4f} [{k0:.4f}, {k1:.4f}]  "
                f"flips {100 * self.flip_rate:5.2f} % [{100 * f0:.2f}, {100 * f1:.2f}]")


def bootstrap_mean_ci(per_window: torch.Tensor, n_boot: int = 1000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of per_window (N,) values: draw N windows
    with replacement n_boot times (seeded, so reproducible), take the mean of each draw,
    return the (1 - level) / 2 and (1 + level) / 2 quantiles. Windows, not tokens, are
    resampled: neighbouring tokens of one window are not independent."""
    v = torch.as_tensor(per_window, dtype=torch.float64).reshape(-1)
    if v.numel() == 0:
        raise ValueError("bootstrap_mean_ci needs at least one window")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, v.numel(), (n_boot, v.numel()), generator=g)
    means = v[idx].mean(dim=1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                dtype=torch.float64))
    return float(lo), float(hi)


def compare(ref_logits: torch.Tensor, q_logits: torch.Tensor, windows: torch.Tensor,
            n_boot: int = 1000, seed: int = 0) -> Comparison:
    """Perplexity, KL, flip rate of q against ref on the same windows, with 95 % bootstrap
    intervals over windows (n_boot resamples, seeded)."""
    kl = kl_per_token(ref_logits, q_logits)  # shape: (N, T)
    flips = (ref_logits.argmax(-1) != q_logits.argmax(-1)).double()  # shape: (N, T)
    nll_gap = (nll(q_logits, windows) - nll(ref_logits, windows)).double().mean(dim=1)
    lo, hi = bootstrap_mean_ci(nll_gap, n_boot, seed=seed)  # ppl / ppl_ref = exp(mean gap)
    return Comparison(
        ppl_ref=perplexity(ref_logits, windows),
        ppl=perplexity(q_logits, windows),
        kl=kl.mean().item(),
        kl_max=kl.max().item(),
        flip_rate=float(qlab.metrics.flip_rate(ref_logits, q_logits)),
        ppl_change_ci=(math.expm1(lo), math.expm1(hi)),
        kl_ci=bootstrap_mean_ci(kl.double().mean(dim=1), n_boot, seed=seed),
        flip_rate_ci=bootstrap_mean_ci(flips.mean(dim=1), n_boot, seed=seed),
    )


def kl_by_position(ref_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """(T,): mean KL at each position in the window, averaged over the N windows."""
    return kl_per_token(ref_logits, q_logits).mean(dim=0)


def worst_examples(ref_logits: torch.Tensor, q_logits: torch.Tensor, windows: torch.Tensor,
                   k: int = 5, context: int = 40) -> list[dict]:
    """The k predictions where the variant disagrees most with the baseline (largest KL).

    Each: window, position, KL, the text just before the prediction, the actual next
    byte, and the top next byte of the baseline and of the variant.
    """
    kl = kl_per_token(ref_logits, q_logits)
    top = kl.flatten().topk(k)
    T = kl.shape[1]
    out = []
    for value, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        n, t = divmod(flat, T)
        out.append({
            "window": n, "position": t, "kl": value,
            "context": decode(windows[n, max(0, t + 1 - context): t + 1]),
            "actual": decode([windows[n, t + 1]]),
            "baseline_top": decode([ref_logits[n, t].argmax()]),
            "variant_top": decode([q_logits[n, t].argmax()]),
        })
    return out


# --------------------------------------------------------------------------- where to quantize


def _block_linears(model: TinyLM, only: Iterable[str] | None = None) -> dict[str, torch.nn.Linear]:
    layers = model.linear_layers()
    if only is None:
        return layers
    only = list(only)
    missing = [n for n in only if n not in layers]
    if missing:
        raise KeyError(f"no linear layer named {missing}; choose from {sorted(layers)}")
    return {n: layers[n] for n in only}


def _qlab_granularity(scheme, granularity: Granularity, what: str) -> str | int | None:
    """Our granularity name -> qlab's. None = the natural choice: the scheme's fixed block
    (MX, NVFP4) or default group (NF4 64), else one scale per row (output channel / token)."""
    sch = qlab.get_scheme(scheme)
    if granularity is None:
        if sch.block is not None:
            return None
        if isinstance(sch.default_granularity, int):
            return sch.default_granularity
        return "channel"
    if granularity == "tensor" and what == "kv":
        raise ValueError(
            "a per-tensor KV-cache scale would depend on tokens not generated yet; "
            "use 'token' (one scale per token and head) or an int group size"
        )
    if granularity == "token":
        if what == "weights":
            raise ValueError("weights have no tokens; use 'channel', 'tensor' or a group size")
        return "channel"
    return granularity


@torch.no_grad()
def quantize_weights(model: TinyLM, scheme, granularity: Granularity = None,
                     only: Iterable[str] | None = None) -> TinyLM:
    """Copy of ``model`` whose block linear weights (or the ``only`` ones) are replaced by
    qlab.fake_quantize(W, scheme, granularity); W is (out, in), "channel" = per output row."""
    q = copy.deepcopy(model)
    g = _qlab_granularity(scheme, granularity, "weights")
    for lin in _block_linears(q, only).values():
        lin.weight.copy_(qlab.fake_quantize(lin.weight, scheme, g))
    return q


def _drop_activation_quantizers(model: TinyLM) -> None:
    """Remove the hooks quantize_activations attached (their handles live on the model);
    any other forward pre-hook stays."""
    for handle in getattr(model, "activation_quantizers", []):
        handle.remove()
    model.activation_quantizers = []


@torch.no_grad()
def outlier_channels(model: TinyLM, windows: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """For each block linear: indices of the k input channels with the largest |x| seen on
    ``windows`` (calibration data). int64 (k,) per layer name."""
    stats = input_absmax(model, windows)
    return {name: amax.topk(k).indices for name, amax in stats.items()}


@torch.no_grad()
def input_absmax(model: TinyLM, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 (in_features,) per block linear: max |input| per channel over ``windows``.

    Activation quantizers attached to ``model`` (forward pre-hooks) are dropped first, so
    these are the inputs a quantizer would see; quantized weights or KV still apply."""
    out: dict[str, torch.Tensor] = {}
    m = copy.deepcopy(model)  # the copy's handles point at the copy's hooks (deepcopy memo)
    _drop_activation_quantizers(m)

    def record(name):
        def hook(_mod, args):
            amax = args[0].abs().flatten(0, -2).amax(dim=0)
            out[name] = amax if name not in out else torch.maximum(out[name], amax)
        return hook

    for name, lin in m.linear_layers().items():
        lin.register_forward_pre_hook(record(name))
    logits(m, windows)
    return out


def quantize_activations(model: TinyLM, scheme, granularity: Granularity = None,
                         only: Iterable[str] | None = None,
                         keep_fp: dict[str, torch.Tensor] | None = None) -> TinyLM:
    """Copy of ``model`` that fake-quantizes the INPUT of each block linear (the activation
    operand of the matmul; weights untouched -- combine with quantize_weights for WxAy).

    keep_fp: optional {layer name: channel indices} kept in float32, the rest quantized
    (LLM.int8()-style mixed-precision outlier handling; see ``outlier_channels``).
    """
    q = copy.deepcopy(model)
    g = _qlab_granularity(scheme, granularity, "act")

    def make_hook(keep: torch.Tensor | None):
        def hook(_mod, args):
            x = args[0]
            if keep is None:
                return (qlab.fake_quantize(x, scheme, g),)
            x_in = x.clone()
            x_in[..., keep] = 0.0  # outliers leave the quantized part...
            x_hat = qlab.fake_quantize(x_in, scheme, g)
            x_hat[..., keep] = x[..., keep]  # ...and come back exactly
            return (x_hat,)
        return hook

    handles = list(getattr(q, "activation_quantizers", []))  # from an earlier call, if any
    for name, lin in _block_linears(q, only).items():
        keep = None if keep_fp is None else keep_fp.get(name)
        handles.append(lin.register_forward_pre_hook(make_hook(keep)))
    q.activation_quantizers = handles  # RemovableHandles: how input_absmax takes them off
    return q


def quantize_kv_cache(model: TinyLM, scheme, granularity: Granularity = None,
                      layers: Iterable[int] | None = None) -> TinyLM:
    """Copy of ``model`` whose keys and values are fake-quantized as they enter the cache
    (tensors (B, H, T, D); "token" = one scale per token per head).

    Each token's K/V is quantized on its own, so the full forward pass of this model
    gives what decoding with a quantized cache gives (tests/lm checks it)."""
    q = copy.deepcopy(model)
    g = _qlab_granularity(scheme, granularity, "kv")
    chosen = range(q.cfg.n_layer) if layers is None else layers
    for i in chosen:
        q.blocks[i].attn.kv_transform = lambda t: qlab.fake_quantize(t, scheme, g)
    return q


def _cache_entries(model: TinyLM, windows: torch.Tensor,
                   quantize: Callable[[torch.Tensor], torch.Tensor] | None) -> list[torch.Tensor]:
    """Per layer, K and V as they arrive at the cache on windows[:, :-1], BEFORE ``quantize``
    (which is then applied, as quantize_kv_cache does). float32 (2, N, H, T, D) each."""
    m = copy.deepcopy(model)
    seen: list[list[torch.Tensor]] = [[] for _ in m.blocks]

    def make(i: int):
        def transform(t: torch.Tensor) -> torch.Tensor:
            seen[i].append(t.clone())  # the attention calls it for K, then for V
            return t if quantize is None else quantize(t)
        return transform

    for i, block in enumerate(m.blocks):
        block.attn.kv_transform = make(i)
    logits(m, windows, batch=len(windows))  # one batch: K then V once per layer
    return [torch.stack(kv) for kv in seen]


@torch.no_grad()
def kv_entry_errors(model: TinyLM, windows: torch.Tensor, scheme,
                    granularity: Granularity = None) -> dict[str, torch.Tensor]:
    """Where the error of a quantized KV cache comes from, entry by entry.

    Runs ``model`` with its cache quantized (as quantize_kv_cache) and the baseline, and
    returns float64 (n_layer, T) relative errors of the cache entries, K and V together,
    norms over windows, heads and head_dim at each (layer, position):
      "own":       what quantizing an entry changes, ||Q(kv) - kv|| / ||kv||
      "inherited": how far kv already is from the baseline's before its own quantization,
                   ||kv - kv_base|| / ||kv_base||: the error it inherited from the quantized
                   entries of earlier layers that position t attended to (zero in layer 0).
    """
    g = _qlab_granularity(scheme, granularity, "kv")
    base = _cache_entries(model, windows, None)
    quant = _cache_entries(model, windows, lambda t: qlab.fake_quantize(t, scheme, g))

    def norm_per_position(t: torch.Tensor) -> torch.Tensor:
        # (2, N, H, T, D) -> (T,): over K/V, windows, heads and head_dim
        return t.double().pow(2).sum(dim=(0, 1, 2, 4)).sqrt()

    def rel(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        return norm_per_position(err) / norm_per_position(ref)

    own = [rel(qlab.fake_quantize(kv, scheme, g) - kv, kv) for kv in quant]
    inherited = [rel(kv - kv_base, kv_base) for kv, kv_base in zip(quant, base, strict=True)]
    return {"own": torch.stack(own), "inherited": torch.stack(inherited)}


@torch.no_grad()
def move_scale_into_layernorm(model: TinyLM, channel: int, factor: float,
                              bias: bool = True) -> TinyLM:
    """Copy with an activation outlier in ``channel`` and (in exact arithmetic) the same function.

    In every block, LayerNorm gain and bias of ``channel`` are multiplied by ``factor`` and
    the matching input column of the next linear (attn.qkv after ln1, mlp.fc1 after ln2) is
    divided by it: ``(f * (g * x_hat + b)) @ (W / f)`` is unchanged, but the linear's INPUT
    now has one channel ``factor`` times larger. The bias must be scaled too: with
    ``bias=False`` only the gain is, and the function changes (TinyLM's LayerNorms have
    biases). Wei et al. 2022 ("Outlier Suppression") find that LayerNorm gains amplify the
    outlier channels of big LLMs; SmoothQuant (Xiao et al. 2023) is this same move run
    backwards, to shrink outliers before quantizing.
    """
    q = copy.deepcopy(model)
    for block in q.blocks:
        for ln, lin in ((block.ln1, block.attn.qkv), (block.ln2, block.mlp.fc1)):
            ln.weight[channel] *= factor
            if bias:
                ln.bias[channel] *= factor
            lin.weight[:, channel] /= factor
    return q


# --------------------------------------------------------------------------- neighbours


@torch.no_grad()
def prune_magnitude(model: TinyLM, sparsity: float, only: Iterable[str] | None = None) -> TinyLM:
    """Copy with the ``sparsity`` fraction of smallest-|w| weights of each block linear set
    to zero (unstructured, per layer). sparsity in [0, 1)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    q = copy.deepcopy(model)
    for lin in _block_linears(q, only).values():
        w = lin.weight
        n_zero = int(round(sparsity * w.numel()))
        if n_zero:
            idx = w.abs().flatten().argsort()[:n_zero]  # stable order: ties broken by index
            w.view(-1)[idx] = 0.0
    return q


@torch.no_grad()
def low_rank(model: TinyLM, rank: int, only: Iterable[str] | None = None) -> TinyLM:
    """Copy with each block linear W (out, in) replaced by its best rank-``rank``
    approximation U_r S_r V_r^T (Eckart-Young): r * (out + in) parameters instead of out * in."""
    q = copy.deepcopy(model)
    for lin in _block_linears(q, only).values():
        U, S, Vh = torch.linalg.svd(lin.weight.double(), full_matrices=False)
        r = min(rank, S.numel())
        lin.weight.copy_((U[:, :r] * S[:r]) @ Vh[:r])
    return q


def low_rank_params(model: TinyLM, rank: int) -> int:
    """Parameters of the block linears after ``low_rank(model, rank)`` (factors stored)."""
    return sum(min(rank * sum(lin.weight.shape), lin.weight.numel())
               for lin in model.linear_layers().values())


# --------------------------------------------------------------------------- sensitivity


def layer_sensitivity(model: TinyLM, windows: torch.Tensor,
                      transform: Callable[[TinyLM, str], TinyLM],
                      ref_logits: torch.Tensor | None = None) -> dict[str, float]:
    """Mean KL to the baseline when ``transform(model, layer_name)`` alters ONE block linear
    at a time, e.g. ``lambda m, n: quantize_weights(m, "int3", only=[n])``."""
    ref = logits(model, windows) if ref_logits is None else ref_logits
    return {name: kl_per_token(ref, logits(transform(model, name), windows)).mean().item()
            for name in model.linear_layers()}
