"""The course's models: TinyLM, a small byte-level language model to measure quantization
on (notebook 07), and all-MiniLM-L6-v2, a real pretrained encoder (``minilm``, chapter 12).

    from qlab.lm import quality
    model = quality.load_model()                      # the shipped checkpoint
    windows = quality.validation_windows(8, 256)      # held-out text
    ref = quality.logits(model, windows)
    q = quality.logits(quality.quantize_weights(model, "int4"), windows)
    quality.compare(ref, q, windows)                  # perplexity, KL, flip rate

Modules: ``model`` (the transformer and its KV cache), ``data`` (the shipped corpus and
its splits), ``train`` (``python -m qlab.lm.train``), ``quality`` (where to apply
quantizers, pruning and low rank; what to measure), ``minilm``, ``retrieval`` and
``outliers`` (chapter 12). Submodules load on first use: ``qlab.lm.minilm.load()``.
"""

from qlab.lm.model import KVCache, TinyLM, TinyLMConfig, load_checkpoint, save_checkpoint

__all__ = ["KVCache", "TinyLM", "TinyLMConfig", "load_checkpoint", "save_checkpoint"]

_SUBMODULES = ("data", "minilm", "model", "outliers", "quality", "retrieval", "train")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"qlab.lm.{name}")
    raise AttributeError(f"module 'qlab.lm' has no attribute {name!r}")
