"""Known-wrong implementations for chapter 06 (WxAy): one per spec clause of
qlab/grading/tasks/ch06_wxay.py (its id starts the name), plus classic mistakes. _WRITTEN:
whole cells; _EDITS: textual edits of the solution cell. See grading_bank.py."""

from __future__ import annotations

from mutant_edits import build_mutants

NIBBLES = "nibbles = (codes.to(torch.int16) & 0xF).to(torch.uint8)"
QX = "q_x = torch.clamp(torch.round(x / s_x[:, None]), -127, 127)"

_WRITTEN: dict[str, list[tuple[str, str]]] = {
    "pack_int4": [
        (
            "P1 wrong nibble order",
            """
def pack_int4(codes):
    n = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    return n[..., 1::2] | (n[..., 0::2] << 4)
""",
        ),
        (
            "P2 pairs along the wrong axis",
            """
def pack_int4(codes):
    n = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    half = codes.shape[-1] // 2
    return n[..., :half] | (n[..., half:] << 4)
""",
        ),
    ],
    "unpack_int4": [
        (
            "U1 wrong nibble order",
            """
def unpack_int4(packed, signed):
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    codes = torch.stack([hi, lo], dim=-1).reshape(*packed.shape[:-1], -1)
    return torch.where(codes >= 8, codes - 16, codes) if signed else codes
""",
        ),
        (
            "U2 no sign extension",
            """
def unpack_int4(packed, signed):
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)
""",
        ),
    ],
    "w8a8_matmul": [
        (
            "W1 per-tensor activation scale",
            """
def w8a8_matmul(x, w):
    s_x = (x.abs().max() / 127).to(torch.float16).float()
    s_w = (w.abs().amax(dim=1) / 127).to(torch.float16).float()
    q_x = torch.clamp(torch.round(x / s_x), -127, 127)
    q_w = torch.clamp(torch.round(w / s_w[:, None]), -127, 127)
    return (q_x.double() @ q_w.double().T).float() * (s_x * s_w[None, :])
""",
        ),
        (
            "W5 dequantize first, no fp16 scales",
            """
def w8a8_matmul(x, w):
    s_x = x.abs().amax(dim=1) / 127
    s_w = w.abs().amax(dim=1) / 127
    x_hat = torch.clamp(torch.round(x / s_x[:, None]), -127, 127) * s_x[:, None]
    w_hat = torch.clamp(torch.round(w / s_w[:, None]), -127, 127) * s_w[:, None]
    return x_hat @ w_hat.T
""",
        ),
    ],
}

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "pack_int4": [
        ("P3 negative codes not masked to 4 bits", [(NIBBLES, "nibbles = codes.to(torch.uint8)")]),
        ("P5 bytes returned as int16", [(NIBBLES, "nibbles = codes.to(torch.int16) & 0xF")]),
        (
            "P4 2-d only: pairs along dim 1",
            [
                (
                    "nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)",
                    "nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)",
                )
            ],
        ),
    ],
    "unpack_int4": [
        ("U3 always sign-extends", [("    if signed:\n", "    if True:\n")]),
        (
            "U5 codes returned as int16",
            [("lo = (packed & 0xF).to(torch.int8)", "lo = (packed & 0xF).to(torch.int16)"),
             ("hi = (packed >> 4).to(torch.int8)", "hi = (packed >> 4).to(torch.int16)")],
        ),
        ("U4 2-d only", [(".reshape(*packed.shape[:-1], -1)", ".reshape(packed.shape[0], -1)")]),
    ],
    "w8a8_matmul": [
        (
            "W4 round half up",
            [
                (
                    QX,
                    QX.replace(
                        "torch.round(x / s_x[:, None])", "torch.floor(x / s_x[:, None] + 0.5)"
                    ),
                )
            ],
        ),
        (
            "W3 codes from the unrounded float32 scales",
            [(QX, QX.replace("x / s_x[:, None]", "x / (x.abs().amax(dim=1) / 127)[:, None]"))],
        ),
        (
            "W2 one weight scale per tensor",
            [("(w.abs().amax(dim=1) / 127)", "(w.abs().max().repeat(w.shape[0]) / 127)")],
        ),
        (
            "W6 absmax rounded to float16 before the division",
            [(".amax(dim=1) / 127)", ".amax(dim=1).half().float() / 127)")],
        ),
        (
            "W4 multiply by the reciprocal",
            [(QX, QX.replace("x / s_x[:, None]", "x * (1 / s_x[:, None])"))],
        ),
        (
            "W8 codes not clamped (a subnormal float16 scale passes 127)",
            [("q_x = torch.clamp(torch.round(x / s_x[:, None]), -127, 127)",
              "q_x = torch.round(x / s_x[:, None])")],
        ),
        (
            "W7 float64 output (the exact sums never cast back)",
            [("acc = (q_x.double() @ q_w.double().T).float()",
              "acc = q_x.double() @ q_w.double().T")],
        ),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
