"""Real GGUF files: TinyLM (and any dict of tensors) out and back, bit-exact, and bad files."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch

import qlab.gguf as G
from qlab.lm import quality


@pytest.fixture(scope="module")
def tinylm():
    return quality.load_model()


@pytest.fixture(scope="module")
def windows():
    return quality.validation_windows(n_windows=4, block_size=128)


def test_tinylm_round_trip_bit_exact(tinylm, windows, tmp_path):
    """export -> load gives the same bytes; gguf's own reader and decoder agree with qlab's;
    the loaded model measures exactly what the in-memory quantized model measures."""
    path = tmp_path / "tinylm.gguf"
    written = G.export(tinylm, path, "Q4_K_M")
    loaded = G.load(path)
    assert list(loaded) == list(tinylm.state_dict())
    types = {t.type for t in loaded.values()}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= types  # the mix and its fallbacks
    reader = gguf.GGUFReader(str(path))  # independent of qlab's reader
    for rt in reader.tensors:
        t = loaded[rt.name]
        assert torch.equal(t.data, written[rt.name].data), rt.name
        with np.errstate(all="ignore"):
            ref = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(t.shape)
        assert np.array_equal(t.dequantize().numpy(), ref), rt.name

    in_memory = G.dequantized_model(tinylm, G.quantize_state(tinylm, "Q4_K_M"))
    from_file = G.dequantized_model(tinylm, loaded)
    ref_logits = quality.logits(tinylm, windows)
    a, b = quality.logits(in_memory, windows), quality.logits(from_file, windows)
    assert torch.equal(a, b)
    ca, cb = quality.compare(ref_logits, a, windows), quality.compare(ref_logits, b, windows)
    assert (ca.ppl, ca.kl, ca.flip_rate) == (cb.ppl, cb.kl, cb.flip_rate)
    assert ca.kl > 0  # quantization did change the model


def test_dict_of_tensors_and_explicit_types(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 256, generator=g),
        "b": torch.randn(2, 2, 64, generator=g),
        "norm": torch.randn(7, generator=g),
        "scalar": torch.tensor(1.5),
    }
    types = {"a.weight": "Q6_K", "b": "q5_1", "norm": "F16"}
    path = tmp_path / "d.gguf"
    G.export(tensors, path, types)
    back = G.load(path)
    assert {k: t.type for k, t in back.items()} == {
        "a.weight": "Q6_K", "b": "Q5_1", "norm": "F16", "scalar": "F32"}  # fmt: skip
    assert back["b"].shape == (2, 2, 64)
    assert back["scalar"].shape == (1,) and float(back["scalar"].dequantize()) == 1.5
    assert torch.equal(back["norm"].dequantize(), tensors["norm"].half().float())
    table = {r["name"]: r for r in G.tensor_table(path)}
    assert table["a.weight"]["dims"] == (256, 3)  # GGUF lists the fastest dim first
    assert table["a.weight"]["bits_per_weight"] == 6.5625
    assert G.metadata(path)["qlab.recipe"] == "custom"


def test_bad_files(tmp_path):
    good = tmp_path / "good.gguf"
    G.export({"w": torch.randn(4, 64)}, good, {"w": "Q4_0"})
    data = good.read_bytes()

    wrong_magic = tmp_path / "magic.gguf"
    wrong_magic.write_bytes(b"GGML" + data[4:])
    with pytest.raises(G.GGUFError, match="not a GGUF file"):
        G.load(wrong_magic)

    info = G.tensor_table(good)[0]
    last_data_byte = info["offset"] + info["n_bytes"] - 1  # (the writer pads after it)
    for cut in (last_data_byte, 40, 6):  # inside the tensor data, the tensor table, the header
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(G.GGUFError, match="truncated|corrupt"):
            G.load(truncated)

    # tensor info: name (u64 length + bytes), n_dims u32, dims u64 each, type u32, offset u64
    n_dims_at = data.index(struct.pack("<Q", 1) + b"w") + 8 + 1
    type_at = n_dims_at + 4 + 2 * 8
    assert struct.unpack_from("<I", data, type_at)[0] == gguf.GGMLQuantizationType.Q4_0
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(data[:type_at] + struct.pack("<I", 250) + data[type_at + 4 :])
    with pytest.raises(G.GGUFError, match="type id unknown|could not be read"):
        G.load(unknown)

    unsupported = tmp_path / "iq4.gguf"
    w = gguf.GGUFWriter(str(unsupported), arch="qlab")
    w.add_tensor("w", np.zeros((4, 18), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(G.GGUFError, match="IQ4_NL, which qlab.gguf does not decode"):
        G.load(unsupported)

    with pytest.raises(FileNotFoundError):
        G.load(tmp_path / "missing.gguf")
    with pytest.raises(KeyError, match="not there"):
        G.export({"w": torch.randn(4, 64)}, tmp_path / "x.gguf", {"v": "Q4_0"})
    with pytest.raises(ValueError, match="unknown recipe"):
        G.export({"w": torch.randn(4, 64)}, tmp_path / "x.gguf", "Q4_K_XL")


class _GenericReader(G.file._Reader):
    """qlab's reader with gguf's own array parsing, element by element (it calls itself)."""

    _get_field_parts = gguf.GGUFReader._get_field_parts


def test_arrays_parse_as_gguf_parses_them(tmp_path):
    """qlab's reader parses arrays in one pass (qlab/gguf/file.py _Reader): every field, part,
    index, type and value as gguf's generic code gives them, for arrays of strings and of
    every scalar type, an empty array and an array of arrays; a count past the end of the
    file is a GGUFError."""
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), arch="qlab")
    w.add_array("strings", ["a", "", "héllo", "x" * 300, "[PAD]"])
    w.add_array("int32", [3, -1, 2**31 - 1])
    w.add_array("float32", [0.5, -2.0, float("nan")])
    w.add_array("bools", [True, False, True])
    for vtype in gguf.GGUFReader.gguf_scalar_to_np:  # every other item type too
        w.add_key_value(f"array-{vtype.name}", [0, 1, 1], gguf.GGUFValueType.ARRAY, vtype)
    w.add_array("empty", [7])  # made empty below: gguf's writer drops empty arrays
    w.add_array("nested", [[1, 2], [3]])  # the outer array through gguf's code
    w.add_string("plain", "text")
    w.add_uint32("number", 7)
    w.add_tensor("w", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()  # "empty": an INT32 array of 1 value -> of 0, 4 more bytes of padding
    one = struct.pack("<IIQi", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, 1, 7)
    at, start = data.index(b"empty" + one) + 5, _GenericReader(str(path)).data_offset
    head = data[:at] + one[:8] + bytes(8) + data[at + 20 : start]  # 4 bytes shorter: pad
    path.write_bytes(head + bytes(4) + data[start:])
    ours, theirs = G.read(path), _GenericReader(str(path))
    assert theirs.data_offset == start  # the tensor data where it was
    assert list(ours.fields) == list(theirs.fields)
    for vtype in gguf.GGUFReader.gguf_scalar_to_np:  # each written as that type
        assert theirs.fields[f"array-{vtype.name}"].types == [gguf.GGUFValueType.ARRAY, vtype]
    for key, a in theirs.fields.items():
        b = ours.fields[key]
        assert (b.offset, b.name, b.types, b.data) == (a.offset, a.name, a.types, a.data), key
        assert [(p.dtype, p.shape, p.tobytes()) for p in b.parts] == [
            (p.dtype, p.shape, p.tobytes()) for p in a.parts
        ], key
    values = G.metadata(path)
    assert values["strings"] == ["a", "", "héllo", "x" * 300, "[PAD]"]
    assert values["int32"] == [3, -1, 2**31 - 1] and values["bools"] == [True, False, True]
    assert values["float32"][:2] == [0.5, -2.0] and values["float32"][2] != values["float32"][2]
    assert values["empty"] == [] and values["number"] == 7
    assert torch.equal(G.load(path)["w"].dequantize(), torch.arange(8, dtype=torch.float32))

    data = path.read_bytes()
    for key in ("strings", "int32"):  # a count past the end of the file: an error, at once
        count_at = theirs.fields[key].offset + 8 + len(key) + 4 + 4
        assert struct.unpack_from("<Q", data, count_at)[0] == len(values[key])
        bad = tmp_path / f"count-{key}.gguf"
        bad.write_bytes(data[:count_at] + struct.pack("<Q", 2**40) + data[count_at + 8 :])
        with pytest.raises(G.GGUFError, match="could not be read"):
            G.load(bad)
