"""llama.cpp's own quantizer against qlab's, on a whole model file.

qlab writes MiniLM at F32 in llama.cpp's `bert` architecture (qlab.gguf.export_llamacpp);
llama.cpp's llama_model_quantize (what the llama-quantize tool calls; llama-cpp-python
0.3.36, `make llamacpp`) quantizes that file to each file type; qlab exports the same model
with the same recipe. Tensor by tensor, the two files hold the same types and the same
bytes: llama_tensor_get_type's recipe rules (including the fallbacks of the 384-column
tensors, 384 % 256 != 0) are reproduced by qlab.gguf.recipe_types, and its quantizers by
qlab.gguf.quantize, with and without an importance matrix. The same holds for TinyLM,
written in llama.cpp's `gpt2` architecture (one fused qkv matrix per layer), under the nine
recipes chapter 15 measures on it.

The plain K-quant types (Q3_K, Q4_K, Q5_K, Q6_K as tensor types, not recipes) are
llama-quantize's --pure mode (params.pure: every quantizable tensor gets the type, or its
fallback). Run by `make test-llamacpp` (which builds llama-cpp-python); skipped without it.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

import qlab.gguf as G
from qlab.gguf.llamacpp import llamacpp_name, tinylm_llamacpp_name
from qlab.gguf.recipes import fallback, is_quantized
from qlab.lm import minilm, quality
from qlab.lm.data import eval_windows, load_splits
from qlab.lm.retrieval import calibration_texts

RECIPES = ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K_S", "Q3_K_M", "Q3_K_L",
           "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"]  # fmt: skip
PURE = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K"}  # type: ftype
WITH_IMATRIX = ["Q4_0", "Q5_1", "Q3_K_S", "Q4_K_M", "Q6_K"]
TINYLM_RECIPES = ["Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
                  "Q8_0", "Q4_0"]  # chapter 15's RECIPES, and Q4_0 (its section 5)  # fmt: skip
TINYLM_WITH_IMATRIX = ["Q3_K_S", "Q4_0", "Q4_K_M"]  # chapter 15's section 5


@pytest.fixture(scope="module")
def model():
    return minilm.load()


@pytest.fixture(scope="module")
def f32_file(llamacpp_export):
    return llamacpp_export("minilm", "F32")[0]


@pytest.fixture(scope="module")
def imatrix(model):
    """llama-imatrix's statistic from qlab (mean squared input of every linear), on
    calibration paragraphs the retrieval task never evaluates."""
    batches = [ids for _, ids in minilm.length_batches(calibration_texts(16), 16, 64)]
    return G.importance(model, batches)


def llama_quantize(llama_cpp, src, dst, ftype: str, pure: bool = False, imatrix=None) -> None:
    """llama_model_quantize(src -> dst) with llama.cpp's default parameters but the file
    type, 2 threads, params.pure, and an importance matrix keyed by llama.cpp's names."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[f"MOSTLY_{ftype}"])
    params.nthread = 2  # rows are quantized independently: the bytes do not depend on it
    params.pure = pure
    keep = []  # the arrays the C side reads, alive until it returns
    if imatrix is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for e, (name, v) in zip(entries, imatrix.items(), strict=False):
            data = np.ascontiguousarray(v.numpy(), dtype=np.float32)
            keep += [name.encode(), data]
            e.name, e.size = keep[-2], data.size
            e.data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        params.imatrix = entries  # the last entry (name NULL) ends the list
        keep.append(entries)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize to {ftype} failed ({rc})"


def differences(theirs: dict, ours: dict) -> dict[str, str]:
    """name -> what differs (type, or how many of its blocks' bytes), for every tensor."""
    assert set(theirs) == set(ours)
    out = {}
    for name, t in theirs.items():
        o = ours[name]
        if t.type != o.type:
            out[name] = f"type {t.type} (llama.cpp) vs {o.type} (qlab)"
        elif not np.array_equal(t.data.numpy(), o.data.numpy()):
            size = G.get_type(t.type).type_size
            a, b = t.data.numpy().reshape(-1, size), o.data.numpy().reshape(-1, size)
            out[name] = f"{t.type}: {int((a != b).any(1).sum())} of {len(a)} blocks differ"
    return out


