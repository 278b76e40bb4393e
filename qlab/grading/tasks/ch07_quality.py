"""Chapter 07 (measuring quality): perplexity, KL divergence, flip rate of two models' logits."""

from __future__ import annotations

import torch

import qlab.metrics
from qlab.grading.registry import Task, close, register
from qlab.grading.tasks._inputs import choice, randint, weights
from qlab.lm import quality

ASSIGNMENT = "07_quality"


# --------------------------------------------------------------------------- perplexity


def _ppl_cases(g: torch.Generator):
    cases = []
    for _ in range(2):  # a random "model" on random text
        n, t, v = randint(g, 1, 4), randint(g, 4, 24), choice(g, (16, 32, 64))
        cases.append((weights(g, (n, t, v), scale=choice(g, (0.5, 1.0, 3.0))), _text(g, n, t, v)))
    # a model that has learned something: the actual next byte gets a boost that differs per
    # window, so targets taken one step off, or a mean of per-window perplexities, show
    n, t, v = 3, randint(g, 8, 24), choice(g, (32, 64))
    windows = _text(g, n, t, v)
    lg = weights(g, (n, t, v), scale=1.0)
    boost = torch.tensor([1.0, 3.0, 5.0])[torch.randperm(3, generator=g)]
    lg.scatter_add_(-1, windows[:, 1:, None], boost[:, None, None].expand(n, t, 1).clone())
    cases.append((lg, windows))
    # a model that knows nothing: equal logits, perplexity = vocabulary size
    n, t, v = randint(g, 1, 3), randint(g, 4, 16), choice(g, (8, 256))
    cases.append((torch.full((n, t, v), float(randint(g, -3, 3))), _text(g, n, t, v)))
    return cases


def _text(g: torch.Generator, n: int, t: int, v: int) -> torch.Tensor:
    return torch.randint(0, v, (n, t + 1), generator=g)


register(
    Task(
        grade_id="perplexity",
        func_name="perplexity",
        points=2,
        assignment=ASSIGNMENT,
        cases=_ppl_cases,
        reference=lambda logits, windows: quality.perplexity(logits, windows),
        # qlab averages the NLL in float32 (F.cross_entropy); a float64 or differently ordered
        # float32 mean moves the mean NLL by up to ~2e-6 nats here (mean NLL up to ~12), and
        # exp turns that into the same RELATIVE error in the perplexity (measured over 2000
        # seeds: < 2.2e-6). The wrong answers are off by whole factors.
        compare=close(rtol=2e-5),
        signature="perplexity(logits (N, T, V), windows int64 (N, T + 1)) -> float",
    )
)


# --------------------------------------------------------------------------- KL divergence


def _kl_cases(g: torch.Generator):
    cases = []
    # quantization-like: q is p plus a small error (the chapter's situation; KL ~ 1e-3..1e-2)
    shape = (randint(g, 1, 3), randint(g, 2, 12), choice(g, (16, 32, 64)))
    p = weights(g, shape, scale=choice(g, (1.0, 2.0, 4.0)))
    cases.append((p, p + weights(g, shape, scale=0.15)))
    # two unrelated distributions, 2-d (positions, vocab)
    shape = (randint(g, 2, 16), choice(g, (8, 16, 64)))
    cases.append((weights(g, shape, scale=2.0), weights(g, shape, scale=2.0)))
    # a sharper or flatter copy (temperature): KL(P || Q) and KL(Q || P) differ a lot
    p = weights(g, (randint(g, 2, 6), randint(g, 2, 8), 32), scale=1.5)
    cases.append((p, p * choice(g, (0.25, 3.0))))
    # large logits: float32 probabilities underflow to 0, so log(softmax) gives -inf/NaN
    p = weights(g, (randint(g, 2, 4), 64), scale=40.0)
    cases.append((p, p + weights(g, p.shape, scale=4.0)))
    # identical: KL is exactly zero
    p = weights(g, (randint(g, 1, 4), randint(g, 1, 6), 16))
    cases.append((p, p.clone()))
    return cases


