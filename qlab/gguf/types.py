"""The GGUF tensor types qlab reads and writes, one row each, and GGUFTensor.

A GGUF tensor is stored row by row (a row = the last torch axis, GGUF's ne[0]); each row is
cut into blocks of `block` elements and each block is `type_size` bytes. So a type's bits
per weight is exactly type_size * 8 / block (scales and mins included), and a row length
must be a multiple of the block (llama.cpp falls back to another type when it is not; see
qlab/gguf/recipes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qlab._tensor import as_float32, check_finite, torch_threads
from qlab.gguf import kquants, legacy


@dataclass(frozen=True)
class GGMLType:
    name: str  # as llama.cpp spells it: "Q4_K"
    type_id: int  # ggml_type / gguf.GGMLQuantizationType value
    block: int  # elements per block
    type_size: int  # bytes per block
    kind: str  # "float" | "legacy" | "k"

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block


TYPES: dict[str, GGMLType] = {
    t.name: t
    for t in [
        GGMLType(name="F32", type_id=0, block=1, type_size=4, kind="float"),
        GGMLType(name="F16", type_id=1, block=1, type_size=2, kind="float"),
        GGMLType(name="Q4_0", type_id=2, block=32, type_size=18, kind="legacy"),  # 4.5
        GGMLType(name="Q4_1", type_id=3, block=32, type_size=20, kind="legacy"),  # 5.0
        GGMLType(name="Q5_0", type_id=6, block=32, type_size=22, kind="legacy"),  # 5.5
        GGMLType(name="Q5_1", type_id=7, block=32, type_size=24, kind="legacy"),  # 6.0
        GGMLType(name="Q8_0", type_id=8, block=32, type_size=34, kind="legacy"),  # 8.5
        GGMLType(name="Q3_K", type_id=11, block=256, type_size=110, kind="k"),  # 3.4375
        GGMLType(name="Q4_K", type_id=12, block=256, type_size=144, kind="k"),  # 4.5
        GGMLType(name="Q5_K", type_id=13, block=256, type_size=176, kind="k"),  # 5.5
        GGMLType(name="Q6_K", type_id=14, block=256, type_size=210, kind="k"),  # 6.5625
    ]
}
TYPE_NAMES = tuple(TYPES)
_CODEC = {"legacy": legacy, "k": kquants}


def get_type(name: str) -> GGMLType:
    """The GGMLType called `name` (llama.cpp's spelling, e.g. "Q4_K"; case-insensitive)."""
    t = TYPES.get(str(name).upper())
    if t is None:
        raise ValueError(f"unknown or unsupported GGUF type {name!r}; qlab.gguf supports "
                         f"{', '.join(TYPE_NAMES)}")  # fmt: skip
    return t


def bits_per_weight(name: str) -> float:
    """Exact storage bits per weight of a GGUF type (Q4_0 4.5, Q8_0 8.5, Q4_K 4.5, ...)."""
    return get_type(name).bits_per_weight


@dataclass
class GGUFTensor:
    """One tensor as a GGUF file stores it (QTensor-like: .codes, .dequantize()).

    type:  GGUF type name ("Q4_K", ...)
    shape: the torch shape (GGUF lists the same dims in reverse, fastest first)
    data:  uint8 (rows, row_bytes): the tensor's bytes exactly as in the file, rows = all
           leading dims flattened, row_bytes = shape[-1] / block * type_size
    """

    type: str
    shape: tuple[int, ...]
    data: torch.Tensor

    @property
    def ggml_type(self) -> GGMLType:
        return get_type(self.type)

    @property
    def bits_per_element(self) -> float:
        return self.ggml_type.bits_per_weight

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @property
    def fields(self) -> dict[str, torch.Tensor]:
        """The stored fields of every block, unpacked: d (and m / dmin) fp16 (n_blocks,),
        sc / m sub-block scales (n_blocks, 8 or 16), q codes (n_blocks, block) as stored."""
        t = self.ggml_type
        if t.kind == "float":
            return {"values": self.dequantize().reshape(-1, 1)}
        blocks = self.data.reshape(-1, t.type_size)
        return _CODEC[t.kind].unpack(t.name, blocks)

    @property
    def scales(self) -> torch.Tensor:
        """The float16 block (super-block, for K-quants) scale d, shape[:-1] + (blocks per
        row,). Sub-block scales and mins are in .fields."""
        if self.ggml_type.kind == "float":
            raise ValueError(f"{self.type} has no scales; use .dequantize()")
        return self.fields["d"].reshape(*self.shape[:-1], -1)

    @property
    def codes(self) -> torch.Tensor:
        """The stored integer codes in x's shape (uint8; int8 for Q8_0)."""
        if self.ggml_type.kind == "float":
            raise ValueError(f"{self.type} stores values, not codes; use .dequantize()")
        return self.fields["q"].reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 in `shape`, bit-exact with gguf.quants.dequantize (llama.cpp's decoders)."""
        t = self.ggml_type
        if t.kind == "float":
            dtype = torch.float32 if t.name == "F32" else torch.float16
            return self.data.contiguous().view(dtype).to(torch.float32).reshape(self.shape)
        fields = _CODEC[t.kind].unpack(t.name, self.data.reshape(-1, t.type_size))
        return _CODEC[t.kind].dequantize(t.name, fields).reshape(self.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


def quantize(x, ggml_type: str, imatrix=None) -> GGUFTensor:
    """Quantize x (torch or numpy, computed in float32) to a GGUF type, as llama.cpp does.

    The last axis is GGUF's row; its length must be a multiple of the type's block (32, or
    256 for the K-quants). imatrix: optional (x.shape[-1],) importance of each column (mean
    squared input activation, as llama-imatrix collects it); it changes the rounding of
    every type but F32/F16/Q8_0, as in llama.cpp.

    Contract: NaN/inf are refused; every finite input gives the bytes llama.cpp's C
    quantizer writes (tests/gguf/test_gguf_llamacpp.py fuzzes this), edge cases included.
    So, as in llama.cpp, a block whose scale overflows fp16 (amax above ~65504 times the
    largest code: ~8.3e6 for Q8_0, ~5e5 for Q4_0) stores an inf scale and decodes to
    inf/NaN, and a K-quant super-block whose float32 sums overflow can store a NaN scale;
    check .dequantize() when weights that large are possible. A K-quant sub-block whose
    search alone overflows gets sub-scale 0 (llama.cpp skips NaN sub-scales), and a block
    too small for 1 / d (amax < ~3.7e-37) gets codes 0 (qlab/gguf/legacy.py)."""
    t = get_type(ggml_type)
    x = as_float32(x)
    rows = _rows(x)
    if rows.shape[-1] % t.block:
        raise ValueError(
            f"{t.name} needs rows whose length is a multiple of {t.block}; the last dimension "
            f"of shape {tuple(x.shape)} is {rows.shape[-1]}. Pick a type with a smaller block "
            "(a K-quant's fallback: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q3_K -> Q4_0)"
        )
    if t.kind == "float":
        dtype = torch.float32 if t.name == "F32" else torch.float16
        data = rows.to(dtype).contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
        return GGUFTensor(t.name, tuple(x.shape), data)
    check_finite(x, t.name)
    im = None
    if imatrix is not None:
        im = as_float32(imatrix, "imatrix").reshape(-1)
        if im.numel() != rows.shape[1] or not bool(torch.isfinite(im).all()):
            raise ValueError(
                f"imatrix must hold one finite value per column ({rows.shape[1]}), got "
                f"shape {tuple(im.shape)}"
            )
    codec = _CODEC[t.kind]
    with torch_threads(1):  # C-like loops of small ops: one thread is faster
        blocks = codec.pack(t.name, codec.quantize(t.name, rows, im))
    return GGUFTensor(t.name, tuple(x.shape), blocks.reshape(rows.shape[0], -1))


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """float32 in t.shape (same as t.dequantize())."""
    return t.dequantize()


def from_bytes(ggml_type: str, shape, data) -> GGUFTensor:
    """A GGUFTensor from raw bytes (numpy or torch uint8, any shape with the right size)."""
    t = get_type(ggml_type)
    shape = tuple(int(s) for s in shape)
    raw = torch.as_tensor(np.ascontiguousarray(data)).reshape(-1).to(torch.uint8)
    n = int(np.prod(shape)) if shape else 1
    row = shape[-1] if shape else 1
    if row % t.block or raw.numel() != n // t.block * t.type_size:
        raise ValueError(
            f"{raw.numel()} bytes do not hold a {t.name} tensor of shape {shape} "
            f"({n // t.block * t.type_size} bytes expected, rows a multiple of {t.block})"
        )
    return GGUFTensor(t.name, shape, raw.reshape(max(n // row, 1), -1))
