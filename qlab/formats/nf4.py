"""NF4 (QLoRA, Dettmers et al. 2023): 16 levels placed at quantiles of a normal distribution.

The float32 levels are bitsandbytes' published table (bitsandbytes/functional.py,
get_4bit_type("nf4")), bit for bit. `quantile_levels()` rebuilds them with bitsandbytes'
construction (functional.py create_normal_map: Phi^-1 at points evenly spaced from an
offset to 0.5, 8 positive levels, 7 negative, an exact zero, normalised to [-1, 1]; the
asymmetric split is the QLoRA paper's, section 3, whose own quantile formula differs);
it matches the table to within 2e-7, not bit for bit, so the table is the reference.

Encoding follows bitsandbytes' kernel (dQuantizeNF4): the normalised value is compared
with the float32 midpoints fp32((l[i] + l[i+1]) / 2) and a value exactly ON a
midpoint takes the LOWER code. This is not always the exactly nearest level; the
alternative (true nearest, ties to even) differs only on those midpoints.
"""

from __future__ import annotations

import torch

from qlab._tensor import as_float32

NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)

# bitsandbytes' offset (create_normal_map's default, the NF4 that QLoRA ships): the
# outermost quantile used, 0.5 * (1/(2*15) + 1/(2*16)) away from 1.
NF4_OFFSET = 0.9677083


def quantile_levels(offset: float = NF4_OFFSET) -> torch.Tensor:
    """Build NF4 from normal quantiles (bitsandbytes create_normal_map; the asymmetric split
    is QLoRA section 3's), in float64 -> float32.

    Positive half: Phi^-1 at 8 points evenly spaced from `offset` down to 0.5 (excluded);
    negative half: 7 points likewise; plus an exact 0. Normalised by the largest.
    """
    ndtri = torch.special.ndtri
    pos = ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return (levels / levels.max()).to(torch.float32)


class NF4Grid:
    name = "nf4"
    bits = 4
    kind = "nf4"
    max = 1.0
    values = NF4_LEVELS
    # fp32 midpoints, as bitsandbytes hard-codes them
    midpoints = ((NF4_LEVELS[:-1].double() + NF4_LEVELS[1:].double()) / 2).to(torch.float32)

    def encode(self, x, saturate: bool = True) -> torch.Tensor:
        """Normalised values in [-1, 1] -> indices 0..15 (x <= midpoint takes the lower code)."""
        x = as_float32(x)
        if bool(torch.isnan(x).any()):
            raise ValueError("nf4 has no NaN code")
        return torch.bucketize(x, self.midpoints, right=False).to(torch.uint8)

    def decode(self, codes) -> torch.Tensor:
        codes = torch.as_tensor(codes)
        if codes.is_floating_point():
            raise TypeError(f"nf4.decode takes integer codes, got {codes.dtype}")
        return NF4_LEVELS[codes.to(torch.int64)]

    def fields(self, code: int) -> dict:
        code = int(code)
        return {"code": code, "bits": format(code, "04b"), "value": float(NF4_LEVELS[code])}


NF4 = NF4Grid()
