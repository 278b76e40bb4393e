"""Write and read real GGUF files with llama.cpp's own `gguf` package (GGUFWriter/Reader).

A GGUF file: the magic b"GGUF", a version, key-value metadata (general.architecture, ...),
a table of tensors (name, dims fastest-first, ggml type, offset), then the tensor bytes,
each aligned to 32 bytes. qlab quantizes the tensors itself (qlab.gguf.quantize) and hands
the bytes to gguf.GGUFWriter, so the file holds exactly the blocks llama.cpp would write.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Mapping

import gguf
import numpy as np
import torch

from qlab.gguf.recipes import recipe_types
from qlab.gguf.types import TYPES, GGUFTensor, from_bytes, get_type, quantize

ARCH = "qlab"  # general.architecture: not a llama.cpp architecture (TinyLM is not one)


class GGUFError(ValueError):
    """A file that is not a readable GGUF file, or a tensor qlab cannot decode."""


def _state(tensors) -> dict[str, torch.Tensor]:
    if isinstance(tensors, torch.nn.Module):
        return dict(tensors.state_dict())
    if not isinstance(tensors, Mapping):
        raise TypeError(f"export takes a dict name -> tensor or an nn.Module, got "
                        f"{type(tensors).__name__}")  # fmt: skip
    return {str(k): torch.as_tensor(v) for k, v in tensors.items()}


def resolve_types(tensors, types: str | Mapping[str, str]) -> dict[str, str]:
    """name -> GGUF type: from a recipe name (qlab.gguf.RECIPES) or a dict (names it does
    not list are stored F32)."""
    state = _state(tensors)
    if isinstance(types, str):
        return recipe_types({k: tuple(v.shape) for k, v in state.items()}, types)
    unknown = sorted(set(types) - set(state))
    if unknown:
        raise KeyError(f"types names tensors that are not there: {unknown[:5]}")
    return {k: get_type(types.get(k, "F32")).name for k in state}


def quantize_state(
    tensors, types: str | Mapping[str, str] = "Q8_0",
    imatrix: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, GGUFTensor]:  # fmt: skip
    """name -> GGUFTensor for a dict of tensors or an nn.Module's state_dict, types from a
    recipe name or a dict: exactly the blocks export writes, without the file. A 0-d tensor
    is stored with shape (1,) (GGUF has no 0-d tensors)."""
    state = _state(tensors)
    chosen = resolve_types(state, types)
    imatrix = dict(imatrix or {})
    out = {}
    for key, x in state.items():
        x = x.detach().to(torch.float32)
        out[key] = quantize(x if x.ndim else x.reshape(1), chosen[key], imatrix.get(key))
    return out


def export(
    tensors, path: str | os.PathLike, types: str | Mapping[str, str] = "Q8_0",
    imatrix: Mapping[str, torch.Tensor] | None = None, name: str = "qlab",
) -> dict[str, GGUFTensor]:  # fmt: skip
    """Write `tensors` (dict name -> tensor, or an nn.Module's state_dict) to a GGUF file.

    types: a recipe name ("Q4_K_M", "Q8_0", ...; see qlab.gguf.RECIPES) or a dict name ->
    GGUF type. imatrix: optional name -> (in_features,) importance (qlab.gguf.importance)
    for llama.cpp's data-aware rounding. Returns what was written, name -> GGUFTensor.
    The recipe name is stored under the key qlab.recipe."""
    written = quantize_state(tensors, types, imatrix)

    def header(writer: gguf.GGUFWriter) -> None:
        writer.add_name(name)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_string("qlab.recipe", types if isinstance(types, str) else "custom")

    write(path, written, ARCH, header)
    return written


def write(
    path: str | os.PathLike, tensors: Mapping[str, GGUFTensor], arch: str,
    header: Callable[[gguf.GGUFWriter], None],
) -> None:  # fmt: skip
    """Write already-quantized tensors (name -> GGUFTensor, in file order) to a GGUF file
    with general.architecture = arch; header(writer) adds the other metadata."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    try:
        header(writer)
        for key, t in tensors.items():
            _add(writer, key, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add(writer: gguf.GGUFWriter, key: str, t: GGUFTensor) -> None:
    raw = t.data.numpy()
    if t.type == "F32":
        writer.add_tensor(key, raw.view(np.float32).reshape(t.shape))
    elif t.type == "F16":
        writer.add_tensor(key, raw.view(np.float16).reshape(t.shape))
    else:  # the writer takes quantized rows as uint8 (..., row_bytes) plus the type
        rows = raw.reshape(*t.shape[:-1], -1)
        writer.add_tensor(key, rows, raw_dtype=gguf.GGMLQuantizationType(t.ggml_type.type_id))


def _check_magic(path: Path) -> int:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise GGUFError(
            f"{path} is not a GGUF file: it starts with {head!r}, not b'GGUF' "
            "(a GGUF file begins with those four bytes; is it a safetensors/.pt file?)"
        )
    return size


class _Reader(gguf.GGUFReader):
    """gguf.GGUFReader with two shortcuts, the same fields: it parses a plain ndarray view of
    its memory map (the same bytes, still mapped, read-only), and arrays in one pass
    (_get_field_parts). gguf's own code takes several numpy slices and views per value of
    an array, and each one over an np.memmap also pays numpy's memmap bookkeeping
    (memmap.__array_finalize__). Measured on MiniLM's llama.cpp file (Q8_0, 30522 tokens),
    CPU seconds to parse it on one 2.0 GHz Xeon core: gguf.GGUFReader 1.8-2.1, over the
    view 0.6-0.7, with the one-pass arrays 0.1. tests/gguf/test_gguf_file.py compares every
    field with gguf's own parsing, on arrays of strings and of every scalar type."""

    @property
    def data(self) -> np.ndarray:
        return self._bytes

    @data.setter
    def data(self, mapped: np.ndarray) -> None:  # GGUFReader.__init__ sets np.memmap(path)
        self._bytes = mapped.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """An array of strings or of scalars (numbers, bools) in one pass, with the parts,
        indices and types gguf's own code gives (it calls itself once per value). Other
        values, unknown item types and byte-swapped files go to gguf's own code; so does an
        array of arrays, whose code calls back here for each inner array."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        try:
            itype = gguf.GGUFValueType(int(raw_itype[0]))
        except ValueError:
            return super()._get_field_parts(orig_offs, raw_type)
        n, offs = int(alen[0]), orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == gguf.GGUFValueType.STRING:
            raw = memoryview(self._bytes)
            for _ in range(n):  # each: its uint64 length, then its bytes
                size = int.from_bytes(raw[offs : offs + 8], sys.byteorder)
                if offs + 8 + size > len(raw):  # (a wrong count would loop on past the end)
                    raise IndexError(f"a string of {size} bytes past the end of the file")
                parts += [self._bytes[offs : offs + 8].view(np.uint64),
                          self._bytes[offs + 8 : offs + 8 + size]]  # fmt: skip
                offs += 8 + size
            idxs = list(range(3, len(parts), 2))
        elif itype in self.gguf_scalar_to_np:
            # a count past the end of the file: fewer values, and _get's view or this
            # reshape raises (read() makes it a GGUFError)
            values = self._get(offs, self.gguf_scalar_to_np[itype], n)
            parts += list(values.reshape(n, 1))
            offs += int(values.nbytes)
            idxs = list(range(2, len(parts)))
        else:
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, idxs, [gguf.GGUFValueType.ARRAY] + [itype] * (n > 0)


def read(path: str | os.PathLike | gguf.GGUFReader) -> gguf.GGUFReader:
    """gguf.GGUFReader on path, with the reader's failures turned into clear GGUFErrors.
    A reader is returned as it is, so that load(r), metadata(r) and tensor_table(r) with
    r = read(path) parse the file once."""
    if isinstance(path, gguf.GGUFReader):
        return path
    path = Path(path)
    size = _check_magic(path)
    try:
        reader = _Reader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as err:
        raise GGUFError(
            f"{path} ({size} bytes) could not be read as GGUF: {err}. The header or tensor "
            "table is truncated or corrupt, or a tensor has a type id unknown to gguf "
            f"{getattr(gguf, '__version__', '')}; re-export the file"
        ) from err
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise GGUFError(
                f"{path} is truncated: tensor {t.name!r} needs bytes up to {end}, the file "
                f"has {size}; re-export or re-download it"
            )
    return reader


def load(path: str | os.PathLike | gguf.GGUFReader) -> dict[str, GGUFTensor]:
    """Read a GGUF file into name -> GGUFTensor (QTensor-like: .dequantize(), .codes,
    .bits_per_element), in file order. The bytes are copied out of the file."""
    reader = read(path)
    out = {}
    for t in reader.tensors:
        type_name = gguf.GGMLQuantizationType(t.tensor_type).name
        if type_name not in TYPES:
            raise GGUFError(
                f"tensor {t.name!r} has GGUF type {type_name}, which qlab.gguf does not "
                f"decode (it reads {', '.join(TYPES)})"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF dims: fastest first
        raw = np.array(t.data, copy=True).view(np.uint8)
        out[t.name] = from_bytes(type_name, shape, raw)
    return out


def metadata(path: str | os.PathLike | gguf.GGUFReader) -> dict[str, object]:
    """The key-value header of a GGUF file as plain Python values (strings, numbers, lists)."""
    reader = read(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensor_table(path: str | os.PathLike | gguf.GGUFReader) -> list[dict]:
    """One row per tensor as the file lists it: name, type, GGUF dims (fastest first),
    elements, bytes, offset of its data in the file, and bits per weight."""
    reader = read(path)
    return [
        {
            "name": t.name, "type": gguf.GGMLQuantizationType(t.tensor_type).name,
            "dims": tuple(int(d) for d in t.shape.tolist()), "n_elements": int(t.n_elements),
            "n_bytes": int(t.n_bytes), "offset": int(t.data_offset),
            "bits_per_weight": 8 * int(t.n_bytes) / int(t.n_elements),
        }  # fmt: skip
        for t in reader.tensors
    ]
