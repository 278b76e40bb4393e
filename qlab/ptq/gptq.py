"""GPTQ: round one column at a time and push each column's error onto the columns not
yet quantized (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", Algorithm 1).

The layer objective is the output error on calibration inputs X (n, K):

    || X W^T - X W_hat^T ||^2 = (n / 2) sum_rows (w - w_hat) H (w - w_hat)^T,   H = 2 X^T X / n

Round-to-nearest (RTN) minimises each |w - w_hat| on its own and ignores H. GPTQ
quantizes column j, then moves the rest of the row by the optimal update
delta = -(w_j - q_j) / [H^-1]_jj * [H^-1]_j,: (the Optimal Brain Surgeon step), and
continues on the smaller problem. In Cholesky form the rows of U, the upper Cholesky
factor of H^-1, are exactly those updates, so with d = U_jj:

    for j in 0..K-1:                                    # in blocks of block_size columns
        q_j   = quantize(w_j, scale of j's group)       # scale set at the group's 1st column
        err_j = (w_j - q_j) / d
        w_k  -= err_j * U[j, k]          for k > j      # inside the block: at once;
                                                        # beyond it: one matmul per block
Conventions of the reference implementation (IST-DASLab/gptq, gptq.py ``fasterquant``)
that this file follows, each stated where it is implemented below:
  H = 2 X^T X / n, dead inputs, dampening, the upper Cholesky factor of H^-1, lazy
  block updates, group scales from the scheme's own rule at each group's first column,
  act_order (columns by decreasing diag(H)).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from qlab._tensor import as_float32, check_finite, torch_threads
from qlab.quantize import QTensor, quantize
from qlab.schemes import Scheme, get_scheme

__all__ = [
    "hessian", "layer_error", "gptq", "gptq_block", "upper_cholesky_of_inverse",
    "prepare_hessian",
]  # fmt: skip

ParamsFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


# --------------------------------------------------------------------------- inputs


def _work(x, what: str, copy: bool = True) -> torch.Tensor:
    """Float tensor for GPTQ's arithmetic: float64 stays float64 (tests use it to compare
    formulations exactly), everything else becomes float32, as in the reference. A copy
    unless copy=False (then possibly the input itself: do not modify it)."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
        x = x.detach().cpu()
        return x.clone() if copy else x
    x = as_float32(x, what)
    return x.clone() if copy else x


def hessian(x) -> torch.Tensor:
    """H = 2 X^T X / n from calibration inputs of a linear layer: (K, K).

    x: the layer's inputs (..., K) (every leading index is one of the n samples), or an
    iterable of such batches, accumulated batch by batch (X never has to fit in memory).
    float32 out (float64 if the inputs are float64).

    Reference convention: H = (2 / n) sum x x^T. The reference keeps a running average in
    float32 and counts sequences, not tokens, in n; here each batch's X^T X is summed in
    float64 and n counts rows (tokens). The scale of H does not change GPTQ's result
    (dampening is relative to mean(diag H), and every update is a ratio of H^-1 entries).
    """
    batches = [x] if isinstance(x, torch.Tensor) or not isinstance(x, Iterable) else x
    total, n, dtype = None, 0, torch.float32
    for b in batches:
        b = _work(b, "x", copy=False)
        if b.ndim == 0:
            raise ValueError("x must have a last axis of K input features, got a scalar")
        check_finite(b, "gptq")
        dtype = b.dtype
        b = b.reshape(-1, b.shape[-1])  # shape: (rows, K)
        part = (b.T @ b).double()  # shape: (K, K)
        if total is not None and part.shape != total.shape:
            raise ValueError(f"batches disagree on K: {part.shape[0]} vs {total.shape[0]}")
        total = part if total is None else total + part
        n += b.shape[0]
    if total is None or n == 0:
        raise ValueError("hessian needs at least one calibration sample (got none)")
    return (2.0 / n * total).to(dtype)


def layer_error(weight, w_hat, h) -> float:
    """The layer objective: mean over the n calibration samples and N outputs of
    (X W^T - X W_hat^T)^2, from H = 2 X^T X / n alone:

        mean((X D^T)^2) = trace(D H D^T) / (2 N),   D = W - W_hat (N, K)

    (X itself is not needed, which makes a sweep over many candidate W_hat cheap: one
    (N, K) x (K, K) product each). Computed in float64; returns a Python float."""
    d = torch.as_tensor(weight).double() - torch.as_tensor(w_hat).double()
    h64 = torch.as_tensor(h).double()
    if d.ndim != 2 or h64.shape != (d.shape[1], d.shape[1]):
        raise ValueError(f"need weight and w_hat (N, K) and h (K, K), got {tuple(d.shape)} "
                         f"and {tuple(h64.shape)}")
    return float((d * (d @ h64)).sum() / (2 * d.shape[0]))