@pytest.mark.parametrize(("which", "recipe"), [("minilm", r) for r in RECIPES]
                         + [("tinylm", r) for r in TINYLM_RECIPES])  # fmt: skip
def test_llama_quantize_writes_qlab_s_bytes(llama_cpp, llamacpp_export, tmp_path, which, recipe):
    dst = tmp_path / f"llama-{recipe}.gguf"
    llama_quantize(llama_cpp, llamacpp_export(which, "F32")[0], dst, recipe)
    path, ours = llamacpp_export(which, recipe)  # qlab's file: export_llamacpp(model, recipe)
    theirs = G.read(dst)  # parsed once (MiniLM's 30522-token vocabulary) for both below
    assert differences(G.load(theirs), ours) == {}
    assert G.metadata(theirs)["general.file_type"] == G.metadata(path)["general.file_type"]


@pytest.mark.parametrize("ggml_type", list(PURE))
def test_pure_k_quants_fall_back_on_384_columns(llama_cpp, model, f32_file, tmp_path, ggml_type):
    dst = tmp_path / f"llama-pure-{ggml_type}.gguf"
    llama_quantize(llama_cpp, f32_file, dst, PURE[ggml_type], pure=True)
    state = {llamacpp_name(k): v for k, v in model.state_dict().items()}
    types = {k: fallback(ggml_type, v.shape[-1]) for k, v in state.items()
             if is_quantized(k, tuple(v.shape))}  # fmt: skip
    ours = G.export_llamacpp(model, tmp_path / "qlab.gguf", types)
    theirs = G.load(dst)
    assert differences(theirs, ours) == {}
    assert theirs["blk.0.ffn_down.weight"].type == ggml_type  # 1536 = 6 * 256 columns
    assert theirs["blk.0.attn_q.weight"].type == G.recipes.FALLBACK[ggml_type]  # 384


@pytest.mark.parametrize("recipe", WITH_IMATRIX)
def test_with_an_importance_matrix(llama_cpp, model, f32_file, imatrix, llamacpp_export,
                                   tmp_path, recipe):  # fmt: skip
    dst = tmp_path / f"llama-{recipe}-imatrix.gguf"
    named = {llamacpp_name(k): v for k, v in imatrix.items()}
    llama_quantize(llama_cpp, f32_file, dst, recipe, imatrix=named)
    ours = G.export_llamacpp(model, tmp_path / "qlab.gguf", recipe, imatrix=imatrix)
    assert differences(G.load(dst), ours) == {}
    _, plain = llamacpp_export("minilm", recipe)  # the same recipe without the imatrix
    changed = [k for k in ours if not np.array_equal(ours[k].data.numpy(), plain[k].data.numpy())]
    assert changed  # the imatrix did change the rounding (Q8_0 tensors ignore it)


@pytest.mark.parametrize("recipe", TINYLM_WITH_IMATRIX)
def test_tinylm_with_chapter_15s_importance_matrix(llama_cpp, llamacpp_export, tmp_path, recipe):
    """Chapter 15's imatrix files of TinyLM (its section 5: training text, 16 x 256 bytes),
    written by llama.cpp's quantizer and by qlab: the same bytes. TinyLM's q, k and v read
    the same input, so llama.cpp's fused attn_qkv gets that input's imatrix."""
    model = quality.load_model()
    calibration = eval_windows(load_splits()[0], 16, 256)[:, :-1]
    imatrix = G.importance(model, calibration)
    named = {tinylm_llamacpp_name(k): v for k, v in imatrix.items()}
    dst = tmp_path / f"llama-{recipe}-imatrix.gguf"
    llama_quantize(llama_cpp, llamacpp_export("tinylm", "F32")[0], dst, recipe, imatrix=named)
    ours = G.export_llamacpp(model, tmp_path / "qlab.gguf", recipe, imatrix=imatrix)
    assert differences(G.load(dst), ours) == {}
    _, plain = llamacpp_export("tinylm", recipe)  # the same recipe without the imatrix
    assert any(not np.array_equal(ours[k].data.numpy(), plain[k].data.numpy()) for k in ours)