register(
    Task(
        grade_id="kl_divergence",
        func_name="kl_divergence",
        points=3,
        assignment=ASSIGNMENT,
        cases=_kl_cases,
        reference=lambda p_logits, q_logits: qlab.metrics.kl_divergence(p_logits, q_logits),
        # qlab works in float64; a float32 log_softmax carries about 1 ulp of the largest
        # logit (~1e-5 at |logit| ~ 150) into each log-ratio, mostly cancelling in the
        # p-weighted sum: correct float32 answers were within 1.2e-6 nats and 4e-7 relative
        # of qlab over 2000 seeds. atol covers KL near 0 (the identical and quantization-like
        # cases); the wrong answers are off by factors.
        compare=close(rtol=1e-4, atol=1e-5),
        signature="kl_divergence(p_logits (..., V), q_logits (..., V)) -> float (nats)",
    )
)


# --------------------------------------------------------------------------- flip rate


def _distinct_logits(g: torch.Generator, shape, s: float) -> torch.Tensor:
    """Logits whose values in each row are >= s / 2 apart: no argmax ties, robust argmax."""
    *lead, v = shape
    rows = int(torch.tensor(lead).prod()) if lead else 1
    perm = torch.stack([torch.randperm(v, generator=g) for _ in range(rows)]).float()
    jitter = torch.rand(rows, v, generator=g) * 0.5
    return ((perm + jitter) * s - s * v / 2).reshape(shape)


def _flip_cases(g: torch.Generator):
    cases = []
    for shape in (
        (randint(g, 2, 3), randint(g, 3, 12), choice(g, (5, 16, 50))),
        (randint(g, 4, 20), choice(g, (2, 8, 32))),
    ):
        s = choice(g, (0.1, 1.0, 3.0))
        a = _distinct_logits(g, shape, s)
        # small noise changes the logits but never the top-1 (it moves gaps by < 0.4 s)...
        b = a + (torch.rand(shape, generator=g) - 0.5) * 0.4 * s
        # ...then some positions (at least one, never all) get a new clear winner
        rows_a, rows_b = a.reshape(-1, shape[-1]), b.reshape(-1, shape[-1])
        n = rows_a.shape[0]
        flip = torch.randperm(n, generator=g)[: randint(g, 1, n - 1)]
        for i in flip.tolist():
            j = (int(rows_a[i].argmax()) + randint(g, 1, shape[-1] - 1)) % shape[-1]
            rows_b[i, j] = rows_b[i].max() + s * (0.5 + float(torch.rand((), generator=g)))
        cases.append((a, rows_b.reshape(shape)))
    # nothing flips: a monotone rescaling changes every logit, not the order
    a = _distinct_logits(g, (randint(g, 2, 4), randint(g, 2, 8), 16), 1.0)
    cases.append((a, a * choice(g, (0.5, 2.0)) + randint(g, -3, 3)))
    # everything flips: the argmax of -a is the argmin of a
    a = _distinct_logits(g, (randint(g, 2, 10), choice(g, (2, 7, 32))), 1.0)
    cases.append((a, -a))
    return cases


register(
    Task(
        grade_id="flip_rate",
        func_name="flip_rate",
        points=2,
        assignment=ASSIGNMENT,
        cases=_flip_cases,
        reference=lambda a_logits, b_logits: qlab.metrics.flip_rate(a_logits, b_logits),
        # the count must be exact; the fraction may be a float32 mean (within 1 float32 ulp,
        # 6e-8 relative, of qlab's float64), while one flip more or less changes it by at
        # least 1/N of itself (N <= 36 positions here). No argmax ties in the inputs.
        compare=close(rtol=1e-6),
        signature="flip_rate(a_logits (..., V), b_logits (..., V)) -> float in [0, 1]",
    )
)
