"""KV-cache quantization schemes for TinyLM, one entry point:

    q_model = qlab.kv.quantize_cache(model, "kivi4")      # a NEW TinyLM, model untouched
    qlab.kv.bits_per_element("kivi4", head_dim=64, seq_len=256)
    qlab.kv.KV_SCHEME_NAMES                               # the names below
    qlab.kv.attention_errors(model, "kivi4", windows)     # error in scores/outputs by position
    qlab.kv.scale_key_channel(model, 5, 20.0)             # same function, a key outlier channel

Named schemes (keys K and values V are (B, H, S, D) per layer, D = head_dim):

    int8, int4, int2   per token: symmetric int, one fp16 scale per group of 32 channels
                       of each token's head vector (qlab.fake_quantize(x, "int{b}", 32));
                       int2 is qlab's symmetric grid -1..1 (3 levels)
    kivi4, kivi2       KIVI-style (after Liu et al. 2024): keys per CHANNEL (one scale and
                       zero point per channel per chunk of 32 tokens), values per TOKEN
                       (groups of 32 channels), asymmetric, and the 32 most recent keys and
                       values kept in float. Two details are qlab's, not KIVI's code
                       (jy-yuan/KIVI): the grid is qlab's "uint{b}_asym" minmax rule (range
                       widened to include 0, integer zero point; KIVI quantizes over
                       [min, max] and stores the fp16 min), and all 32 recent keys stay
                       float (KIVI, with residual_length R = 32, keeps the R recent values
                       but, of the keys, only the newest incomplete R-token chunk: 0..R-1)
    fp8_static_tensor  FP8 E4M3 with one calibrated scale per layer for K and one for V,
                       k_scale = amax|K| / 448 over a calibration batch; stored value
                       E4M3(K / k_scale), read back as E4M3 * k_scale: the layout of vLLM's
                       fp8 KV cache with per-tensor k_scale / v_scale (vLLM docs, "Quantized
                       KV Cache"; its own calibration rule may differ from amax / 448)
    fp8_static_head    the same with one calibrated scale per (layer, head), like vLLM's
                       per-attention-head k_scale / v_scale of shape [num_kv_heads]
    fp8_dynamic        FP8 E4M3, one fp32 scale per token and head computed on the fly
                       (qlab.fake_quantize(x, "fp8_e4m3", "channel"))
    hadamard           keys AND queries multiplied by the orthonormal Hadamard matrix along
                       the head dimension (qlab.ptq.fwht), nothing quantized:
                       (q H)(k H)^T = q k^T, so logits equal the float model's up to float32
                       rounding. Rotating keys before quantizing spreads outlier channels
                       (QuaRot, Ashkboos et al. 2024)
    hadamard_int4      hadamard, then K and V as int4 (values not rotated)

How it attaches: each block's ``Attention.qkv_transform`` (qlab/lm/model.py) receives the
queries and ALL cached keys/values right before attention and returns what attention
reads. The cache itself stays float32, and each step attention reads it as the scheme would
store it (for the schemes here but the static FP8 ones, the layer's quantizer keeps what it
quantized and, as decoding appends, quantizes only the new entries: ``_CacheQuantizer``).
For every scheme here a token's quantized value depends only on the
token itself, a calibrated constant or a complete chunk of tokens, so it equals what a
cache that stores quantized entries would hold. The full-precision window is the exception
that depends on the length: it covers the `window` most recent positions of the cache, so
in a full forward over T tokens (qlab.lm.quality.logits) every query sees the cache as it
stands after the last token (positions < T - window quantized, even for the earliest
queries), while decoding one token at a time (``decode_logits``) each query sees its own
recent window, as a serving system would. On TinyLM the two differ a lot for kivi2
(measured on 8 validation windows of 256 bytes: KL 0.13 full forward, 0.001 decoding):
measure window schemes with ``decode_logits``.

Not modelled: KVQuant's (Hooper et al. 2024) pre-RoPE keys (TinyLM has learned absolute
positions, no RoPE), its non-uniform quantization (NUQ) and its dense-and-sparse outliers (its
per-channel keys are the kivi schemes' key axis).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import torch

import qlab
from qlab import formats
from qlab.lm.model import TinyLM
from qlab.ptq.rotation import fwht

__all__ = [
    "KVScheme",
    "KV_SCHEMES",
    "KV_SCHEME_NAMES",
    "get_kv_scheme",
    "quantize_cache",
    "quantize_keys",
    "quantize_values",
    "calibrate_fp8_scales",
    "fp8_static_scale",
    "bits_per_element",
    "decode_logits",
    "attention_errors",
    "scale_key_channel",
]

E4M3_MAX = formats.get("fp8_e4m3fn").max  # 448.0
GROUP = 32  # channels (per token) or tokens (per channel) sharing one scale
WINDOW = 32  # KIVI-style full-precision recent tokens, sized for TinyLM's 256-byte context
CALIB_WINDOWS = 8  # default calibration batch: windows of the TRAIN split


@dataclass(frozen=True)
class KVScheme:
    """How K and V are stored. ``element``: a qlab scheme name, None = float (no quantizer).

    key_axis "token": one scale per token per group of ``group`` channels (qlab's group
    granularity along D); "channel": one scale per channel per chunk of ``group`` tokens
    (chunks start at position 0). ``window``: most recent tokens kept in float.
    ``static``: FP8 with calibrated scales per "tensor" (layer) or per "head".
    ``rotate``: Hadamard on keys and queries before anything else.
    """

    name: str
    element: str | None
    key_axis: Literal["token", "channel"] = "token"
    group: int | None = GROUP
    window: int = 0
    static: Literal["tensor", "head"] | None = None
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.key_axis == "channel" and self.group is not None and self.window < self.group:
            raise ValueError(
                f"per-channel keys in chunks of {self.group} tokens need window >= "
                f"{self.group} (got {self.window}): an incomplete chunk has no scale yet"
            )


KV_SCHEMES: dict[str, KVScheme] = {
    s.name: s
    for s in [
        *(KVScheme(name=f"int{b}", element=f"int{b}") for b in (8, 4, 2)),
        *(KVScheme(name=f"kivi{b}", element=f"uint{b}_asym", key_axis="channel", window=WINDOW)
          for b in (4, 2)),
        KVScheme(name="fp8_static_tensor", element="fp8_e4m3", group=None, static="tensor"),
        KVScheme(name="fp8_static_head", element="fp8_e4m3", group=None, static="head"),
        KVScheme(name="fp8_dynamic", element="fp8_e4m3", group=None),
        KVScheme(name="hadamard", element=None, group=None, rotate=True),
        KVScheme(name="hadamard_int4", element="int4", rotate=True),
    ]
}
KV_SCHEME_NAMES = tuple(KV_SCHEMES)


def get_kv_scheme(scheme: str | KVScheme) -> KVScheme:
    """A KVScheme from its name (see KV_SCHEME_NAMES)."""
    if isinstance(scheme, KVScheme):
        return scheme
    if scheme not in KV_SCHEMES:
        raise ValueError(f"unknown KV-cache scheme {scheme!r}; known: {', '.join(KV_SCHEME_NAMES)}")
    return KV_SCHEMES[scheme]


def _granularity(sch: KVScheme) -> str | int:
    return "channel" if sch.group is None else sch.group  # qlab "channel" = one scale per row


def quantize_values(v: torch.Tensor, scheme: str | KVScheme) -> qlab.QTensor:
    """Per-token quantization of v (B, H, S, D): scales (B, H, S, D // group), or
    (B, H, S, 1) for one scale per token. Also how "token"-axis keys are quantized."""
    sch = get_kv_scheme(scheme)
    if sch.element is None or sch.static is not None:
        raise ValueError(f"{sch.name} has no per-token quantizer (float or static scales)")
    return qlab.quantize(v, sch.element, _granularity(sch))


def quantize_keys(k: torch.Tensor, scheme: str | KVScheme) -> qlab.QTensor:
    """Keys (B, H, S, D) as the scheme quantizes them, ignoring the window. key_axis
    "channel": the QTensor holds k transposed to (B, H, D, S), scales (B, H, D, S // group),
    S a multiple of group; "token": as quantize_values."""
    sch = get_kv_scheme(scheme)
    if sch.key_axis == "token":
        return quantize_values(k, sch)
    if k.shape[2] % sch.group:
        raise ValueError(
            f"per-channel keys take whole chunks of {sch.group} tokens, got {k.shape[2]}"
        )
    return qlab.quantize(k.transpose(2, 3), sch.element, sch.group)  # shape: (B, H, D, S)


def _fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3(x / scale) * scale, saturating at +-448 (qlab's convention)."""
    e4m3 = formats.get("fp8_e4m3fn")
    return e4m3.decode(e4m3.encode(x / scale)) * scale


# scale rules whose scales come from one group's own values (not NVFP4's per-tensor scale)
_GROUP_LOCAL_RULES = ("absmax", "minmax", "nf4", "e8m0", "ggml_q8_0", "ggml_q4_0")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same bit patterns, dtype and device (unlike torch.equal, +0 and -0
    differ, and equal NaNs match)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


class _CacheQuantizer:
    """The qkv_transform of one layer: what attention reads from a cache under ``scheme``.

    Decoding appends one token per step. When a stored entry depends only on its own token
    (per-token scales) or its own chunk (per-channel keys), as with every qlab element but
    NVFP4 (a per-tensor scale) and NF4 with double quantization, each call keeps what it
    quantized, and the next call quantizes only the entries past those when its cache
    starts with the same entries (the same bits). Each entry is then quantized once, though
    the comparison and copies still pass over the whole cache every step; the static FP8
    schemes and the other elements re-quantize the whole cache every call, and the
    rotation is applied to the whole cache every call (hadamard_int4's entries are reused).
    Either way the result equals a fresh quantizer's (tests/test_kv.py). What is kept, the
    last input and its quantized entries, stays in memory: about twice the layer's cache."""

    def __init__(self, scheme: KVScheme, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        self.scheme, self.k_scale, self.v_scale = scheme, k_scale, v_scale
        element = None if scheme.element is None else qlab.get_scheme(scheme.element)
        self.reuse = (element is not None and element.scale_rule in _GROUP_LOCAL_RULES
                      and not element.double_quant)
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (input, quantized)

    def _prefix(self, what: str, x: torch.Tensor, n: int, quantize) -> torch.Tensor:
        """quantize(x[:, :, :n]) for x (B, H, S, D), n positions (a multiple of ``group``
        for per-channel keys), reusing the last call's result when that call's input is no
        longer than n and x starts with its bits."""
        if not self.reuse:
            return quantize(x[:, :, :n])
        src, done = self._last.get(what, (None, None))
        if src is not None and not (src.shape[2] <= n and _same_bits(src, x[:, :, :src.shape[2]])):
            done = None
        if done is None:
            done = quantize(x[:, :, :n])
        elif done.shape[2] < n:
            done = torch.cat([done, quantize(x[:, :, done.shape[2]:n])], dim=2)
        self._last[what] = x[:, :, :n].detach().clone(), done  # a caller may change x later
        return done

    def _per_token(self, what: str, x: torch.Tensor) -> torch.Tensor:
        old = x.shape[2] - self.scheme.window  # positions older than the float window
        x_hat = x.clone()
        if old > 0:
            x_hat[:, :, :old] = self._prefix(
                what, x, old, lambda t: quantize_values(t, self.scheme).dequantize())
        return x_hat

    def _keys(self, k: torch.Tensor) -> torch.Tensor:
        sch, S = self.scheme, k.shape[2]
        if sch.key_axis == "token":
            return self._per_token("k", k)
        # whole chunks covering every position older than the window (window >= group)
        end = min(S, math.ceil(max(S - sch.window, 0) / sch.group) * sch.group)
        k_hat = k.clone()
        if end:
            k_hat[:, :, :end] = self._prefix(
                "k", k, end, lambda x: quantize_keys(x, sch).dequantize().transpose(2, 3))
        return k_hat

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        sch = self.scheme
        if sch.rotate:
            q, k = fwht(q), fwht(k)
        if sch.element is None:
            return q, k, v
        if sch.static is not None:
            k_hat, v_hat = _fp8_static(k, self.k_scale), _fp8_static(v, self.v_scale)
        else:
            k_hat, v_hat = self._keys(k), self._per_token("v", v)
        if sch.window:
            recent = slice(max(k.shape[2] - sch.window, 0), None)
            k_hat[:, :, recent], v_hat[:, :, recent] = k[:, :, recent], v[:, :, recent]
        return q, k_hat, v_hat


def _default_calibration() -> torch.Tensor:
    from qlab.lm.data import eval_windows, load_splits

    return eval_windows(load_splits()[0], CALIB_WINDOWS, 256)


def fp8_static_scale(t: torch.Tensor, per: Literal["tensor", "head"]) -> torch.Tensor:
    """The static FP8 scale of a calibration batch of K or V (B, H, S, D): amax|t| / 448 in
    float32, shape () for per="tensor", (H, 1, 1) for per="head" (amax over B, S, D of each
    head); an all-zero tensor (or head) gets 1."""
    amax = t.abs().amax() if per == "tensor" else t.abs().amax(dim=(0, 2, 3))[:, None, None]
    return torch.where(amax > 0, amax / E4M3_MAX, 1.0)  # shape: () or (H, 1, 1)


@torch.no_grad()
def calibrate_fp8_scales(model: TinyLM, windows: torch.Tensor, per: Literal["tensor", "head"]
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Static FP8 scales from a calibration batch (int64 (N, T + 1) windows, inputs
    windows[:, :-1]): per layer (k_scale, v_scale) = amax|K| / 448, amax|V| / 448 over the
    batch (float32 (); per="head": (H, 1, 1), one per head), from the float model's K/V
    (an all-zero tensor gets scale 1)."""
    m = copy.deepcopy(model)
    scales: list[tuple[torch.Tensor, torch.Tensor]] = []

    if per not in ("tensor", "head"):
        raise ValueError(f"per must be 'tensor' or 'head', got {per!r}")

    def record(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        scales.append((fp8_static_scale(k, per), fp8_static_scale(v, per)))
        return q, k, v

    for block in m.blocks:
        block.attn.qkv_transform = record
    m(windows[:, :-1])  # one batch: each layer records once, in order
    return scales


def quantize_cache(model: TinyLM, scheme: str | KVScheme,
                   calib: torch.Tensor | None = None) -> TinyLM:
    """Copy of ``model`` whose attention reads keys/values (and, for rotations, queries) as
    ``scheme`` stores them (names: KV_SCHEME_NAMES, see the module docstring). ``calib``:
    calibration windows for the static FP8 schemes (default: 8 windows of 256 bytes from
    the TRAIN split, so evaluation on validation text is not calibrated on itself)."""
    sch = get_kv_scheme(scheme)
    q = copy.deepcopy(model)
    if sch.static is not None:
        windows = _default_calibration() if calib is None else calib
        per_layer = calibrate_fp8_scales(model, windows, sch.static)
    else:
        per_layer = [(None, None)] * q.cfg.n_layer
    for block, (k_scale, v_scale) in zip(q.blocks, per_layer, strict=True):
        block.attn.qkv_transform = _CacheQuantizer(sch, k_scale, v_scale)
    return q


def bits_per_element(scheme: str | KVScheme, head_dim: int = 64, seq_len: int = 256,
                     float_bits: int = 16) -> float:
    """Mean bits per cached K/V element, scales and zero points included (qlab's
    QTensor.bits_per_element), for one sequence of ``seq_len`` tokens, in qlab's storage:
    for kivi{b}, b + (16 + b) / 32 (fp16 scale, b-bit zero point per 32 elements), not
    KIVI's b + (16 + 16) / 32 (fp16 scale and fp16 min). Float entries (the
    window, unquantized schemes) count ``float_bits``: the fp16/bf16 cache a serving system
    would otherwise hold (this simulation keeps them in float32). Static FP8 scales are a
    few floats per layer and, like qlab's per-tensor scales, not counted."""
    sch = get_kv_scheme(scheme)
    if sch.element is None:
        return float(float_bits)
    if sch.static is not None:
        return qlab.quantize(torch.zeros(1, head_dim), sch.element, "tensor").bits_per_element
    v_bits = quantize_values(torch.zeros(1, 1, 1, head_dim), sch).bits_per_element
    k_bits = v_bits
    if sch.key_axis == "channel":
        k_bits = quantize_keys(torch.zeros(1, 1, sch.group, head_dim), sch).bits_per_element
    n_float = min(sch.window, seq_len)
    return sum(((seq_len - n_float) * b + n_float * float_bits) / seq_len
               for b in (k_bits, v_bits)) / 2


@torch.no_grad()
def decode_logits(model: TinyLM, windows: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """float32 (N, T, vocab) logits for windows[:, :-1] computed as a server decodes: the
    first token, then one token at a time through the KV cache, so each query reads the
    cache as it stood at its own position. Same shape and meaning as
    qlab.lm.quality.logits (the full forward), T times as many forward calls."""
    model.eval()
    out = []
    for w in windows.split(batch):
        x, cache = w[:, :-1], model.new_cache()
        out.append(torch.cat([model(x[:, t:t + 1], cache) for t in range(x.shape[1])], dim=1))
    return torch.cat(out)


@torch.no_grad()
def scale_key_channel(model: TinyLM, channel: int, factor: float) -> TinyLM:
    """Copy of ``model`` with an outlier channel in its keys and (in exact arithmetic) the
    same function: in every layer and head, key channel ``channel`` (0..head_dim-1) is
    multiplied by ``factor`` and the same query channel divided by it, so every score
    q . k = sum_j q_j k_j is unchanged (float32 rounding aside) while the cache holds one
    channel ``factor`` times larger (TinyLM's qkv has no bias: rows of its weight suffice)."""
    D, C = model.cfg.head_dim, model.cfg.d_model
    if not 0 <= channel < D:
        raise ValueError(f"channel must be in 0..{D - 1} (a head dimension), got {channel}")
    if not factor > 0:
        raise ValueError(f"factor must be positive, got {factor}")
    m = copy.deepcopy(model)
    rows = torch.arange(channel, C, D)  # that channel in each head; qkv rows: q | k | v
    for block in m.blocks:
        block.attn.qkv.weight[rows] /= factor
        block.attn.qkv.weight[C + rows] *= factor
    return m


@torch.no_grad()
def attention_errors(model: TinyLM, scheme: str | KVScheme, windows: torch.Tensor,
                     calib: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """What a cache scheme changes in each layer's attention, per query position, as a server
    decoding one token at a time reads it: query t sees keys/values s <= t - window as
    stored and the newer ones in float. Inputs are the FLOAT model's q, k, v on
    windows[:, :-1] (T tokens, a multiple of the chunk for per-channel keys), so no error
    is inherited from earlier layers. float64 (n_layer, T) each:
      "scores":  RMS error of the pre-softmax scores q.k / sqrt(D) over windows, heads and
                 keys 0..t (in units of the softmax's input);
      "outputs": ||attn_hat - attn|| / ||attn|| of the attention output (softmax @ V) at t,
                 norms over windows, heads and head_dim.
    Scores are compared unrotated: (qH)(kH)^T = q k^T, so a rotation alone adds nothing."""
    sch, T = get_kv_scheme(scheme), windows.shape[1] - 1
    if sch.key_axis == "channel" and T % sch.group:
        raise ValueError(f"{sch.name} keeps keys in chunks of {sch.group} tokens: use windows of "
                         f"a multiple of {sch.group} tokens (got {T})")
    qm = quantize_cache(model, sch, calib)
    seen: list[tuple[torch.Tensor, ...]] = []
    m = copy.deepcopy(model)
    for block in m.blocks:
        block.attn.qkv_transform = lambda q, k, v: seen.append((q, k, v)) or (q, k, v)
    m(windows[:, :-1])
    out: dict[str, list[torch.Tensor]] = {"scores": [], "outputs": []}
    for (q, k, v), block in zip(seen, qm.blocks, strict=True):
        tr = block.attn.qkv_transform
        W = tr.scheme.window
        pad = torch.zeros(*k.shape[:2], W, k.shape[3])  # W newer positions: all of 0..T-1
        q_r, k_hat, v_hat = tr(q, torch.cat([k, pad], 2), torch.cat([v, pad], 2))  # are older
        k_hat, v_hat = k_hat[:, :, :T], v_hat[:, :, :T]
        t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
        causal, old = s <= t, s <= t - W  # shape: (T, T) query x key
        scale = math.sqrt(q.shape[-1])
        att = (q @ k.transpose(-2, -1) / scale).masked_fill(~causal, -math.inf)
        att_hat = torch.where(old, q_r @ k_hat.transpose(-2, -1) / scale, att)
        p, p_hat = att.softmax(-1), att_hat.softmax(-1)
        y, y_hat = p @ v, (p_hat * old) @ v_hat + (p_hat * ~old) @ v
        d2 = (att_hat - att).masked_fill(~causal, 0.0).double().pow(2).sum(dim=(0, 1, 3))
        n = causal.sum(1) * q.shape[0] * q.shape[1]  # keys seen at each position, all heads
        out["scores"].append((d2 / n).sqrt())
        out["outputs"].append((y_hat - y).double().pow(2).sum(dim=(0, 1, 3)).sqrt()
                              / y.double().pow(2).sum(dim=(0, 1, 3)).sqrt())
    return {key: torch.stack(v) for key, v in out.items()}
