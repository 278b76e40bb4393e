"""The _S/_M/_L mixes: llama.cpp's per-tensor rules (src/llama-quant.cpp), written out by hand."""

from __future__ import annotations

import pytest

import qlab.gguf as G
from qlab.lm import quality


def llama_like(n_layer: int = 32, d: int = 4096, ff: int = 11008) -> dict[str, tuple]:
    """A llama-style tensor list (llama.cpp names, torch shapes (out, in))."""
    shapes = {"token_embd.weight": (32000, d), "output_norm.weight": (d,),
              "output.weight": (32000, d)}  # fmt: skip
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (d,), p + "attn_q.weight": (d, d),
                   p + "attn_k.weight": (d, d), p + "attn_v.weight": (d, d),
                   p + "attn_output.weight": (d, d), p + "ffn_norm.weight": (d,),
                   p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d),
                   p + "ffn_down.weight": (d, ff)}  # fmt: skip
    return shapes


# Q4_K_M's "more bits" layers of a 32-layer model: i < 4, i >= 28, (i - 4) % 3 == 2
MORE_BITS_32 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4_k_m_on_a_llama_layout():
    t = G.recipe_types(llama_like(), "Q4_K_M")
    six = [i for i in range(32) if t[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert six == MORE_BITS_32
    assert [i for i in range(32) if t[f"blk.{i}.attn_v.weight"] == "Q6_K"] == MORE_BITS_32
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q4_K"  # not tied
    assert t["blk.5.attn_q.weight"] == t["blk.5.ffn_up.weight"] == "Q4_K"
    assert t["blk.0.attn_norm.weight"] == "F32"


def test_layer_order_does_not_matter_past_ten_layers():
    """llama.cpp visits tensors sorted by numeric layer (weight_name_comparer), so its V and
    FFN-down counts equal the layer index at any depth; the types must not depend on the
    order of `shapes`, e.g. a string sort that puts blk.10 before blk.2."""
    numeric = llama_like(n_layer=12, d=256, ff=512)
    by_string = dict(sorted(numeric.items()))
    assert list(by_string)[:4] != list(numeric)[:4]  # the two orders do differ
    for recipe in ("Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M"):
        t = G.recipe_types(by_string, recipe)
        assert t == G.recipe_types(numeric, recipe)
    # 12 layers: n/8 = 1, 7n/8 = 10; more bits at 0, 3, 6, 9 (i - 1) % 3 == 2, 10, 11
    t = G.recipe_types(by_string, "Q4_K_M")
    assert [i for i in range(12) if t[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 3, 6, 9, 10, 11]


def test_s_m_l_differ_where_llama_cpp_says():
    s = G.recipe_types(llama_like(), "Q3_K_S")
    m = G.recipe_types(llama_like(), "Q3_K_M")
    lg = G.recipe_types(llama_like(), "Q3_K_L")
    assert s["blk.7.attn_v.weight"] == "Q3_K" and s["blk.7.ffn_down.weight"] == "Q3_K"
    assert [m[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert m["blk.0.ffn_down.weight"] == "Q5_K" and m["blk.2.ffn_down.weight"] == "Q4_K"
    assert m["blk.3.attn_output.weight"] == "Q4_K" and lg["blk.3.attn_output.weight"] == "Q5_K"
    assert lg["blk.9.attn_v.weight"] == lg["blk.9.ffn_down.weight"] == "Q5_K"
    assert s["blk.9.ffn_up.weight"] == m["blk.9.ffn_up.weight"] == lg["blk.9.ffn_up.weight"]
    k4s = G.recipe_types(llama_like(), "Q4_K_S")
    assert [k4s[f"blk.{i}.attn_v.weight"] for i in (3, 4)] == ["Q5_K", "Q4_K"]
    assert [k4s[f"blk.{i}.ffn_down.weight"] for i in (3, 4)] == ["Q5_K", "Q4_K"]


def test_tinylm_tied_head_and_fallbacks():
    """TinyLM: rows of 192 cannot hold a 256 super-block, so llama.cpp's fallbacks apply;
    mlp.fc2 (rows of 768) keeps its K-quant; the tied embedding is the head -> Q8_0."""
    shapes = {k: tuple(v.shape) for k, v in quality.load_model().state_dict().items()}
    t = G.recipe_types(shapes, "Q4_K_M")
    assert t["tok_emb.weight"] == "Q8_0"  # output rule (Q6_K), 192 % 256 -> Q8_0
    assert t["pos_emb.weight"] == "F32" and t["blocks.0.ln1.weight"] == "F32"
    assert [t[f"blocks.{i}.mlp.fc2.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [t[f"blocks.{i}.attn.qkv.weight"] for i in range(4)] == ["Q5_0", "Q5_0", "Q8_0", "Q8_0"]
    assert t["blocks.1.mlp.fc1.weight"] == t["blocks.1.attn.proj.weight"] == "Q5_0"
    for name, ty in t.items():  # every chosen type fits its rows
        assert shapes[name][-1] % G.get_type(ty).block == 0, name


@pytest.mark.parametrize("ty,row,expected", [
    ("Q4_K", 192, "Q5_0"), ("Q5_K", 192, "Q5_1"), ("Q6_K", 192, "Q8_0"), ("Q3_K", 192, "Q4_0"),
    ("Q4_K", 768, "Q4_K"), ("Q4_K", 48, "F16"), ("Q8_0", 48, "F16"), ("Q8_0", 64, "Q8_0"),
])  # fmt: skip
def test_fallback(ty, row, expected):
    assert G.fallback(ty, row) == expected


def test_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe"):
        G.recipe_types({"w.weight": (4, 256)}, "Q4_K_XL")
