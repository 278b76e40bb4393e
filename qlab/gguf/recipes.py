"""Per-tensor GGUF types: llama.cpp's named mixes (Q4_K_M, Q3_K_S, ...), as data.

A name like Q4_K_M is a file type ("ftype"), not a tensor type: it gives each tensor a type
by its role and layer. This follows llama_tensor_get_type in llama.cpp's src/llama-quant.cpp
(read at ggml-org/llama.cpp@0c1e57098, the version llama-cpp-python 0.3.36
vendors) for a dense model with no grouped-query attention and no experts:

  * base type: Q3_K for Q3_K_*, Q4_K for Q4_K_*, Q5_K for Q5_K_*, Q6_K, or a legacy type.
  * output head (or the token embedding when it is tied to the head, as in TinyLM): Q6_K,
    or Q8_0 when the row length is not a multiple of the base type's block (or the base
    is Q8_0). The head decides every next-token distribution: it gets more bits.
  * attention V (TinyLM's fused qkv counts as V): Q3_K_M -> Q5_K for the first 2 layers,
    Q4_K after; Q3_K_L -> Q5_K; Q4_K_S -> Q5_K for the first 4; Q4_K_M / Q5_K_M -> Q6_K on
    "more bits" layers. Values feed every later token directly; V is small in real
    models (grouped-query attention), so the extra bits cost little.
    Version note: a fused attn_qkv counts as V in the llama.cpp vendored by
    llama-cpp-python 0.3.36 (ggml-org/llama.cpp@0c1e57098): category_is_attn_v includes
    ATTENTION_QKV, and its branch comes before the attn_qkv one, which is unreachable.
    Older llama.cpp matched names ("attn_v.weight" only) and gave attn_qkv its own rule:
    Q3_K_M / Q3_K_L -> Q4_K, Q4_K_M -> Q5_K, Q5_K_M -> Q6_K in every layer, Q4_K_S
    unchanged. Under that rule TinyLM's Q4_K_M is not below Q4_K_S in any tensor; for
    separate attn_v tensors the layer-count rules are the same in both versions.
  * FFN down (TinyLM's mlp.fc2): Q3_K_M -> Q5_K in the first n/16 layers, else Q4_K;
    Q3_K_L -> Q5_K; Q4_K_M / Q5_K_M -> Q6_K on "more bits" layers; Q4_K_S -> Q5_K in the
    first n/8. The down projection reads the wide, outlier-heavy MLP activations.
  * attention output: Q3_K_M -> Q4_K, Q3_K_L -> Q5_K.
  * "more bits" layers: i < n/8, or i >= 7n/8, or (i - n/8) % 3 == 2 (the first and last
    eighth and every third in between).
  * not quantized: 1-D tensors (norms, biases), names not ending in "weight", norms, the
    position embedding and BERT's token-type embedding (tensor_allows_quantization: POS_EMBD,
    TOKEN_TYPES). They stay F32.
  * fallback: a K-quant needs rows that are a multiple of 256 elements. Otherwise
    Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (blocks of 32, 0.5 to 2 bits
    per weight more), and F16 when even 32 does not divide the row. TinyLM's rows are 192 wide
    (768 for mlp.fc2), so most of its tensors take a fallback type, as in llama.cpp.

Layers are numbered from the name (blocks.N / blk.N / layer.N). llama.cpp counts the
attention-V and FFN-down tensors as it visits them, in the order of its weights_map, which
weight_name_comparer (src/llama-model-loader.h) sorts by the numeric layer of "blk.N." and
then by name: with one such tensor per layer the count is the layer index at any depth.
(With --keep-split it visits the tensors in file order instead.)
"""

from __future__ import annotations

import re

from qlab.gguf.types import TYPES, get_type

