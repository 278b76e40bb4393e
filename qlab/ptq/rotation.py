"""Rotations that spread outliers: Hadamard matrices, the fast Walsh-Hadamard transform,
random orthogonal matrices (QuaRot, Ashkboos et al. 2024; QuIP#, Tseng et al. 2024).

For any orthogonal Q (Q Q^T = I) a linear layer computes the same product on rotated
operands:   x W^T = (x Q) (W Q)^T.
An outlier channel of x is a large coordinate along one axis; x Q spreads it over all n
coordinates (a Hadamard row has every entry +-1/sqrt(n)), so per-token scales stop being set
by one channel. W Q is computed once, offline; x Q is computed per token, online, unless
the model lets it be folded into the previous layer.

Conventions (qlab's, fixed here and used everywhere):
    H_1 = [1],  H_2m = [[H_m, H_m], [H_m, -H_m]]       Sylvester, natural (Hadamard) order
    H12 = I + [[0, 1^T], [-1, Q11]]                    Paley I, Q11 = Jacobsthal matrix mod 11
    hadamard(2^k)      = H_{2^k} / sqrt(n)             symmetric
    hadamard(12 * 2^k) = kron(H12, H_{2^k}) / sqrt(n)  the 12-point matrix on the OUTSIDE; not
                                                        symmetric (H12 is not)
    fwht(x)            = x @ hadamard(n)                along the last axis, orthonormal
Other libraries pick other 12-point matrices, Kronecker orders or sequency order; any of
them is orthogonal and works for quantization, but results differ element by element.
"""

from __future__ import annotations

import math

import torch

from qlab._tensor import as_float32

__all__ = ["hadamard", "fwht", "random_rotation", "hadamard_size_ok"]

_QR11 = frozenset(i * i % 11 for i in range(1, 11))  # quadratic residues mod 11: {1, 3, 4, 5, 9}


def _split(n: int) -> tuple[int, int]:
    """n = m * 2^k with m in {1, 12} -> (m, 2^k); ValueError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    m = 12 if n % 12 == 0 else 1
    p = n // m
    if p & (p - 1):
        raise ValueError(
            f"no Hadamard matrix here for n = {n}: qlab builds n = 2^k (Sylvester) and "
            f"n = 12 * 2^k (Paley 12-point matrix x Sylvester), e.g. 384 = 12 * 32; pad the "
            "last axis to such a size or use random_rotation(n)"
        )
    return m, p


def hadamard_size_ok(n: int) -> bool:
    """True when hadamard(n) / fwht exist for n (n = 2^k or 12 * 2^k)."""
    try:
        _split(n)
    except ValueError:
        return False
    return True


def _h12() -> torch.Tensor:
    """The 12 x 12 Paley (type I) Hadamard matrix, entries +-1, float64.

    Q11[i, j] = chi(j - i) with chi the quadratic character mod 11 (0 at 0, 1 on residues,
    -1 otherwise); S = [[0, 1^T], [-1, Q11]] is skew-symmetric and H12 = I + S.
    """
    chi = [0.0] + [1.0 if r in _QR11 else -1.0 for r in range(1, 11)]
    q = torch.tensor([[chi[(j - i) % 11] for j in range(11)] for i in range(11)],
                     dtype=torch.float64)
    s = torch.zeros(12, 12, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, q
    return torch.eye(12, dtype=torch.float64) + s


def _sylvester(p: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(n: int) -> torch.Tensor:
    """float32 (n, n) orthonormal Hadamard matrix (H H^T = I, entries +-1/sqrt(n)), for
    n = 2^k or n = 12 * 2^k (MiniLM's 384 and 1536, TinyLM's 192 and 768). See the module
    docstring for the exact matrix."""
    m, p = _split(n)
    h = _sylvester(p)
    if m == 12:
        h = torch.kron(_h12(), h)
    return (h / math.sqrt(n)).float()


def fwht(x) -> torch.Tensor:
    """The fast Walsh-Hadamard transform along the last axis: x @ hadamard(n), float32 (..., n).

    O(n log n): log2(2^k) butterfly passes (a, b) -> (a + b, a - b) over pairs h apart, on each
    of the m contiguous blocks of 2^k (m = 1 or 12), then, for n = 12 * 2^k, the 12 blocks are
    mixed by H12^T (12 x 12 per position), and everything is scaled by 1/sqrt(n) once.
    float32 arithmetic, like the rest of qlab: |fwht(x) - x @ H| is a few float32 ulps of
    |x| (its L2 norm)."""
    x = as_float32(x)
    if x.ndim == 0:
        raise ValueError("fwht needs at least one axis (the one to transform)")
    n = x.shape[-1]
    m, p = _split(n)
    y = x.reshape(-1, m, p)  # shape: (rows, m, 2^k)
    rows = y.shape[0]
    h = 1
    while h < p:
        pairs = y.reshape(rows, m, p // (2 * h), 2, h)  # shape: (rows, m, blocks, 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(rows, m, p)  # a new tensor: x intact
        h *= 2
    if m == 12:  # x @ kron(H12, H) = H12^T X H for X = x viewed as (12, 2^k)
        y = torch.einsum("ij,rip->rjp", _h12().float(), y)
    return (y / math.sqrt(n)).reshape(x.shape)


def random_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """float32 (n, n) random orthogonal matrix, uniform (Haar) over rotations and
    reflections, reproducible from ``seed``: the Q of a QR decomposition of a seeded standard
    normal matrix (float64), with each column's sign fixed by diag(R) so the distribution
    is uniform (Mezzadri 2007). Any n >= 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    g = torch.Generator().manual_seed(int(seed))
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).float()