def _int_scheme(scheme) -> Scheme:
    sch = get_scheme(scheme)
    if sch.grid.kind != "int" or sch.scale_rule not in ("absmax", "minmax"):
        raise ValueError(
            f"GPTQ and AWQ here take integer schemes (int2..int8, symmetric or *_asym), "
            f"got {sch.name!r}; quantize with qlab.quantize for other formats"
        )
    return sch


def _check_group(group_size, k: int) -> int:
    """group_size (int dividing K, or None = one group per row) -> columns per group."""
    if group_size is None:
        return k
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    if k % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the layer's K = {k} input features; "
            "pick a divisor (e.g. 64 for K = 192) or None for one scale per row"
        )
    return group_size


def _check_layer(weight, h) -> tuple[torch.Tensor, torch.Tensor]:
    w, h = _work(weight, "weight"), _work(h, "hessian")
    if w.ndim != 2:
        raise ValueError(f"weight must be (N, K) like nn.Linear.weight, got {tuple(w.shape)}")
    k = w.shape[1]
    if k == 0:
        raise ValueError("the weight has K = 0 input features: nothing to calibrate")
    if h.shape != (k, k):
        raise ValueError(
            f"hessian has shape {tuple(h.shape)} but the weight has K = {k} input features; "
            "compute it from this layer's inputs with qlab.ptq.hessian(x), x of shape (..., K)"
        )
    check_finite(w, "gptq")
    check_finite(h, "gptq")
    if h.numel() and bool((h - h.T).abs().max() > 1e-5 * h.abs().max()):
        raise ValueError("hessian is not symmetric; build it as 2 X^T X / n (qlab.ptq.hessian)")
    return w, h.to(w.dtype)


# --------------------------------------------------------------------------- H^-1


def prepare_hessian(h: torch.Tensor, w: torch.Tensor, damp: float) -> torch.Tensor:
    """The reference's preprocessing; modifies h and w IN PLACE (pass copies) and returns h.

    Dead inputs (H_ii = 0: that input was 0 on every calibration sample) get H_ii = 1 and
    their weights zeroed (they never affect the output, so any value is "optimal"; 0 keeps
    H invertible). Dampening adds damp * mean(diag H) to the diagonal (reference:
    percdamp = 0.01), which keeps the Cholesky factorisation stable when X is rank
    deficient. h (K, K) float, w (N, K) float (its dead columns are set to 0)."""
    if not (isinstance(damp, (int, float)) and 0 <= damp < float("inf")):
        raise ValueError(f"damp must be a finite number >= 0 (0.01 is usual), got {damp!r}")
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    idx = torch.arange(h.shape[0])
    h[idx, idx] += damp * torch.mean(torch.diag(h))
    return h


def upper_cholesky_of_inverse(h: torch.Tensor) -> torch.Tensor:
    """U, upper triangular with U^T U = H^-1, for symmetric positive definite H (K, K).

    The reference computes chol(H) -> cholesky_inverse -> chol(., upper=True): three
    O(K^3) steps. This computes the same (unique) factor with one Cholesky and one
    triangular solve: with J the reversal permutation and J H J = L L^T (lower L),
    H^-1 = (J L^-T J)(J L^-1 J) and J L^-1 J is upper triangular with a positive diagonal.
    About 4x faster at K = 4096; tests/ptq check it against the reference's route.
    """
    lower, info = torch.linalg.cholesky_ex(torch.flip(h, (0, 1)))  # J H J
    if int(info) != 0:
        raise ValueError(
            "the Hessian is not positive definite, even after dampening (leading minor "
            f"{int(info)} fails); check that it is 2 X^T X / n of real inputs, or raise damp "
            "(e.g. 0.1) or use more calibration samples"
        )
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    inv_lower = torch.linalg.solve_triangular(lower, eye, upper=False)  # L^-1
    return torch.flip(inv_lower, (0, 1))  # J L^-1 J


# --------------------------------------------------------------------------- columns


def _group_params(cols: torch.Tensor, sch: Scheme):
    """The scheme's own scale rule (qlab.quantize, qlab/scales.py) on a group's columns
    (N, g): scales (N,) float32 as stored (fp16 values), zero points (N,) or None."""
    qt = quantize(cols.float(), sch, "channel")
    zp = None if qt.zero_points is None else qt.zero_points.reshape(-1)
    return qt.scales.reshape(-1), zp


def _encode(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, sch: Scheme):
    """Codes of one column under a fixed group scale: the element step of qlab/scales.py's
    absmax / minmax rules (a true float32 division, RNE, clamp; all-zero group: s -> 1)."""
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    y = w.float() / s
    if zp is not None:
        y = torch.round(y) + zp.float()
    return sch.grid.encode(y)


