"""qlab.ptq.rotation: Hadamard matrices, the fast Walsh-Hadamard transform, random rotations."""

import math

import numpy as np
import pytest
import torch

from qlab.ptq import fwht, hadamard, random_rotation
from qlab.ptq.rotation import hadamard_size_ok

POW2 = [1, 2, 4, 8, 16, 64, 256]
TWELVE = [12, 24, 48, 192, 384, 768, 1536]  # 12 * 2^k: TinyLM 192/768, MiniLM 384/1536


def _sylvester_numpy(n: int) -> np.ndarray:
    """Independent Sylvester construction: H[i, j] = (-1)^popcount(i & j) (natural order)."""
    i = np.arange(n)
    bits = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(bits % 2 == 0, 1.0, -1.0)


@pytest.mark.parametrize("n", POW2 + TWELVE)
def test_hadamard_orthonormal_with_entries_pm_one_over_sqrt_n(n):
    h = hadamard(n)
    assert h.dtype == torch.float32 and h.shape == (n, n)
    # fp32 entries carry 2^-24 relative rounding: H H^T is I within n * 2^-24 / n * a few
    eye = h.double() @ h.double().T
    assert torch.allclose(eye, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.allclose(h.abs().double() * math.sqrt(n), torch.ones(n, n, dtype=torch.float64),
                          rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", POW2)
def test_power_of_two_is_sylvester_natural_order(n):
    expected = torch.from_numpy(_sylvester_numpy(n) / math.sqrt(n)).float()
    assert torch.equal(hadamard(n), expected)
    assert torch.equal(hadamard(n), hadamard(n).T)  # symmetric


def test_twelve_point_matrix_is_hadamard_and_not_symmetric():
    h12 = torch.round(hadamard(12).double() * math.sqrt(12))
    assert set(h12.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h12 @ h12.T, 12 * torch.eye(12, dtype=torch.float64))
    assert not torch.equal(h12, h12.T)  # so x @ H and x @ H^T differ: the convention matters
    assert torch.equal(h12[0], torch.ones(12, dtype=torch.float64))  # Paley I: first row all +1


@pytest.mark.parametrize("k", [0, 1, 4, 5, 7])
def test_twelve_times_power_of_two_is_kron_with_twelve_outside(k):
    p = 2**k
    expected = torch.kron(hadamard(12).double(), hadamard(p).double())
    assert torch.allclose(hadamard(12 * p).double(), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n", POW2 + TWELVE)
def test_fwht_equals_dense_matrix(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, n, generator=g) * 4
    dense = x.double() @ hadamard(n).double()
    y = fwht(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    # both are float32 roundings of the same exact value (the dense one also carries H's fp32
    # rounding, ~6e-8 relative per entry): within a few float32 ulps of |y| <= ||x||
    bound = 4 * 2**-24 * x.double().norm(dim=-1, keepdim=True)
    assert ((y.double() - dense).abs() <= bound).all()


@pytest.mark.parametrize("n", [16, 192])
def test_fwht_of_basis_vector_is_a_row_and_of_outlier_is_flat(n):
    eye = torch.eye(n)
    assert torch.allclose(fwht(eye), hadamard(n), rtol=0, atol=1e-7)
    x = torch.zeros(n)
    x[n // 3] = 100.0  # one outlier channel ...
    y = fwht(x)
    assert torch.allclose(y.abs(), torch.full((n,), 100 / math.sqrt(n)), rtol=1e-6)  # ... spread


@pytest.mark.parametrize("n", [64, 384])
def test_fwht_preserves_norm_and_inverts(n):
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(1))
    y = fwht(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)
    back = y.double() @ hadamard(n).double().T  # H orthogonal: x H H^T = x
    assert torch.allclose(back, x.double(), rtol=0, atol=1e-5)
    if n & (n - 1) == 0:
        assert torch.allclose(fwht(y), x, rtol=0, atol=1e-5)  # Sylvester H is its own inverse


def test_fwht_large_n_runs_without_a_dense_matrix():
    # 12 * 2^16: a dense Hadamard matrix would take 2.4 TB; the transform touches 786k values
    n = 12 * 2**16
    x = torch.zeros(1, n)
    x[0, 5] = 1.0
    y = fwht(x)
    assert torch.allclose(y.abs(), torch.full_like(y, 1 / math.sqrt(n)), rtol=1e-6)


@pytest.mark.parametrize("q_name", ["hadamard", "random"])
@pytest.mark.parametrize("k", [192, 384])
def test_rotated_product_is_unchanged(q_name, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(16, k, generator=g)
    x[:, 7] *= 50  # an outlier channel
    w = torch.randn(32, k, generator=g)
    q = hadamard(k) if q_name == "hadamard" else random_rotation(k, seed=3)
    y = (x @ q) @ (w @ q).T
    ref = x.double() @ w.double().T
    # fp32 matmuls with K terms of size ~50: error ~ K * 2^-24 * |terms|
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-5 * k)


def test_random_rotation_orthogonal_seeded_any_size():
    for n in (1, 7, 100, 384):
        q = random_rotation(n, seed=5)
        assert q.shape == (n, n) and q.dtype == torch.float32
        assert torch.allclose(q.double() @ q.double().T, torch.eye(n, dtype=torch.float64),
                              rtol=0, atol=1e-5)
    assert torch.equal(random_rotation(64, 1), random_rotation(64, 1))
    assert not torch.equal(random_rotation(64, 1), random_rotation(64, 2))


def test_random_rotation_is_not_biased_towards_the_identity():
    # Haar-uniform: the mean diagonal over many draws is ~0 (QR without the sign fix is not
    # uniform: its diagonal leans positive)
    diag = torch.stack([random_rotation(8, s).diagonal() for s in range(400)])
    assert abs(float(diag.mean())) < 0.05


@pytest.mark.parametrize("bad", [0, -4, 10, 20, 36, 100])
def test_unsupported_sizes_say_what_to_do(bad):
    assert not hadamard_size_ok(bad)
    with pytest.raises(ValueError, match=r"2\^k|positive"):
        hadamard(bad)
    if bad > 0:
        with pytest.raises(ValueError, match="12 \\* 2\\^k"):
            fwht(torch.zeros(2, bad))


def test_input_types():
    x64 = np.random.default_rng(0).standard_normal((2, 16))
    assert torch.allclose(fwht(x64), fwht(torch.from_numpy(x64).float()))
    assert fwht(torch.ones(4, dtype=torch.float16)).dtype == torch.float32
    with pytest.raises(TypeError, match="dtype"):
        fwht(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="axis"):
        fwht(torch.tensor(1.0))
    with pytest.raises(ValueError):
        hadamard(True)
    with pytest.raises(ValueError):
        random_rotation(0)
