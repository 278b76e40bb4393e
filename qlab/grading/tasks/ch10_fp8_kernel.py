"""Chapter 10 (FP8 kernel): per-token E4M3 activation quantization and the FP8 GEMM with
one rescale at the end, in Triton. Loads and stores are bounds-checked on the interpreter.

Spec clauses and the fixed case (every seed) that breaking each one changes:

fp8_act_quant(x (M, K)) -> (codes uint8 (M, K), scales fp32 (M,))   [BLOCK_K = 128]
  A1 amax over the whole row: every K tile (K = 300 > 128) ........... "edges"
  A2 the K tail masked (K % 128 != 0), loads and stores .............. "edges"
  A3 s = amax / 448, a true float32 division ......................... "edges" row 1
  A4 q = E4M3(x / s), a true division (not x * (1 / s)) .............. "edges" row 2
  A5 E4M3 round half to even (ties, via round_to_e4m3) ............... "edges" row 3
  A6 an all-zero row: s = 0, divide by 1 ............................. "zero row"
  (A3, A4: bit-exact with qlab.quantize on purpose, the spec's first sentence says so; the
  feedback names amax * (1 / 448) and x * (1 / s) where they differ)
fp8_gemm(q_x (M, K), s_x (M,), q_w (N, K), s_w (N,)) -> fp32 (M, N)  [BLOCK 16 x 32 x 32]
  G1 the K tail masked (K % 32 != 0) with other=0 .................... "ragged"
  G2 M and N masked in loads and stores .............................. "ragged"
  G3 both scales, applied once after the K loop ...................... every case
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, close, exact, tasks_for
from qlab.grading.tasks._inputs import INTERPRETER, randint, rounding_splits, weights
from qlab.grading.tasks._spec import grid_rounding, num, quantized

task = tasks_for("10_fp8_kernel", kernel_env=INTERPRETER)
E4M3 = qlab.formats.get("fp8_e4m3fn")


def _act_explain(args, m: Mismatch) -> str:
    (x,) = args
    r = m.index[0]
    amax = x[r].float().abs().max()
    s = amax / 448.0
    head = f"row {r} (K = {x.shape[1]}): amax = {num(amax)}, s = amax / 448 = {num(s)}"
    if amax * (1.0 / 448.0) != s:
        head += f" (amax * (1 / 448) = {num(amax * (1.0 / 448.0))}: divide)"
    if m.output != "codes":
        return head
    xi = x[m.index].float()
    s1 = s if s != 0 else torch.tensor(1.0)
    y = float(xi / s1)
    note = f"{head}; x = {num(xi)}, x / s = {grid_rounding(y, E4M3)}"
    recip = (xi * (1 / s1)).reshape(1)
    if E4M3.encode(recip) != E4M3.encode(torch.tensor([y])):
        note += f" (x * (1 / s) = {num(recip)} encodes otherwise: divide)"
    return note


@task("fp8_act_quant", "fp8_quantize_rows", points=3, reference=lambda x: _act_reference(x),
      implements=("qlab.quantize", "qlab.kernels.quantize_act_fp8"),
      compare=exact(names=("codes", "scales"), explain=_act_explain),
      signature="fp8_quantize_rows(x (M, K)) -> (codes uint8 (M, K), scales fp32 (M,))")
def _act_cases(g: torch.Generator):
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        m, k = randint(g, 1, 20), randint(g, 1, 300)  # ragged K: masks on the row loop
        x = weights(g, (m, k), outliers=True)
        x = x * torch.logspace(-2, 2, m)[:, None]  # rows of very different ranges
        cases.append((x.to(dtype),))
    cases.append((_act_edges(g),))
    x = weights(g, (4, 64))
    x[1] = 0.0  # an all-zero token: scale 0, codes 0
    cases.append((x,))
    return cases


def _act_reference(x: torch.Tensor):
    codes, scales = quantized(x, "fp8_e4m3", "channel")  # one scale per row (token)
    return codes, scales.reshape(-1)


def _act_edges(g: torch.Generator) -> torch.Tensor:
    """(4, 300): the amax of rows 0, 1 in the first K tile, of rows 2, 3 in the last, partial
    one (columns 256..299). Row 1: amax / 448 differs
    from amax * fp32(1 / 448). Row 2: elements where x * (1 / s) and x / s round to other
    E4M3 codes. Row 3: s = 2^p exactly and elements on E4M3 midpoints (ties)."""
    k = 300
    x = weights(g, (4, k), scale=1.0).clamp(-3.0, 3.0)
    while True:  # A3: the reciprocal of 448 is not exact
        a1 = torch.empty(()).uniform_(4.0, 8.0, generator=g)
        if a1 / 448.0 != a1 * (1.0 / 448.0):
            break
    amaxes = [torch.tensor(5.0), a1]
    while True:  # A4
        a2 = torch.empty(()).uniform_(4.0, 8.0, generator=g)
        s = a2 / 448.0
        split = rounding_splits(
            lambda v, s=s: E4M3.encode(v / s),
            lambda v, s=s: E4M3.encode(v * (1.0 / s)),
            E4M3.values[(E4M3.values > 0.1) & (E4M3.values < 440)] * s,
            g,
        )
        if split.numel():
            break
    x[2, 256 : 256 + min(16, split.numel())] = split[:16]
    amaxes.append(a2)
    p = randint(g, -4, 2)
    ties = E4M3.values[(E4M3.values >= 1) & (E4M3.values <= 440)]
    i = torch.randint(0, ties.numel() - 1, (16,), generator=g)
    x[3, 260:276] = ((ties[i].double() + ties[i + 1].double()) / 2).float() * 2.0**p
    x[3] = x[3].clamp(-448 * 2.0**p, 448 * 2.0**p)
    amaxes.append(torch.tensor(448.0 * 2.0**p))
    for r, a in enumerate(amaxes):  # rows 0, 1: in the first tile; 2, 3: in the partial last
        x[r, (5, 100, 290, 295)[r]] = a
    return x


# fp8 x fp8 products are exact in fp32; only the order of the fp32 sums and of the
# two scale multiplications differ: <= K * 2**-23 of sum |terms| (~1e-5 here)
@task("fp8_gemm", "fp8_matmul", points=3,
      implements=("qlab.kernels.fp8_scaled_mm", "qlab.pipelines.w8a8_reference"),
      reference=lambda q_x, s_x, q_w, s_w: _gemm_reference(q_x, s_x, q_w, s_w),
      compare=close(rtol=1e-4, atol=1e-4, explain=lambda args, m: _gemm_explain(args, m)),
      signature="fp8_matmul(q_x u8 (M, K), s_x (M,), q_w u8 (N, K), s_w (N,)) -> fp32 (M, N)")
def _gemm_cases(g: torch.Generator):
    cases = []
    for k in (randint(g, 1, 300), randint(g, 1, 300), 32 * randint(g, 1, 4) + randint(g, 1, 31)):
        m, n = randint(g, 1, 40), randint(g, 1, 70)
        if len(cases) == 2:  # ragged: a partial tile on every axis
            m, n = 16 * randint(g, 1, 2) + randint(g, 1, 15), 32 + randint(g, 1, 31)
        qx = qlab.quantize(weights(g, (m, k), scale=1.0, outliers=True), "fp8_e4m3", "channel")
        qw = qlab.quantize(weights(g, (n, k), scale=0.05), "fp8_e4m3", "channel")
        cases.append((qx.codes, qx.scales.reshape(-1), qw.codes, qw.scales.reshape(-1)))
    return cases


def _gemm_reference(q_x, s_x, q_w, s_w):
    # qlab.pipelines.w8a8_reference, from the codes: exact fp32 products, fp32 sums,
    # one rescale at the end
    acc = E4M3.decode(q_x) @ E4M3.decode(q_w).T
    return acc * (s_x[:, None] * s_w[None, :])


def _gemm_explain(args, m: Mismatch) -> str:
    q_x, s_x, q_w, s_w = args
    r, n = m.index
    acc = E4M3.decode(q_x[r]) @ E4M3.decode(q_w[n])
    return (
        f"y[{r}, {n}] = (sum over all K = {q_x.shape[1]} of E4M3(q_x[{r}, k]) * "
        f"E4M3(q_w[{n}, k]) = {num(acc)}) * s_x[{r}] ({num(s_x[r])}) * s_w[{n}] ({num(s_w[n])})"
    )
