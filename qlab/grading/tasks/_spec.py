"""Shared pieces of the task references and of their feedback.

``quantized`` is the "quantize with qlab, return some fields" reference. The ``*_note``
helpers phrase what a spec computes at one element (x / s and whether it is a tie, a value
against a minifloat grid, an NF4 midpoint, a byte in hex) for the tasks' ``explain``
functions, so that a failing check shows the step that went wrong, not only the result.
"""

from __future__ import annotations

import math

import torch

import qlab


def quantized(x, scheme, granularity=None, fields=("codes", "scales")) -> tuple:
    """qlab.quantize(x, scheme, granularity), returning the QTensor's ``fields`` in order."""
    qt = qlab.quantize(x, scheme, granularity)
    return tuple(getattr(qt, f) for f in fields)


def num(v) -> str:
    """A float with enough digits to tell float32 neighbours apart."""
    return f"{float(v):.9g}"


def hex_byte(v: int) -> str:
    """'0xA7 (high nibble 0xA, low nibble 0x7)'."""
    v = int(v) & 0xFF
    return f"0x{v:02X} (high nibble 0x{v >> 4:X}, low nibble 0x{v & 0xF:X})"


def div32(x, s) -> float:
    """x / s as a float32 division (as qlab and the spec compute it)."""
    return float(torch.tensor(float(x), dtype=torch.float32) / torch.tensor(float(s)))


def int_rounding(y: float) -> str:
    """'12.5, exactly halfway between 12 and 13: a tie; round-half-to-even gives 12'."""
    low = math.floor(y)
    if y - low == 0.5:
        even = low if low % 2 == 0 else low + 1
        return (
            f"{num(y)}, exactly halfway between {low} and {low + 1}: a tie; "
            f"round-half-to-even gives {even}"
        )
    return f"{num(y)} (nearest integer {round(y)})"


def grid_rounding(y: float, grid) -> str:
    """Where a minifloat grid's RNE, saturating encode sends y, naming a tie or a saturation."""
    code = int(grid.encode(torch.tensor([y], dtype=torch.float32))[0])
    value = float(grid.decode(torch.tensor([code], dtype=torch.uint8))[0])
    to = f"{num(value)} (code 0x{code:02X})"
    mag, vals = abs(y), grid.values.double()
    if mag > grid.max:
        return f"{num(y)}, beyond the largest value {num(grid.max)}: it saturates to {to}"
    above = vals[vals >= mag]
    below = vals[vals <= mag]
    hi, lo = float(above[0]), float(below[-1])
    if mag in (lo, hi):
        return f"{num(y)}, exactly on the grid: {to}"
    if mag == (lo + hi) / 2:
        return (
            f"{num(y)}, exactly halfway between {num(lo)} and {num(hi)} in magnitude: a tie; "
            f"round-half-to-even takes the even code: {to}"
        )
    return f"{num(y)}, between {num(lo)} and {num(hi)} in magnitude; nearest: {to}"


def nf4_rounding(u: float) -> str:
    """Where NF4's midpoint rule sends a normalised value u, naming an exact midpoint."""
    nf4 = qlab.formats.get("nf4")
    mids, levels = nf4.midpoints, nf4.values
    code = int(nf4.encode(torch.tensor([u], dtype=torch.float32))[0])
    on = (mids == u).nonzero()
    if on.numel():
        k = int(on[0, 0])
        return (
            f"u = {num(u)} lies exactly ON the midpoint between levels {num(levels[k])} and "
            f"{num(levels[k + 1])}: bitsandbytes' rule (u <= midpoint takes the lower code) "
            f"gives code {k}"
        )
    return f"u = {num(u)}: nearest level {num(levels[code])} (code {code})"


def int8_row_note(name: str, v: torch.Tensor) -> str:
    """The fp16 scale of one symmetric int8 row v (qmax 127) and the columns where the
    spec's v / s differs from a common variant: an exact tie, x * (1 / s), the float32 scale,
    and whether fp16(max|v|) / 127 gives another scale."""
    s32 = v.abs().max() / 127
    s = s32.half().float()
    head = f"{name}: s = fp16(max|row| / 127) = {num(s)}"
    if s32.half() != (v.abs().max().half().float() / 127).half():
        head += " (fp16(max|row|) / 127 would give another s: divide first, then round)"
    if s == 0:
        return head + " (an all-zero row: codes 0)"
    u = v / s
    notes = {
        "exact ties v / s (round half to even)": ((u - u.floor()) == 0.5),
        "v * (1 / s) rounds otherwise (divide)": torch.round(v * (1 / s)) != torch.round(u),
        "v / the float32 s rounds otherwise (use the fp16 s)": torch.round(v / s32)
        != torch.round(u),
    }
    for what, where in notes.items():
        if where.any():
            head += f"; {what} at columns {where.nonzero().flatten().tolist()[:6]}"
    return head
