"""The importance matrix: what llama-imatrix collects, and what it does to the rounding."""

from __future__ import annotations

import torch
from torch import nn

import qlab.gguf as G
import qlab.metrics


def test_importance_is_the_mean_squared_input_per_column():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    batches = [torch.randn(5, 8, generator=g), torch.randn(3, 2, 8, generator=g)]
    im = G.importance(model, batches)
    xs = torch.cat([b.reshape(-1, 8) for b in batches])
    assert torch.allclose(im["0.weight"], (xs**2).mean(dim=0), rtol=1e-6)
    h = torch.relu(xs @ model[0].weight.T)
    assert torch.allclose(im["2.weight"], (h**2).mean(dim=0), rtol=1e-5)
    tied = G.importance(model, batches[0], head={"head.weight": model[1]})
    assert torch.allclose(tied["head.weight"], tied["2.weight"])  # ReLU output = fc2 input


def _weighted_error(w, w_hat, imatrix):
    return float((((w - w_hat) ** 2) * imatrix).sum())


def test_imatrix_lowers_the_error_it_weights():
    """A few columns with 100x the activation energy: with the imatrix, llama.cpp's searches
    trade error on unimportant columns for error on those, on every type that uses it.
    (Not a guarantee per block; on this matrix the ratio measured 0.26-0.50.)"""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=g) * 0.02
    imatrix = torch.ones(512)
    imatrix[torch.randperm(512, generator=g)[:24]] = 100.0
    for name in ("Q4_0", "Q5_0", "Q4_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        plain = G.quantize(w, name).dequantize()
        aware = G.quantize(w, name, imatrix=imatrix).dequantize()
        e_plain, e_aware = _weighted_error(w, plain, imatrix), _weighted_error(w, aware, imatrix)
        assert e_aware < 0.95 * e_plain, (name, e_aware / e_plain)
        assert qlab.metrics.rmse(w, aware) < 2 * qlab.metrics.rmse(w, plain)  # still sane
    q8 = G.quantize(w, "Q8_0", imatrix=imatrix).data
    assert torch.equal(q8, G.quantize(w, "Q8_0").data)  # Q8_0 ignores it, as in llama.cpp
