"""NF4 against the published table and bitsandbytes' encoding rule."""

import torch

from qlab import formats
from qlab.formats.nf4 import NF4_LEVELS, quantile_levels

# bitsandbytes/functional.py, get_4bit_type("nf4"), as published (independent copy).
PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]


def test_levels_are_the_published_table_bit_for_bit():
    assert torch.equal(formats.get("nf4").values, torch.tensor(PUBLISHED, dtype=torch.float32))


def test_quantile_construction_reproduces_the_table():
    err = (quantile_levels().double() - NF4_LEVELS.double()).abs().max().item()
    assert err < 2e-7, err


def test_encode_is_nearest_level_with_ties_to_the_lower_code():
    nf4 = formats.get("nf4")
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    codes = nf4.encode(x).long()
    dist = (x[:, None] - NF4_LEVELS[None, :]).abs()
    nearest = dist.argmin(dim=1)
    # away from midpoints the rule is the nearest level
    assert (codes == nearest).float().mean() > 0.9999
    mids = ((NF4_LEVELS[:-1].double() + NF4_LEVELS[1:].double()) / 2).float()
    assert nf4.encode(mids).tolist() == list(range(15))  # exactly on a midpoint -> lower
    up = torch.nextafter(mids, torch.tensor(2.0))
    assert nf4.encode(up).tolist() == list(range(1, 16))
    assert nf4.encode(torch.tensor([-5.0, 5.0])).tolist() == [0, 15]
