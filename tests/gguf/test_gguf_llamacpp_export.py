"""qlab.gguf.export_llamacpp without llama.cpp: names, metadata, vocabulary and recipe types.

The oracles here are llama.cpp's own Python package `gguf` (its TensorNameMap for the `bert`
architecture, its key names and enums, its reader) and MiniLM's tokenizer.json; the rules
for the recipe types are written out by hand from llama_tensor_get_type
(src/llama-quant.cpp of the llama.cpp vendored by llama-cpp-python 0.3.36). That llama.cpp
itself loads the files and writes the same quantized bytes is tested in
test_gguf_llamacpp_runtime.py and test_gguf_llamacpp_quantize.py.
"""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
import torch

import qlab.gguf as G
from qlab.data import minilm_weights_path
from qlab.gguf.llamacpp import llamacpp_name, qlab_name, qlab_names, wordpiece_vocab
from qlab.lm import minilm

N_LAYER = 6
MORE_BITS = {2, 5}  # use_more_bits(i, 6): i < 6/8 = 0, i >= 42/8 = 5, or i % 3 == 2


@pytest.fixture(scope="module")
def model():
    return minilm.load()


@pytest.fixture(scope="module")
def f32_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("llamacpp") / "minilm-F32.gguf"
    return path, G.export_llamacpp(model, path, "F32")


def test_names_are_gguf_s_bert_names(model):
    """Every MiniLM tensor gets the name llama.cpp's TensorNameMap gives the same checkpoint
    tensor for MODEL_ARCH.BERT, and the names invert."""
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, N_LAYER)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.BERT]}
    names = list(model.state_dict())
    assert len(names) == 5 + 16 * N_LAYER
    for name in names:
        ours = llamacpp_name(name)
        theirs = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert ours == theirs, name
        base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", ours.rsplit(".", 1)[0])
        assert base in allowed, ours
        assert qlab_name(ours) == name
        assert llamacpp_name(ours) == ours  # already llama.cpp's: unchanged
    with pytest.raises(KeyError, match="not a tensor of"):
        llamacpp_name("encoder.layer.0.attention.self.rotary.weight")
    with pytest.raises(KeyError, match="no MiniLM tensor"):
        qlab_name("blk.0.ffn_gate.weight")


def test_f32_file_holds_the_model_exactly(model, f32_file):
    path, written = f32_file
    back = G.load(path)
    assert list(back) == list(written) == [llamacpp_name(k) for k in model.state_dict()]
    for name, w in model.state_dict().items():
        t = back[llamacpp_name(name)]
        assert t.type == "F32" and t.shape == tuple(w.shape)
        assert torch.equal(t.dequantize(), w)
    table = {r["name"]: r for r in G.tensor_table(path)}
    assert table["token_embd.weight"]["dims"] == (384, 30522)  # ne: fastest dim first
    assert table["blk.0.ffn_down.weight"]["dims"] == (1536, 384)  # (in, out): ggml_mul_mat's
    copy = G.dequantized_model(model, qlab_names(back))
    ids = torch.tensor([[101, 7592, 2088, 102]])
    assert torch.equal(copy(ids), model(ids))


def test_metadata_is_what_llama_cpp_reads(model, f32_file):
    """The keys src/models/bert.cpp, the generic loader and llama-vocab.cpp read, spelled as
    gguf.Keys spells them (the same strings as src/llama-arch.cpp)."""
    path, _ = f32_file
    meta = G.metadata(path)
    K, cfg = gguf.Keys, model.cfg
    arch = {
        K.General.ARCHITECTURE: "bert",
        K.LLM.BLOCK_COUNT.format(arch="bert"): cfg.n_layer,
        K.LLM.CONTEXT_LENGTH.format(arch="bert"): 512,
        K.LLM.EMBEDDING_LENGTH.format(arch="bert"): 384,
        K.LLM.FEED_FORWARD_LENGTH.format(arch="bert"): 1536,
        K.Attention.HEAD_COUNT.format(arch="bert"): 12,
        K.Attention.CAUSAL.format(arch="bert"): False,
        K.LLM.POOLING_TYPE.format(arch="bert"): int(gguf.PoolingType.MEAN),
        K.General.FILE_TYPE: int(gguf.LlamaFileType.ALL_F32),
        K.General.QUANTIZATION_VERSION: gguf.GGML_QUANT_VERSION,
        K.Tokenizer.MODEL: "bert",
        K.Tokenizer.BOS_ID: 101,  # [CLS]
        K.Tokenizer.SEP_ID: 102,
        K.Tokenizer.UNK_ID: 100,
        K.Tokenizer.PAD_ID: 0,
        K.Tokenizer.MASK_ID: 103,
        "tokenizer.ggml.token_type_count": 2,
        "tokenizer.ggml.normalizer.lowercase": True,
        "tokenizer.ggml.normalizer.strip_accents": True,
    }
    for key, value in arch.items():
        assert meta[key] == value, key
    eps = meta[K.Attention.LAYERNORM_EPS.format(arch="bert")]
    assert eps == pytest.approx(1e-12, rel=1e-7)  # stored as float32
    assert len(meta[K.Tokenizer.LIST]) == len(meta[K.Tokenizer.TOKEN_TYPE]) == 30522


