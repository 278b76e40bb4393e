"""TinyLM as llama.cpp's `gpt2` (qlab.gguf.export_llamacpp): the file, and llama.cpp running it.

The first tests need no llama.cpp: names, zero biases, metadata, and that the recipe gives
the same tensors, byte for byte, as qlab.gguf's own (chapter 15's) Q4_K_M. The others load
the files in llama.cpp (llama-cpp-python 0.3.36, `make llamacpp`; skipped without it, made
mandatory by QLAB_LLAMACPP=require) and compare its logits with qlab's TinyLM forward on the
same weights as the file stores them (qlab.gguf.dequantized_model), on chapter 15's 16
validation windows of 256 bytes.

What may differ, and the bounds asserted:
  * F32/F16 files: ggml-cpu's GELU is the tanh approximation looked up in a float16 table
    (ggml_vec_gelu_f32 under GGML_GELU_FP16), TinyLM's is erf's; the KV cache is float16
    by default, and an F16 file's matmuls round their inputs to float16 (vec_dot_type F16).
    Measured (1 thread) largest |logit difference| over the 16 x 256 positions, logits of
    magnitude up to about 20: F32 0.063, F16 0.051 (mean 0.0053 both); bound 0.1. Per-byte
    perplexity 4.36004 (qlab) against 4.35994 (F32) and 4.35996 (F16): bound 1e-3 relative.
  * test_gelu_explains_the_gap: with a float32 KV cache and no flash attention, qlab's
    forward with ggml's GELU (emulated here) is 60 times closer to llama.cpp's than with
    erf's (mean |difference| 8.8e-5 against 5.4e-3 on two windows, measured; bound 20 times).
  * the chapter's Q4_K_M: ggml-cpu also quantizes the activations of every quantized matmul
    (to Q8_0 or Q8_K blocks). Measured per-byte perplexity: qlab 4.3674, llama.cpp 4.3689
    (float32 model 4.3600): 0.03 % apart, a fifth of Q4_K_M's own change; bound 0.2 %.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

import qlab.gguf as G
from qlab.gguf.llamacpp import LlamaCppLM, byte_vocab, tinylm_llamacpp_name, tinylm_names
from qlab.lm import quality as Q

ZERO_BIASES = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
LOGIT_BOUND = {"F32": 0.1, "F16": 0.1}


@pytest.fixture(scope="module")
def model():
    return Q.load_model()


@pytest.fixture(scope="module")
def windows():
    return Q.validation_windows(16, 256)  # chapter 15's


@pytest.fixture(scope="module")
def files(llamacpp_export):
    """types -> (path, written): G.export_llamacpp(model, path, types) (tests/gguf/conftest.py)."""
    return {types: llamacpp_export("tinylm", types) for types in ("F32", "F16", "Q4_K_M")}


def test_names_biases_and_inverse(model, files):
    path, written = files["F32"]
    n = model.cfg.n_layer
    assert len(written) == len(model.state_dict()) + 4 * n  # + one zero bias per linear
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GPT2]}
    for name in written:  # every name one of gguf's for MODEL_ARCH.GPT2
        base = name.rsplit(".", 1)[0]
        if base.startswith("blk."):
            base = "blk.{bid}." + base.split(".", 2)[2]
        assert base in allowed, name
    for i in range(n):
        for role in ZERO_BIASES:
            b = written[f"blk.{i}.{role}.bias"]
            assert b.type == "F32" and not torch.count_nonzero(b.dequantize())
            assert b.shape[0] == written[f"blk.{i}.{role}.weight"].shape[0]
    assert "output.weight" not in written  # tied head: llama.cpp duplicates token_embd
    back = tinylm_names(G.load(path))
    assert list(back) == list(model.state_dict())
    for k, w in model.state_dict().items():
        assert torch.equal(back[k].dequantize().reshape(w.shape), w)
        assert tinylm_llamacpp_name(tinylm_llamacpp_name(k)) == tinylm_llamacpp_name(k)
    ids = Q.validation_windows(2, 64)[:, :-1]
    assert torch.equal(G.dequantized_model(model, back)(ids), model(ids))
    bad = dict(written)
    bad["blk.0.ffn_up.bias"] = G.quantize(torch.ones(768), "F32")
    with pytest.raises(ValueError, match="not zero"):
        tinylm_names(bad)


def test_metadata_is_what_llama_cpp_reads(model, files):
    meta = G.metadata(files["F32"][0])
    K, cfg = gguf.Keys, model.cfg
    expected = {
        K.General.ARCHITECTURE: "gpt2",
        K.LLM.BLOCK_COUNT.format(arch="gpt2"): cfg.n_layer,
        K.LLM.CONTEXT_LENGTH.format(arch="gpt2"): cfg.block_size,
        K.LLM.EMBEDDING_LENGTH.format(arch="gpt2"): cfg.d_model,
        K.LLM.FEED_FORWARD_LENGTH.format(arch="gpt2"): 4 * cfg.d_model,
        K.Attention.HEAD_COUNT.format(arch="gpt2"): cfg.n_head,
        K.General.FILE_TYPE: int(gguf.LlamaFileType.ALL_F32),
        K.Tokenizer.MODEL: "gpt2",
        K.Tokenizer.PRE: "gpt-2",
        K.Tokenizer.ADD_BOS: False,
    }
    for key, value in expected.items():
        assert meta[key] == value, key
    eps = meta[K.Attention.LAYERNORM_EPS.format(arch="gpt2")]
    assert eps == pytest.approx(model.ln_f.eps, rel=1e-7)
    vocab = meta[K.Tokenizer.LIST]
    assert vocab == byte_vocab() and len(set(vocab)) == 256
    assert vocab[ord("A")] == "A" and vocab[ord(" ")] == "\u0120" and vocab[10] == "\u010a"
    assert all(len(m.split(" ")[0]) == 2 for m in meta[K.Tokenizer.MERGES])  # never applies


@pytest.mark.parametrize("aware", [False, True], ids=["plain", "imatrix"])
def test_q4_k_m_is_chapter_15_s_bytes(model, files, windows, tmp_path, aware):
    """The same types and bytes as qlab.gguf.quantize_state(model, "Q4_K_M") (TinyLM's names),
    with and without chapter 15's importance matrix (TinyLM's names, the tied head's input
    included): llama.cpp's names give the same recipe roles, the tied head included."""
    imatrix = G.importance(model, windows[:4, :-1], head={"tok_emb.weight": model.ln_f}) if (
        aware) else None  # fmt: skip
    ours = G.quantize_state(model, "Q4_K_M", imatrix)
    path, written = files["Q4_K_M"]
    if aware:
        path = tmp_path / "tinylm-Q4_K_M-imatrix.gguf"
        written = G.export_llamacpp(model, path, "Q4_K_M", imatrix)
        assert not torch.equal(written["blk.1.ffn_down.weight"].data, files["Q4_K_M"][1][
            "blk.1.ffn_down.weight"].data)  # fmt: skip  (a Q4_K tensor: it reads the imatrix)
    for k, t in ours.items():
        w = written[tinylm_llamacpp_name(k)]
        assert (w.type, w.shape) == (t.type, t.shape), k
        assert torch.equal(w.data, t.data), k
    assert G.metadata(path)["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)


# --------------------------------------------------------------------------- in llama.cpp


def test_llama_cpp_tokenizes_bytes(llama_cpp, files):
    """The 256-token vocabulary makes llama.cpp's tokenizer TinyLM's: id = byte."""
    lm = LlamaCppLM(files["F32"][0], n_threads=1)
    text = "Hello, WORLD!\n\tcaf\u00e9 \u6771\u4eac  x\u2603 " + "".join(map(chr, range(1, 128)))
    data = text.encode("utf-8")
    assert lm.llm.tokenize(data, add_bos=False, special=False) == list(data)
    assert lm.llm.n_vocab() == 256
    assert lm.llm.detokenize(list(range(256))) == bytes(range(256))


@pytest.mark.parametrize("types", list(LOGIT_BOUND))
def test_logits_agree_with_qlab_forward(llama_cpp, model, files, windows, types):
    path, written = files[types]
    ours = Q.logits(G.dequantized_model(model, tinylm_names(written)), windows)
    theirs = LlamaCppLM(path, n_threads=1).logits(windows)
    diff = (theirs - ours).abs()
    p_ours, p_theirs = Q.perplexity(ours, windows), Q.perplexity(theirs, windows)
    print(f"{types}: |logit difference| max {diff.max():.4f} mean {diff.mean():.5f}; "
          f"perplexity qlab {p_ours:.5f} llama.cpp {p_theirs:.5f}")
    assert float(diff.max()) < LOGIT_BOUND[types]
    assert abs(p_theirs / p_ours - 1) < 1e-3
    assert (theirs.argmax(-1) == ours.argmax(-1)).double().mean() > 0.99


def _ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml-cpu's GELU (vec.h, GGML_GELU_FP16): the tanh approximation of the input rounded to
    float16, read from a float16 table; 0 below -10, the input above 10."""
    h = x.half().float()
    y = 0.5 * h * (1 + torch.tanh(0.7978845608028654 * h * (1 + 0.044715 * h * h)))
    return torch.where(x <= -10, 0.0, torch.where(x >= 10, x, y.half().float()))


class _GgmlGeluMLP(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.fc2(_ggml_gelu(self.mlp.fc1(x)))


def test_gelu_explains_the_gap(llama_cpp, model, files, windows):
    path, written = files["F32"]
    w = windows[:2]
    theirs = LlamaCppLM(path, n_threads=1, type_k=0, type_v=0, flash_attn=False).logits(w)
    plain = G.dequantized_model(model, tinylm_names(written))
    ggml = G.dequantized_model(model, tinylm_names(written))
    for block in ggml.blocks:
        block.mlp = _GgmlGeluMLP(block.mlp)
    gap = {name: float((Q.logits(m, w) - theirs).abs().mean())
           for name, m in (("erf", plain), ("ggml", ggml))}  # fmt: skip
    print(f"mean |logit difference| to llama.cpp: erf GELU {gap['erf']:.2e}, "
          f"ggml's GELU {gap['ggml']:.2e}")
    assert gap["ggml"] < 0.05 * gap["erf"]


def test_q4_k_m_perplexity_through_llama_cpp(llama_cpp, model, files, windows):
    """Chapter 15's Q4_K_M perplexity, qlab's (dequantized forward) and llama.cpp's (its
    logits of the same file, one window per sequence, qlab's formula exp(mean NLL))."""
    path, written = files["Q4_K_M"]
    ours = Q.perplexity(Q.logits(G.dequantized_model(model, tinylm_names(written)), windows),
                        windows)  # fmt: skip
    theirs = Q.perplexity(LlamaCppLM(path, n_threads=1).logits(windows), windows)
    f32 = Q.perplexity(Q.logits(model, windows), windows)
    print(f"Q4_K_M per-byte perplexity: qlab {ours:.4f}, llama.cpp {theirs:.4f} "
          f"(float32 model {f32:.4f})")
    assert abs(theirs / ours - 1) < 2e-3
