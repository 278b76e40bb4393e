import pytest
import torch

import qlab


def test_nibble_order_by_hand():
    # even index -> low nibble, odd index -> high nibble; signed as two's complement
    packed = qlab.pack_int4(torch.tensor([1, -2, 7, -8], dtype=torch.int8))
    assert packed.tolist() == [0xE1, 0x87]
    assert qlab.unpack_int4(packed).tolist() == [1, -2, 7, -8]
    assert qlab.unpack_int4(packed, signed=False).tolist() == [1, 14, 7, 8]


def test_roundtrip_all_pairs_and_shapes():
    a = torch.arange(-8, 8).repeat_interleave(16)
    b = torch.arange(-8, 8).repeat(16)
    codes = torch.stack([a, b], -1).reshape(-1).to(torch.int8)  # every (even, odd) pair
    assert torch.equal(qlab.unpack_int4(qlab.pack_int4(codes)), codes)
    u = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    p = qlab.pack_int4(u)
    assert p.shape == (3, 5, 4) and p.dtype == torch.uint8
    assert torch.equal(qlab.unpack_int4(p, signed=False), u.to(torch.int8))
    qt = qlab.quantize(torch.randn(4, 128), "int4", 32)
    assert torch.equal(qlab.unpack_int4(qlab.pack_int4(qt.codes)), qt.codes)


def test_bad_input():
    with pytest.raises(ValueError, match="even"):
        qlab.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="nibble"):
        qlab.pack_int4(torch.tensor([16, 0]))
    with pytest.raises(TypeError):
        qlab.pack_int4(torch.zeros(4))
    with pytest.raises(TypeError):
        qlab.unpack_int4(torch.zeros(4, dtype=torch.int8))
