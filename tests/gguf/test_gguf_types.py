"""GGUF block formats against llama.cpp's `gguf` package (its numpy (de)quantizers).

Decoding: every type, on random bytes (every bit pattern a file can hold) and on edge
blocks. Encoding: bit-exact bytes for the types gguf also encodes (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1); the K-quants and importance-matrix encoders are checked against llama.cpp's C code in
test_gguf_llamacpp.py.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import qlab
import qlab.gguf as G

QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_ENCODES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
QT = gguf.GGMLQuantizationType


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """float32 arrays equal bit for bit (signed zeros included); NaN matches any NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a) & np.isnan(b)
    return a.shape == b.shape and bool(np.all(nan | (a.view(np.uint32) == b.view(np.uint32))))


def gguf_decode(name: str, raw: np.ndarray, shape) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf * 0 in blocks whose fp16 scale is inf
        return gguf.quants.dequantize(raw, QT[name]).reshape(shape)


def gguf_encode(name: str, x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # fp16 overflow of a scale warns in numpy
        return gguf.quants.quantize(x, QT[name])


def edge_rows(k: int = 512) -> np.ndarray:
    """Rows of k with the cases each rule has a clause for (blocks of 32 and of 256)."""
    g = np.random.default_rng(7)
    x = (g.standard_normal((10, k)) * 0.02).astype(np.float32)
    x[0] = 0.0  # all zeros
    x[1, :] = 0.25  # constant positive
    x[2, :] = -0.75  # constant negative
    x[3, 5] = 7.0  # one outlier (positive)
    x[4, 40] = -9.0  # one outlier (negative: Q4_0's signed max)
    x[5] = g.integers(-16, 17, k) * 0.125  # exact ties
    x[6] = g.standard_normal(k) * 4e6  # Q8_0 scale amax / 127 overflows fp16 -> inf
    x[7] *= 1e-6  # fp16-subnormal scales
    x[8, ::2] = 0.0  # half zeros
    x[9] = np.abs(x[9])  # one-sided
    return x


def random_rows(seed: int, rows: int = 64, k: int = 1024) -> np.ndarray:
    g = np.random.default_rng(seed)
    scale = np.exp(g.uniform(np.log(1e-4), np.log(1e2), (rows, 1)))  # 6 decades of row scale
    return (g.standard_normal((rows, k)) * scale).astype(np.float32)


@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_random_bytes_bit_exact(name):
    t = G.get_type(name)
    g = np.random.default_rng(1)
    raw = g.integers(0, 256, (2000, t.type_size), dtype=np.uint8)
    raw[0] = 0  # all-zero block
    raw[1] = 255  # every bit set (fp16 NaN scale)
    ours = G.from_bytes(name, (2000 * t.block,), raw)
    assert same_bits(ours.dequantize().numpy(), gguf_decode(name, raw, (2000 * t.block,)))


@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_quantized_edges_bit_exact(name):
    x = np.concatenate([edge_rows(), random_rows(2, rows=16, k=512)])
    qt = G.quantize(x, name)
    raw = qt.data.numpy()
    assert raw.shape == (x.shape[0], x.shape[1] // qt.ggml_type.block * qt.ggml_type.type_size)
    assert same_bits(qt.dequantize().numpy(), gguf_decode(name, raw, x.shape))


@pytest.mark.parametrize("name", GGUF_ENCODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encode_bit_exact_with_gguf(name, seed):
    x = np.concatenate([edge_rows(1024), random_rows(seed)])
    ours = G.quantize(x, name).data.numpy()
    ref = gguf_encode(name, x)
    bad = np.nonzero((ours != ref).any(axis=1))[0]
    assert bad.size == 0, f"{name}: rows {bad[:5]} differ"


@pytest.mark.parametrize("scheme,name", [("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("q5_0", "Q5_0")])
def test_qlab_schemes_are_the_gguf_formats(scheme, name):
    """qlab.quantize(x, "q4_0") holds the codes and fp16 scales gguf writes, and qlab's
    generic dequantize (scale * (code - zero point)) is gguf's decoder bit for bit."""
    x = np.concatenate([edge_rows(256), random_rows(3, rows=8, k=256)])
    qt = qlab.quantize(x, scheme)
    fields = G.from_bytes(name, x.shape, gguf_encode(name, x)).fields
    assert torch.equal(qt.codes.reshape(-1, 32), fields["q"])
    assert torch.equal(qt.scales.reshape(-1).view(torch.int16), fields["d"].view(torch.int16))
    assert same_bits(qt.dequantize().numpy(), gguf_decode(name, gguf_encode(name, x), x.shape))
    assert qt.bits_per_element == G.bits_per_weight(name)


def test_rounding_conventions():
    """Q8_0 rounds half away from zero (C roundf); Q4_0 rounds half UP after + 8.5; qlab's
    int8 rounds half to even. x = k + 0.5 steps exactly (scale 1: absmax 127)."""
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([127.0, 2.5, -2.5, 3.5, 0.5, -0.5])
    q8 = qlab.quantize(x, "q8_0").codes[0, :6].tolist()
    assert q8 == [127, 3, -3, 4, 1, -1]  # half away from zero
    assert qlab.quantize(x, "int8", 32).codes[0, :6].tolist() == [127, 2, -2, 4, 0, 0]
    y = torch.zeros(1, 32)
    y[0, :5] = torch.tensor([-8.0, 2.5, -2.5, 0.5, -0.5])  # d = -8 / -8 = 1
    q4 = (qlab.quantize(y, "q4_0").codes[0, :5].to(torch.int32) - 8).tolist()
    assert q4 == [-8, 3, -2, 1, 0]  # floor(v + 0.5): ties toward +inf


def test_q4_0_signed_max_and_nibble_order():
    """The largest |x| decides the sign of d and lands exactly on code 0 (value -8); the
    other sign clamps at +7 steps. Byte j holds element j (low) and j + 16 (high)."""
    x = torch.linspace(-1, 1, 32).reshape(1, 32) * 0.5
    x[0, 3] = -4.0
    qt = G.quantize(x, "Q4_0")
    f = qt.fields
    assert float(f["d"][0]) == pytest.approx(0.5)  # -4 / -8
    assert int(f["q"][0, 3]) == 0 and qt.dequantize()[0, 3] == -4.0
    raw = qt.data[0, 2:]
    q = f["q"][0]
    assert torch.equal(raw, q[:16] | (q[16:] << 4))
    assert not torch.equal(raw, qlab.pack_int4(q))  # uint8 codes 0..15: not qlab's nibble order


def test_qtensor_like_fields():
    x = torch.randn(3, 2, 512)
    for name in ("Q4_0", "Q4_K"):
        t = G.quantize(x, name)
        assert t.codes.shape == x.shape and t.codes.dtype == torch.uint8
        assert t.scales.shape == (3, 2, 512 // t.ggml_type.block)
        assert t.scales.dtype == torch.float16 and t.dequantize().shape == x.shape
    with pytest.raises(ValueError, match="stores values"):
        _ = G.quantize(x, "F16").codes


def test_bits_per_weight_exact():
    expected = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5,
                "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625,
                "F16": 16.0, "F32": 32.0}  # fmt: skip
    for name, bits in expected.items():
        block, size = gguf.GGML_QUANT_SIZES[QT[name]]
        assert G.bits_per_weight(name) == bits == size * 8 / block
        x = torch.randn(2, 512)
        assert G.quantize(x, name).nbytes * 8 / x.numel() == bits


@pytest.mark.parametrize("name", QUANTIZED)
def test_fields_pack_back_to_the_same_bytes(name):
    """pack(unpack(bytes)) == bytes on random bytes: the layouts (6-bit scale packing, high
    bits, nibble order) invert exactly, and every stored bit is read."""
    t = G.get_type(name)
    raw = torch.randint(0, 256, (64, t.type_size), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))  # fmt: skip
    codec = G.kquants if t.kind == "k" else G.legacy
    fields = G.from_bytes(name, (64 * t.block,), raw).fields
    assert torch.equal(codec.pack(name, fields), raw)
    qmax = {"Q3_K": 7, "Q4_K": 15, "Q5_K": 31, "Q6_K": 63, "Q4_0": 15, "Q4_1": 15}
    if name in qmax:
        assert int(fields["q"].max()) == qmax[name]


def test_errors():
    with pytest.raises(ValueError, match="multiple of 256"):
        G.quantize(torch.randn(4, 192), "Q4_K")
    with pytest.raises(ValueError, match="unknown or unsupported"):
        G.quantize(torch.randn(4, 64), "IQ2_XXS")
    with pytest.raises(ValueError, match="NaN"):
        G.quantize(torch.full((1, 32), float("nan")), "Q4_0")
    with pytest.raises(ValueError, match="imatrix"):
        G.quantize(torch.randn(2, 64), "Q4_0", imatrix=torch.ones(32))
    with pytest.raises(ValueError, match="bytes do not hold"):
        G.from_bytes("Q4_0", (2, 32), np.zeros(35, np.uint8))