def _decode(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None) -> torch.Tensor:
    """x_hat = scale * (code - zero_point) in float32, as qlab.dequantize computes it."""
    v = codes.float() if zp is None else codes.float() - zp.float()
    return v * scale.float()


def _quantize_columns(w1t: torch.Tensor, u1: torch.Tensor, params: ParamsFn, sch: Scheme,
                      err_t: torch.Tensor) -> torch.Tensor:
    """The inner loop of the reference (``for i in range(count)``) over one block.

    Stored transposed, so that a column of W is a contiguous row (5x faster updates):
    w1t (B, N): the block's current weights W[:, block].T, updated IN PLACE as columns
    are quantized. u1 (B, B): the block's diagonal block of U. params(i, w1t) -> the
    column's group scale and zero point (N,) (computed by the caller when column i is the
    first of its group). err_t (B, N) is filled in place with (w - q) / U_ii, the scaled
    errors the caller pushes onto the columns after the block. Returns codes (B, N).
    """
    codes = torch.empty(w1t.shape, dtype=sch.grid.code_dtype)
    with torch_threads(1):  # small ops (one column, one B x N block): one thread is faster
        for i in range(w1t.shape[0]):
            _quantize_column(i, w1t, u1, params, sch, err_t, codes)
    return codes


def _quantize_column(i, w1t, u1, params, sch, err_t, codes) -> None:
    """Column i of the block: quantize, record the scaled error, update the columns after
    it inside the block (all in place)."""
    scale, zp = params(i, w1t)
    w = w1t[i]
    codes[i] = _encode(w, scale, zp, sch)
    q = _decode(codes[i], scale, zp).to(w1t.dtype)
    err_t[i] = (w - q) / u1[i, i]
    # reference: W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
    w1t[i:] -= u1[i, i:, None] * err_t[i][None, :]


def gptq_block(w_block, u_block, scheme="int4", group_size: int | None = 128):
    """GPTQ on ONE block of columns whose first column starts a group (the exercise).

    w_block: (N, B) float, the block's current weights (earlier blocks' updates applied).
    u_block: (B, B) float, the block's diagonal block of U = upper Cholesky factor of H^-1.
    group_size must divide B (None: one group over the whole block).
    Each group's scale comes from the scheme's rule on the group's columns as they are
    when its first column is reached, i.e. after the updates from the earlier columns of
    this block. Returns (QTensor of the block's codes and group scales, err (N, B) =
    (w - q) / U_ii in w_block's float dtype: what the next blocks are updated with,
    w_rest -= err @ U[block, rest]).
    """
    sch = _int_scheme(scheme)
    w1, u1 = _work(w_block, "w_block"), _work(u_block, "u_block")
    if w1.ndim != 2 or u1.shape != (w1.shape[1], w1.shape[1]):
        raise ValueError(f"need w_block (N, B) and u_block (B, B), got {tuple(w1.shape)} "
                         f"and {tuple(u1.shape)}")
    g = _check_group(group_size, w1.shape[1])
    found: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def params(i: int, cur_t: torch.Tensor):
        if i % g == 0:  # a group starts: scale from its current (error-updated) columns
            found.append(_group_params(cur_t[i : i + g].T, sch))
        return found[-1]

    w1t = w1.T.contiguous()  # shape: (B, N)
    err_t = torch.zeros_like(w1t)
    codes = _quantize_columns(w1t, u1.to(w1.dtype), params, sch, err_t)
    return _as_qtensor(codes.T.contiguous(), found, sch, group_size), err_t.T.contiguous()


def _as_qtensor(codes, groups, sch: Scheme, group_size) -> QTensor:
    scales = torch.stack([s for s, _ in groups], dim=1).to(sch.scale_dtype)  # (N, groups)
    zps = None if groups[0][1] is None else torch.stack([z for _, z in groups], dim=1)
    return QTensor(codes=codes, scales=scales, zero_points=zps, scheme=sch,
                   granularity="channel" if group_size is None else group_size)


# --------------------------------------------------------------------------- the layer


