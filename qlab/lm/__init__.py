"""TinyLM: a small byte-level language model to measure quantization on (notebook 07).

    from qlab.lm import quality
    model = quality.load_model()                      # the shipped checkpoint
    windows = quality.validation_windows(8, 256)      # held-out text
    ref = quality.logits(model, windows)
    q = quality.logits(quality.quantize_weights(model, "int4"), windows)
    quality.compare(ref, q, windows)                  # perplexity, KL, flip rate

Modules: ``model`` (the transformer and its KV cache), ``data`` (the shipped corpus and
its splits), ``train`` (``python -m qlab.lm.train``), ``quality`` (where to apply
quantizers, pruning and low rank; what to measure).
"""

from qlab.lm.model import KVCache, TinyLM, TinyLMConfig, load_checkpoint, save_checkpoint

__all__ = ["KVCache", "TinyLM", "TinyLMConfig", "load_checkpoint", "save_checkpoint"]