# recipe (llama.cpp's ftype name) -> its base tensor type
RECIPES = {
    "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
    "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0", "F16": "F16", "F32": "F32",
}  # fmt: skip
FALLBACK = {"Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# role -> name fragments, llama.cpp's tensor names and TinyLM's (checked in this order)
_ROLES = [
    ("output", (r"^output\.weight$", r"^lm_head\.weight$")),
    ("token_embd", (r"^token_embd\.weight$", r"^tok_emb\.weight$")),
    ("attn_v", (r"attn_qkv\.weight$", r"attn\.qkv\.weight$", r"attn_v\.weight$")),
    ("attn_output", (r"attn_output\.weight$", r"attn\.proj\.weight$")),
    ("ffn_up", (r"ffn_up", r"mlp\.fc1\.weight$")),
    ("ffn_down", (r"ffn_down", r"mlp\.fc2\.weight$")),
]
_KEEP = re.compile(r"(norm|(^|\.)ln\w*\.weight$|pos_emb|position_embd|^token_types\.)")
_LAYER = re.compile(r"(?:blocks|blk|layers?|h)\.(\d+)\.")


def role(name: str) -> str:
    """llama.cpp's tensor category of a name: output, token_embd, attn_v, attn_output,
    ffn_up, ffn_down or other."""
    for r, patterns in _ROLES:
        if any(re.search(p, name) for p in patterns):
            return r
    return "other"


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp quantizes 2-D+ tensors whose name ends in 'weight', except norms and the
    position embedding."""
    return len(shape) >= 2 and name.endswith("weight") and not _KEEP.search(name)


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _by_role(recipe: str, base: str, r: str, i: int, n: int, tied: bool) -> str:
    """llama_tensor_get_type_impl for the recipes in RECIPES (dense, no GQA, not Falcon)."""
    if r == "output" or (r == "token_embd" and tied):
        return "Q6_K" if base != "Q8_0" else "Q8_0"  # (row check in fallback)
    if r == "attn_v":
        rules = {
            "Q3_K_M": "Q5_K" if i < 2 else "Q4_K",
            "Q3_K_L": "Q5_K",
            "Q4_K_M": "Q6_K" if _more_bits(i, n) else base,
            "Q5_K_M": "Q6_K" if _more_bits(i, n) else base,
            "Q4_K_S": "Q5_K" if i < 4 else base,
        }
        return rules.get(recipe, base)
    if r == "ffn_down":
        rules = {
            "Q3_K_M": "Q5_K" if i < n // 16 else "Q4_K",
            "Q3_K_L": "Q5_K",
            "Q4_K_M": "Q6_K" if _more_bits(i, n) else base,
            "Q5_K_M": "Q6_K" if _more_bits(i, n) else base,
            "Q4_K_S": "Q5_K" if i < n // 8 else base,
        }
        return rules.get(recipe, base)
    if r == "attn_output":
        return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(recipe, base)
    return base


def fallback(ggml_type: str, row: int) -> str:
    """llama.cpp's tensor_type_fallback: the type to use when `row` is not a multiple of the
    type's block (K-quant -> a block-32 type of about the same bits; else F16)."""
    t = get_type(ggml_type)
    if row % t.block == 0:
        return t.name
    alt = FALLBACK.get(t.name, "F16")
    return alt if row % TYPES[alt].block == 0 else "F16"


def recipe_types(shapes: dict[str, tuple[int, ...]], recipe: str) -> dict[str, str]:
    """name -> GGUF type for every tensor, by the named mix (see RECIPES and the module doc).

    shapes: name -> torch shape, in file order. Tensors that llama.cpp does not quantize get
    F32; every type returned fits its tensor's row length. (llama.cpp's rules that depend on
    an importance matrix, grouped-query attention or experts are not modelled.)"""
    base = RECIPES.get(str(recipe).upper())
    if base is None:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)} "
                         "(or pass a dict name -> GGUF type)")  # fmt: skip
    recipe = str(recipe).upper()
    roles = {name: role(name) for name in shapes}
    tied = "output" not in roles.values()
    # llama.cpp's n_attention_wv / n_ffn_down: the quantized V and FFN-down matrices (one per
    # layer), not their biases, which the name patterns "ffn_down" etc. also match
    counts = {r: sum(1 for k, v in roles.items() if v == r and is_quantized(k, tuple(shapes[k])))
              for r in ("attn_v", "ffn_down")}  # fmt: skip
    seen = {"attn_v": 0, "ffn_down": 0}
    out = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        if not is_quantized(name, shape) or base == "F32":
            out[name] = "F32"
            continue
        if base == "F16":
            out[name] = "F16"
            continue
        r = roles[name]
        m = _LAYER.search(name)
        i = int(m.group(1)) if m else seen.get(r, 0)
        if r in seen:
            seen[r] += 1
        t = _by_role(recipe, base, r, i, counts.get(r, 0), tied)
        if r in ("output", "token_embd") and t == "Q6_K" and shape[-1] % TYPES[base].block:
            t = "Q8_0"  # llama.cpp: a head whose rows do not fit the base type's block -> Q8_0
        out[name] = fallback(t, shape[-1])
    return out