def gptq(weight, hessian, scheme="int4", group_size: int | None = 128, damp: float = 0.01,
         block_size: int = 128, act_order: bool = False) -> QTensor:
    """Quantize a linear layer's weight (N, K) with GPTQ; returns an ordinary QTensor.

    hessian: (K, K), 2 X^T X / n of the layer's calibration inputs (qlab.ptq.hessian).
    scheme: any qlab integer scheme ("int2".."int8", "int4_asym", "uint{b}_asym").
    group_size: columns per scale along K (must divide K), or None for one scale per row.
    damp: fraction of mean(diag H) added to the diagonal. block_size: columns per lazy
    batch (a speed knob only: the result does not depend on it, see below).
    act_order: quantize columns in order of decreasing diag(H) (most-used inputs first,
    while the most columns are left to absorb their error); groups stay the contiguous
    groups of the unpermuted layout (see _GroupScales).
    Codes, group scales (fp16 for int schemes) and zero points are in the natural column
    order, so qt.dequantize(), qlab.pack_int4 and the W4A16 kernel take them as they are.
    """
    sch = _int_scheme(scheme)
    w, h = _check_layer(weight, hessian)
    n, k = w.shape
    g = _check_group(group_size, k)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (128 is usual), got {block_size!r}")
    if w.numel() == 0:  # nothing to quantize: the empty QTensor of the same scheme
        return quantize(w, sch, "channel" if group_size is None else group_size)
    h = prepare_hessian(h, w, damp)
    # act_order (reference: torch.argsort(diag(H), descending=True)); stable, so equal
    # diagonals keep their natural order and the result is reproducible.
    perm = (torch.argsort(torch.diag(h), descending=True, stable=True) if act_order
            else torch.arange(k))
    wt, h = w.T[perm].contiguous(), h[perm][:, perm]  # wt (K, N): column j is row j
    u = upper_cholesky_of_inverse(h)
    codes = torch.empty((k, n), dtype=sch.grid.code_dtype)
    groups = _GroupScales(wt, u, perm, g, sch)
    err_all = torch.empty((min(block_size, k), n), dtype=wt.dtype)
    for i1 in range(0, k, block_size):  # lazy batches (reference: blocksize = 128)
        i2 = min(i1 + block_size, k)
        w1t, err_t = wt[i1:i2], err_all[: i2 - i1]  # views: the block is updated in place
        params = groups.for_block(i1, err_t)
        codes[i1:i2] = _quantize_columns(w1t, u[i1:i2, i1:i2], params, sch, err_t)
        wt[i2:].addmm_(u[i1:i2, i2:].T, err_t, alpha=-1)  # the rest: W -= U^T err, one matmul
    natural = torch.empty((n, k), dtype=codes.dtype)
    natural[:, perm] = codes.T  # undo act_order's permutation
    return _as_qtensor(natural, [groups.found[j] for j in range(k // g)], sch, group_size)


class _GroupScales:
    """When and from what each group's scale is computed, for the whole layer.

    A group's scale is computed by the scheme's rule when the FIRST of its columns (in
    processing order) is reached, from the CURRENT weights of all its columns: those in
    the current block (updated in place) and those after it (w minus the updates of the
    block's columns done so far, which the lazy batch has not applied yet). This is the
    unblocked algorithm exactly, so block_size never changes the result. The reference
    reads W[:, j:j+g] instead, which misses those in-block updates when a group starts
    inside a block (group_size < block_size): an artefact of its batching, not of GPTQ.

    Groups are the contiguous groups of the natural column order (group of column c is
    c // g), also with act_order. This is the reference's ``static_groups`` layout (one
    scale per contiguous group: an ordinary QTensor, no g_idx indirection, what the
    W4A16 kernel reads), but with scales taken from the error-updated weights at the
    group's first visited column instead of from the original weights up front, so that
    act_order with an already-descending diag(H) is exactly plain GPTQ. The reference's
    default act_order groups consecutive PERMUTED columns instead, which needs a
    per-column group index (g_idx) at inference time.
    """

    def __init__(self, wt, u, perm, g: int, sch: Scheme) -> None:
        self.wt, self.u, self.g, self.sch = wt, u, g, sch
        self.position = torch.empty_like(perm)
        self.position[perm] = torch.arange(perm.numel())  # natural column -> position
        self.group_of = (perm // g).tolist()  # processing position -> group
        self.found: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def for_block(self, i1: int, err_t: torch.Tensor) -> ParamsFn:
        """params() for _quantize_columns in the block that starts at position i1."""

        def params(i: int, cur_t: torch.Tensor):
            gid = self.group_of[i1 + i]
            if gid not in self.found:
                pos = self.position[gid * self.g : (gid + 1) * self.g]  # all >= i1 + i
                inside = pos < i1 + cur_t.shape[0]
                cols_t = torch.empty((self.g, cur_t.shape[1]), dtype=cur_t.dtype)
                cols_t[inside] = cur_t[pos[inside] - i1]
                out = pos[~inside]  # pending: the block's updates so far, not yet applied
                cols_t[~inside] = self.wt[out] - self.u[i1 : i1 + i, out].T @ err_t[:i]
                self.found[gid] = _group_params(cols_t.T, self.sch)
            return self.found[gid]

        return params