def test_vocabulary_in_llama_cpp_s_wordpiece_spelling():
    spec = json.loads(minilm_weights_path().with_name("tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    texts, types = wordpiece_vocab()
    control = [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]
    assert control == [0, 100, 101, 102, 103]  # [PAD] [UNK] [CLS] [SEP] [MASK]
    assert [texts[i] for i in control] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert set(types) == {gguf.TokenType.CONTROL, gguf.TokenType.NORMAL}
    assert texts[vocab["the"]] == "\u2581the" and texts[vocab["##ing"]] == "ing"
    assert texts[vocab["[unused0]"]] == "\u2581[unused0]"  # not special in tokenizer.json
    # a word-start piece and a continuation never collide after the spelling change
    assert len(set(texts)) == len(texts)


def _expected(recipe: str, name: str) -> str:
    """llama_tensor_get_type for MiniLM, by hand: 6 layers, no output.weight (the token
    embedding counts as the tied head), rows of 384 except ffn_down's 1536."""
    if not name.endswith("weight") or "norm" in name or name.split(".")[0] in (
        "position_embd", "token_types"):  # fmt: skip
        return "F32"
    if recipe in ("F32", "F16"):
        return recipe
    i = int(name.split(".")[1]) if name.startswith("blk.") else -1
    role = name.split(".")[-2]
    base = G.RECIPES[recipe]
    if role == "token_embd":  # head rule: Q6_K (or Q8_0); 384 % 256 != 0 -> Q8_0 either way
        return "Q8_0"
    fallback_384 = {"Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
    t = base
    if role == "attn_v":
        t = {"Q3_K_M": "Q5_K" if i < 2 else "Q4_K", "Q3_K_L": "Q5_K",
             "Q4_K_S": "Q5_K" if i < 4 else base,
             "Q4_K_M": "Q6_K" if i in MORE_BITS else base,
             "Q5_K_M": "Q6_K" if i in MORE_BITS else base}.get(recipe, base)  # fmt: skip
    elif role == "ffn_down":  # n/16 = n/8 = 0 layers get the "first layers" rules
        t = {"Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K",
             "Q4_K_M": "Q6_K" if i in MORE_BITS else base,
             "Q5_K_M": "Q6_K" if i in MORE_BITS else base}.get(recipe, base)  # fmt: skip
        return t  # 1536 = 6 * 256: every K-quant fits
    elif role == "attn_output":
        t = {"Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(recipe, base)
    return fallback_384.get(t, t)


@pytest.mark.parametrize("recipe", sorted(G.RECIPES))
def test_recipe_types_follow_llama_cpp_on_minilm(model, recipe):
    shapes = {llamacpp_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    got = G.recipe_types(shapes, recipe)
    assert got == {k: _expected(recipe, k) for k in shapes}


def test_q4_k_m_file_types_and_fallbacks(model, tmp_path):
    """The chapter's recipe: which MiniLM tensors keep a K-quant, which fall back."""
    path = tmp_path / "minilm-Q4_K_M.gguf"
    written = G.export_llamacpp(model, path, "Q4_K_M")
    types = {k: t.type for k, t in G.load(path).items()}
    assert types == {k: t.type for k, t in written.items()}
    assert types["token_embd.weight"] == "Q8_0"
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(6)] == ["Q4_K"] * 2 + ["Q6_K"] + [
        "Q4_K"] * 2 + ["Q6_K"]  # fmt: skip
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(6)] == ["Q5_0"] * 2 + ["Q8_0"] + [
        "Q5_0"] * 2 + ["Q8_0"]  # fmt: skip
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == "Q5_0"
    assert types["position_embd.weight"] == types["token_types.weight"] == "F32"
    meta = G.metadata(path)
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert meta["qlab.recipe"] == "Q4_K_M"


def test_dict_types_and_imatrix_take_either_spelling(model, tmp_path):
    w = "encoder.layer.0.output.dense.weight"
    a = G.export_llamacpp(model, tmp_path / "a.gguf", {w: "Q4_K"})
    b = G.export_llamacpp(model, tmp_path / "b.gguf", {"blk.0.ffn_down.weight": "Q4_K"})
    assert a["blk.0.ffn_down.weight"].type == "Q4_K"
    assert torch.equal(a["blk.0.ffn_down.weight"].data, b["blk.0.ffn_down.weight"].data)
    assert all(t.type == "F32" for k, t in a.items() if k != "blk.0.ffn_down.weight")
    assert "general.file_type" not in G.metadata(tmp_path / "a.gguf")
    im = torch.from_numpy(np.random.default_rng(0).random(1536, dtype=np.float32))
    c = G.export_llamacpp(model, tmp_path / "c.gguf", {w: "Q4_K"}, imatrix={w: im})
    assert not torch.equal(c["blk.0.ffn_down.weight"].data, a["blk.0.ffn_down.weight"].data)
    direct = G.quantize(model.state_dict()[w], "Q4_K", im)
    assert torch.equal(c["blk.0.ffn_down.weight"].data, direct.data)


def test_only_minilm(tmp_path):
    with pytest.raises(TypeError, match="MiniLM"):
        G.export_llamacpp(torch.nn.Linear(4, 4), tmp_path / "x.gguf")
