import math

import torch

from qlab import metrics


def test_rmse_sqnr():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = a + torch.tensor([0.5, -0.5, 0.5, -0.5])
    assert metrics.rmse(a, b) == 0.5
    assert metrics.sqnr_db(a, a) == math.inf
    assert abs(metrics.sqnr_db(a, b) - 10 * math.log10(30 / 1.0)) < 1e-12


def test_kl_and_flip_rate():
    p = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    assert metrics.kl_divergence(p, p) == 0.0
    q = p.clone()
    q[:, 0] += 100.0  # every position now predicts token 0
    assert metrics.kl_divergence(p, q) > 1.0
    per = metrics.kl_divergence(p, q, reduction="none")
    assert per.shape == (10,) and torch.all(per >= 0)
    ref = (torch.softmax(p.double(), -1) * (torch.log_softmax(p.double(), -1)
                                              - torch.log_softmax(q.double(), -1))).sum(-1)
    assert torch.allclose(per, ref)
    expected = float((p.argmax(-1) != 0).double().mean())
    assert metrics.flip_rate(p, q) == expected and metrics.flip_rate(p, p) == 0.0
