"""Known-wrong implementations for chapter 15 (GGUF), merged into grading_bank.MUTANTS: one
per spec clause of qlab/grading/tasks/ch15_gguf.py (D1-D5, K1-K4, Q1-Q7). Each is the
solution cell of solutions/15_gguf.ipynb with one textual change, and must fail `check` on
every seed (test_grading_check.py runs them on several)."""

from __future__ import annotations

from mutant_edits import build_mutants

D_READ = "d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # shape: (n, 1)"
NIBBLES = "q = torch.cat([qs & 0xF, qs >> 4], dim=1)  # elements 0..15, then 16..31"
Q4_RETURN = "return d * (q - 8).float()"
SC = "sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)"
M = "m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)"
K_RETURN = "return d * sc.float(), dmin * m.float()"
D8 = "d = blocks.abs().amax(dim=-1) / 127  # shape: (n, k // 32)"
INV = "inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)"
AWAY = "q = torch.sign(y) * torch.floor(y.abs() + 0.5)  # half away from zero ..."
TIES = "q = torch.where((y - torch.trunc(y)).abs() == 0.5, q, torch.round(y))  # ... only at ties"

_EDITS = {
    "q4_0_decode": [
        ("D1: d read big-endian", [(D_READ, D_READ.replace("0:2", "[1, 0]"))]),
        (
            "D2: qlab's pack_int4 nibble order (elements 2j, 2j + 1 share a byte)",
            [(NIBBLES, "q = torch.stack([qs & 0xF, qs >> 4], dim=-1).reshape(-1, 32)")],
        ),
        ("D2: halves swapped", [(NIBBLES, "q = torch.cat([qs >> 4, qs & 0xF], dim=1)")]),
        ("D3: no offset, d * q", [(Q4_RETURN, "return d * q.float()")]),
        (
            "D3: sign-extended nibble instead of the offset 8",
            [(Q4_RETURN, "return d * torch.where(q >= 8, q - 16, q).float()")],
        ),
        ("D4: q * d - 8 * d", [(Q4_RETURN, "return d * q.float() - 8 * d")]),
        ("D5: the product in float16", [(Q4_RETURN, "return (d.half() * (q - 8).half()).float()")]),
        (
            "D6: returned as float64",
            [("return d * (q - 8).float()",
              "return d.double() * (q - 8).double()")],
        ),
    ],
    "q4_k_scales": [
        ("K1: d and dmin swapped", [(K_RETURN, "return dmin * sc.float(), d * m.float()")]),
        ("K2: no & 63 on sub-blocks 0-3", [(SC, SC.replace("s[:, 0:4] & 63", "s[:, 0:4]"))]),
        (
            "K3: top 2 bits of sub-blocks 4-7 dropped",
            [(SC, SC.replace(" | ((s[:, 0:4] >> 6) << 4)", ""))],
        ),
        (
            "K3: sc and m nibbles of bytes 8-11 swapped",
            [(SC, SC.replace("s[:, 8:12] & 0xF", "s[:, 8:12] >> 4")),
             (M, M.replace("s[:, 8:12] >> 4", "s[:, 8:12] & 0xF"))],
        ),  # fmt: skip
        (
            "K3: the top bits of sc taken from the min bytes",
            [(SC, SC.replace("(s[:, 0:4] >> 6)", "(s[:, 4:8] >> 6)"))],
        ),
        (
            "K4: the products in float16",
            [(K_RETURN, "return (d.half() * sc.half()).float(), (dmin.half() * m.half()).float()")],
        ),
        (
            "K5: returned as float64",
            [("return d * sc.float(), dmin * m.float()",
              "return d.double() * sc.double(), dmin.double() * m.double()")],
        ),
    ],
    "q8_0_quantize": [
        ("Q1: max instead of absmax", [(D8, D8.replace("blocks.abs().amax", "blocks.amax"))]),
        ("Q1: divides by 128", [(D8, D8.replace("/ 127", "/ 128"))]),
        (
            "Q2: divides by d instead of multiplying by 1 / d",
            [("y = blocks * inv[..., None]",
              "y = blocks / torch.where(d == 0, torch.ones_like(d), d)[..., None]")],
        ),  # fmt: skip
        ("Q3: torch.round (half to even)", [(TIES, "q = torch.round(y)")]),
        ("Q3: floor(y + 0.5) (half up)", [(AWAY, "q = torch.floor(y + 0.5)"), (TIES, "")]),
        ("Q4: codes from the float16 d", [(INV, INV.replace("1 / d)", "1 / d.half().float())"))]),
        ("Q6: roundf as sign(y) * floor(|y| + 0.5)", [(TIES, "")]),
        (
            "Q6: roundf as trunc(y + copysign(0.5, y))",
            [(AWAY, "q = torch.trunc(y + torch.copysign(torch.full_like(y, 0.5), y))"),
             (TIES, "")],
        ),  # fmt: skip
        ("Q7: d = absmax * (1 / 127)", [(D8, D8.replace("/ 127", "* (1 / 127)"))]),
        (
            "Q5: an epsilon instead of the zero guard",
            [(D8, D8.replace("d = blocks.abs().amax(dim=-1) / 127",
                             "d = (blocks.abs().amax(dim=-1) / 127).clamp(min=1e-4)"))],
        ),  # fmt: skip
        (
            "Q8: d returned as float32",
            [("return d.to(torch.float16), q.reshape(n, k).to(torch.int8)",
              "return d, q.reshape(n, k).to(torch.int8)")],
        ),
    ],
}

MUTANTS = build_mutants(_EDITS)
