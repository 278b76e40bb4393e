"""Chapter 08 (Triton primer): unpack int4 and dequantize with group scales, in Triton.

The learner writes kernel bodies; the wrappers (given) move inputs to the kernel device
and return CPU tensors. Cases are small and ragged: kernels run on the Triton CPU
interpreter when graded (kernel_env), where every load and store is bounds-checked
(tasks/_bounds.py), so a mask missing from a load fails too.

Spec clauses and the fixed case (every seed) that breaking each one changes:

triton_unpack_int4(packed uint8 (R, B)) -> int8 (R, 2B)
  T1 even output column from the low nibble .......................... "every byte"
  T2 nibbles 8..15 sign-extended to -8..-1 ........................... "every byte"
  T3 loads AND stores masked on both axes (R % 16 != 0, 2B % 64 != 0)  "ragged"
triton_dequant(packed (R, K/2), scales fp16 (R, K/g), g) -> fp32 (R, K)
  D1 scale column k // g, k the OUTPUT column (not the byte column) .. every multi-group row
  D2 nibble order and sign extension ................................. "every nibble"
  D3 g below and above the tile width 128 (g = 16: 8 groups per tile;
     g = 256: a group spans two tiles) ............................... "g 16" and "g 256"
  D4 loads and stores masked (R % 16 != 0; K = 48 < 128) ............. "g 16"
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, exact, tasks_for
from qlab.grading.tasks._inputs import INTERPRETER, choice, int4_qtensor, randint, weights
from qlab.grading.tasks._spec import hex_byte, num

task = tasks_for("08_triton_dequant", kernel_env=INTERPRETER)


def _byte_note(packed: torch.Tensor, r: int, k: int) -> str:
    side = "low" if k % 2 == 0 else "high"
    byte = hex_byte(packed[r, k // 2])
    return f"column {k} is the {side} nibble of byte packed[{r}, {k // 2}] = {byte}"


@task("triton_unpack_int4", "unpack_int4_triton", points=2,
      implements=("qlab.unpack_int4",),
      reference=lambda packed: qlab.unpack_int4(packed, signed=True),
      compare=exact(explain=lambda args, m: _byte_note(args[0], *m.index) + ", sign-extended"),
      signature="unpack_int4_triton(packed uint8 (R, B)) -> int8 codes (R, 2 * B)")
def _unpack_cases(g: torch.Generator):
    cases = []
    for _ in range(2):
        rows, k_bytes = randint(g, 1, 21), randint(g, 1, 150)  # ragged in both directions
        cases.append((torch.randint(0, 256, (rows, k_bytes), generator=g).to(torch.uint8),))
    # ragged: 3 of 16 rows, 74 of 128 columns in the last tile: masks on both axes
    cases.append((torch.randint(0, 256, (3, 37), generator=g).to(torch.uint8),))
    cases.append((torch.randperm(256, generator=g).to(torch.uint8).reshape(2, 128),))  # every byte
    return cases


def _dequant_explain(args, m: Mismatch) -> str:
    packed, scales, group = args
    r, k = m.index
    code = int(qlab.unpack_int4(packed[r : r + 1], signed=True)[0, k])
    s = scales[r, k // group]
    return (
        f"{_byte_note(packed, r, k)} -> code {code}; scale scales[{r}, {k} // {group}] = "
        f"{num(s)} (float16); code * scale in float32 = {num(code * s.float())}"
    )


# code * fp16 scale is exact in float32: the kernel must match bit for bit
@task("triton_dequant", "dequant_int4", points=3,
      implements=("qlab.dequantize", "qlab.kernels.dequantize_int4"),
      reference=lambda packed, scales, group: qlab.dequantize(int4_qtensor(packed, scales, group)),
      compare=exact(explain=_dequant_explain),
      signature="dequant_int4(packed uint8 (R, K/2), scales fp16 (R, K/g), g) -> fp32 (R, K)")
def _dequant_cases(g: torch.Generator):
    cases = []
    for _ in range(2):
        group = choice(g, (32, 64, 128))
        rows, k = randint(g, 1, 37), group * randint(g, 1, 3)
        qt = qlab.quantize(weights(g, (rows, k), outliers=True), "int4", group)
        cases.append((qlab.pack_int4(qt.codes), qt.scales, group))
    for group, n_groups in ((16, 3), (256, 2)):  # 8 groups per 128-wide tile; 2 tiles a group
        w = weights(g, (randint(g, 17, 30), group * n_groups))
        w *= torch.logspace(-1, 1, n_groups).repeat_interleave(group)  # distinct group scales
        qt = qlab.quantize(w, "int4", group)
        cases.append((qlab.pack_int4(qt.codes), qt.scales, group))
    # every nibble, -8 included (qlab's int4 uses -7..7; the layout allows -8)
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # shape: (3, 64)
    scales = (torch.rand(3, 2, generator=g) * 2 - 1).to(torch.float16)
    cases.append((qlab.pack_int4(codes), scales, 32))
    return cases
