"""qlab.gguf: the GGUF formats people download, bit-exact with llama.cpp.

    quantize(x, "Q4_K", imatrix=None) -> GGUFTensor   llama.cpp's reference quantizer
    GGUFTensor: .type .shape .data (the file's bytes) .fields .codes .dequantize()
                .bits_per_element (Q4_0 4.5, Q8_0 8.5, Q4_K 4.5, Q6_K 6.5625, ...)
    export(tensors or model, path, "Q4_K_M" | {name: type}, imatrix=None)
    load(path) -> {name: GGUFTensor};  metadata(path), tensor_table(path)
    quantize_state(model, "Q4_K_M") -> {name: GGUFTensor}   what export writes, in memory
    dequantized_model(model, tensors) -> a model copy running on the dequantized weights
    recipe_types(shapes, "Q4_K_M") -> {name: type}   llama.cpp's _S/_M/_L mixes
    importance(model, inputs) -> {name: imatrix}     llama-imatrix's statistics
    export_llamacpp(model, path, "Q4_K_M")  MiniLM as llama.cpp's `bert`, TinyLM as its `gpt2`

Types: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32) and Q3_K, Q4_K, Q5_K, Q6_K
(super-blocks of 256). Q8_0, Q4_0 and Q5_0 are also ordinary qlab schemes ("q8_0", "q4_0",
"q5_0"); the others are the documented extension in legacy.py and kquants.py.

Rounding (llama.cpp's, kept): Q8_0 uses C's roundf (half away from zero); Q4_0, Q4_1,
Q5_0 and Q5_1 use (int)(v + 0.5) on a non-negative v (half up); the K-quants and every
importance-matrix search use nearest_int, which is round half to EVEN, qlab's own rule.
qlab keeps each of them because the goal is the same bytes as llama.cpp; the difference
matters only at exact ties. See README.md for layouts and sources.
"""

from qlab.gguf.file import (
    GGUFError,
    export,
    load,
    metadata,
    quantize_state,
    read,
    tensor_table,
)
from qlab.gguf.imatrix import importance
from qlab.gguf.llamacpp import export_llamacpp
from qlab.gguf.model import dequantized_model, to_state_dict
from qlab.gguf.recipes import RECIPES, fallback, recipe_types, role
from qlab.gguf.types import (
    TYPE_NAMES,
    TYPES,
    GGMLType,
    GGUFTensor,
    bits_per_weight,
    dequantize,
    from_bytes,
    get_type,
    quantize,
)

__all__ = [
    "quantize", "dequantize", "GGUFTensor", "GGMLType", "TYPES", "TYPE_NAMES", "get_type",
    "bits_per_weight", "from_bytes", "export", "load", "metadata", "tensor_table", "read",
    "GGUFError", "RECIPES", "recipe_types", "fallback", "role", "importance",
    "quantize_state", "to_state_dict", "dequantized_model", "export_llamacpp",
]  # fmt: skip
