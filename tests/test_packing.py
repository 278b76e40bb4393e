import pytest
import torch

import qlab


def test_nibble_order_by_hand():
    # even index -> low nibble, odd index -> high nibble; signed as two's complement
    packed = qlab.pack_int4(torch.tensor([1, -2, 7, -8], dtype=torch.int8))
    assert packed.tolist() == [0xE1, 0x87]
    assert qlab.unpack_int4(packed).tolist() == [1, -2, 7, -8]
    assert qlab.unpack_int4(packed, signed=False).tolist() == [1, 14, 7, 8]
    assert qlab.pack_int4(torch.tensor([9, 15], dtype=torch.uint8)).tolist() == [0xF9]


def test_roundtrip_all_pairs_and_shapes():
    a = torch.arange(-8, 8).repeat_interleave(16)
    b = torch.arange(-8, 8).repeat(16)
    codes = torch.stack([a, b], -1).reshape(-1).to(torch.int8)  # every (even, odd) pair
    assert torch.equal(qlab.unpack_int4(qlab.pack_int4(codes)), codes)
    assert torch.equal(qlab.unpack_int4(qlab.pack_int4(codes, signed=True)), codes)
    u = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    p = qlab.pack_int4(u)
    assert p.shape == (3, 5, 4) and p.dtype == torch.uint8
    assert torch.equal(qlab.unpack_int4(p, signed=False), u.to(torch.int8))
    assert torch.equal(qlab.pack_int4(u, signed=False), p)
    qt = qlab.quantize(torch.randn(4, 128), "int4", 32)
    assert torch.equal(qlab.unpack_int4(qlab.pack_int4(qt.codes)), qt.codes)
    nf = qlab.quantize(torch.randn(4, 128), "nf4")  # unsigned level indices 0..15
    assert torch.equal(qlab.unpack_int4(qlab.pack_int4(nf.codes), signed=False),
                       nf.codes.to(torch.int8))


def test_every_accepted_code_unpacks_to_itself():
    # whatever pack_int4 accepts must come back unchanged: that is why it refuses the rest
    for signed, (lo, hi) in ((True, (-8, 7)), (False, (0, 15))):
        for v in range(-20, 21):
            codes = torch.tensor([v, 0], dtype=torch.int16)
            if lo <= v <= hi:
                back = qlab.unpack_int4(qlab.pack_int4(codes, signed=signed), signed=signed)
                assert back.tolist() == [v, 0]
            else:
                with pytest.raises(ValueError, match=f"{lo}..{hi}"):
                    qlab.pack_int4(codes, signed=signed)


def test_codes_a_nibble_cannot_hold_are_refused():
    # int8 9 used to become nibble 9, which unpacks (signed, the default) as -7
    with pytest.raises(ValueError, match=r"code 9 at index \(1,\) is outside -8..7"):
        qlab.pack_int4(torch.tensor([0, 9], dtype=torch.int8))  # signed dtype: int4
    with pytest.raises(ValueError, match=r"outside -8..7.*signed=False"):
        qlab.pack_int4(torch.tensor([9, 0]))  # int64 is a signed dtype too
    with pytest.raises(ValueError, match="outside 0..15"):
        qlab.pack_int4(torch.tensor([16, 0], dtype=torch.uint8))  # unsigned dtype: uint4
    with pytest.raises(ValueError, match="outside -8..7"):
        qlab.pack_int4(torch.tensor([-9, 0]))
    assert qlab.pack_int4(torch.tensor([9, 0]), signed=False).tolist() == [9]
    with pytest.raises(ValueError, match="outside 0..15"):
        qlab.pack_int4(torch.tensor([3, -1]), signed=False)
    # the error points at the first bad element of a multi-dimensional tensor
    codes = torch.zeros(2, 4, dtype=torch.int8)
    codes[1, 2] = 8
    with pytest.raises(ValueError, match=r"code 8 at index \(1, 2\)"):
        qlab.pack_int4(codes, signed=True)


def test_bad_input():
    with pytest.raises(ValueError, match="even"):
        qlab.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(TypeError):
        qlab.pack_int4(torch.zeros(4))
    with pytest.raises(TypeError):
        qlab.unpack_int4(torch.zeros(4, dtype=torch.int8))
    assert qlab.pack_int4(torch.zeros(2, 0, dtype=torch.int8)).shape == (2, 0)
