"""Chapter 07 (measuring quality): perplexity, KL divergence, flip rate of two models' logits.

Spec clauses and the fixed case (every seed) that breaking each one changes:

perplexity(logits (N, T, V), windows (N, T + 1)) -> float
  Q1 the target of position t is windows[:, t + 1] (shifted) ........ "learned"
  Q2 natural log; exp of ONE mean over all N T predictions .......... "learned"
  Q3 stable log-probabilities (log_softmax), where a target's float32
     softmax probability underflows to 0 ............................ "underflow"
kl_divergence(p_logits, q_logits) -> float, nats
  K1 KL(P || Q): expectation under P, the first argument ............ "temperature"
  K2 natural log (nats); mean over every leading position ........... every case
  K3 stable log-probabilities: q underflows in float32 where p does
     not (log q = -inf), and p underflows where q does not (0 * -inf) . "underflow"
flip_rate(a_logits, b_logits) -> float in [0, 1]
  R1 a flip is a changed argmax, not a changed logit ................ "monotone"
  R2 the fraction over all leading positions ........................ every case
"""

from __future__ import annotations

import torch

import qlab.metrics
from qlab.grading.registry import Mismatch, close, tasks_for
from qlab.grading.tasks._inputs import choice, randint, weights
from qlab.lm import quality

task = tasks_for("07_quality")
UNDERFLOW = 120.0  # a logit this far below the row's max has softmax exp(-120) = 0 in float32


def _zero_probs(logits: torch.Tensor) -> int:
    return int((torch.softmax(logits.float(), dim=-1) == 0).sum())


# --------------------------------------------------------------------------- perplexity


def _ppl_explain(args, m: Mismatch) -> str:
    logits, windows = args
    nll = quality.nll(logits, windows)
    note = (
        f"mean NLL over the {nll.numel()} predictions = {float(nll.mean()):.7g} nats "
        "(targets windows[:, 1:])"
    )
    target_p = torch.softmax(logits.float(), dim=-1).gather(-1, windows[:, 1:, None])
    if int((target_p == 0).sum()):
        note += (
            f"; {int((target_p == 0).sum())} target(s) have a float32 softmax probability of "
            "exactly 0: log(softmax) gives -inf there, log_softmax does not"
        )
    return note


# qlab averages the NLL in float32 (F.cross_entropy); a float64 or differently ordered
# float32 mean moves the mean NLL by up to ~2e-6 nats here (mean NLL up to ~12), and
# exp turns that into the same RELATIVE error in the perplexity (measured over 2000
# seeds: < 2.2e-6). The wrong answers are off by whole factors.
@task("perplexity", "perplexity", points=2,
      implements=("qlab.lm.quality.perplexity",),
      reference=lambda logits, windows: quality.perplexity(logits, windows),
      compare=close(rtol=2e-5, explain=_ppl_explain),
      signature="perplexity(logits (N, T, V), windows int64 (N, T + 1)) -> float")
def _ppl_cases(g: torch.Generator):
    cases = []
    for _ in range(2):  # a random "model" on random text
        n, t, v = randint(g, 1, 4), randint(g, 4, 24), choice(g, (16, 32, 64))
        cases.append((weights(g, (n, t, v), scale=choice(g, (0.5, 1.0, 3.0))), _text(g, n, t, v)))
    # learned: the actual next byte gets a boost that differs per window, so targets taken
    # one step off, or a mean of per-window perplexities, show
    n, t, v = 3, randint(g, 8, 24), choice(g, (32, 64))
    windows = _text(g, n, t, v)
    lg = weights(g, (n, t, v), scale=1.0)
    boost = torch.tensor([1.0, 3.0, 5.0])[torch.randperm(3, generator=g)]
    lg.scatter_add_(-1, windows[:, 1:, None], boost[:, None, None].expand(n, t, 1).clone())
    cases.append((lg, windows))
    # a model that knows nothing: equal logits, perplexity = vocabulary size
    n, t, v = randint(g, 1, 3), randint(g, 4, 16), choice(g, (8, 256))
    cases.append((torch.full((n, t, v), float(randint(g, -3, 3))), _text(g, n, t, v)))
    # underflow: one target sits UNDERFLOW below its row's max (NLL ~ 120 nats, finite)
    n, t, v = 2, randint(g, 8, 16), 32
    windows = _text(g, n, t, v)
    lg = weights(g, (n, t, v), scale=1.0)
    r, c = randint(g, 0, n - 1), randint(g, 0, t - 1)
    lg[r, c, windows[r, c + 1]] = lg[r, c].max() - UNDERFLOW
    cases.append((lg, windows))
    return cases


def _text(g: torch.Generator, n: int, t: int, v: int) -> torch.Tensor:
    return torch.randint(0, v, (n, t + 1), generator=g)


# --------------------------------------------------------------------------- KL divergence


def _kl_explain(args, m: Mismatch) -> str:
    p, q = args
    per = qlab.metrics.kl_divergence(p, q, reduction="none")
    note = (
        f"KL(P || Q) per position ranges {float(per.min()):.4g}..{float(per.max()):.4g} nats "
        f"over {per.numel()} positions; the answer is their mean"
    )
    under = {"P": _zero_probs(p), "Q": _zero_probs(q)}
    if any(under.values()):
        note += (
            f"; float32 softmax probabilities exactly 0: {under['P']} in P, {under['Q']} in Q "
            "(log(softmax) gives -inf and 0 * -inf = NaN there; log_softmax stays finite)"
        )
    return note


# qlab works in float64; a float32 log_softmax carries about 1 ulp of the largest
# logit (~1e-5 at |logit| ~ 150) into each log-ratio, mostly cancelling in the
# p-weighted sum: correct float32 answers were within 1.2e-6 nats and 4e-7 relative
# of qlab over 2000 seeds. atol covers KL near 0 (the identical and quantization-like
# cases); the wrong answers are off by factors.
@task("kl_divergence", "kl_divergence", points=3,
      implements=("qlab.metrics.kl_divergence",),
      reference=lambda p_logits, q_logits: qlab.metrics.kl_divergence(p_logits, q_logits),
      compare=close(rtol=1e-4, atol=1e-5, explain=_kl_explain),
      signature="kl_divergence(p_logits (..., V), q_logits (..., V)) -> float (nats)")
def _kl_cases(g: torch.Generator):
    cases = []
    # quantization-like: q is p plus a small error (the chapter's situation; KL ~ 1e-3..1e-2)
    shape = (randint(g, 1, 3), randint(g, 2, 12), choice(g, (16, 32, 64)))
    p = weights(g, shape, scale=choice(g, (1.0, 2.0, 4.0)))
    cases.append((p, p + weights(g, shape, scale=0.15)))
    # two unrelated distributions, 2-d (positions, vocab)
    shape = (randint(g, 2, 16), choice(g, (8, 16, 64)))
    cases.append((weights(g, shape, scale=2.0), weights(g, shape, scale=2.0)))
    # temperature: a sharper or flatter copy; KL(P || Q) and KL(Q || P) differ a lot
    p = weights(g, (randint(g, 2, 6), randint(g, 2, 8), 32), scale=1.5)
    cases.append((p, p * choice(g, (0.25, 3.0))))
    # large logits: float32 probabilities underflow to 0, so log(softmax) gives -inf/NaN
    p = weights(g, (randint(g, 2, 4), 64), scale=40.0)
    cases.append((p, p + weights(g, p.shape, scale=4.0)))
    cases.append(_kl_underflow(g))
    # identical: KL is exactly zero
    p = weights(g, (randint(g, 1, 4), randint(g, 1, 6), 16))
    cases.append((p, p.clone()))
    return cases


def _kl_underflow(g: torch.Generator):
    """Moderate logits, except: in one position of Q one entry sits UNDERFLOW below the max
    (q = 0 in float32 where p is ~1/V: KL finite, ~120 / V nats from it), and in another
    position of P one entry does (p = 0 where q is not: it adds nothing)."""
    p = weights(g, (4, 16), scale=1.0)
    q = p + weights(g, (4, 16), scale=0.3)
    rq, rp = torch.randperm(4, generator=g)[:2].tolist()
    q[rq, randint(g, 0, 15)] = q[rq].max() - UNDERFLOW
    p[rp, randint(g, 0, 15)] = p[rp].max() - UNDERFLOW
    return (p, q)


# --------------------------------------------------------------------------- flip rate


def _distinct_logits(g: torch.Generator, shape, s: float) -> torch.Tensor:
    """Logits whose values in each row are >= s / 2 apart: no argmax ties, robust argmax."""
    *lead, v = shape
    rows = int(torch.tensor(lead).prod()) if lead else 1
    perm = torch.stack([torch.randperm(v, generator=g) for _ in range(rows)]).float()
    jitter = torch.rand(rows, v, generator=g) * 0.5
    return ((perm + jitter) * s - s * v / 2).reshape(shape)


def _flip_explain(args, m: Mismatch) -> str:
    a, b = args
    flips = int((a.argmax(dim=-1) != b.argmax(dim=-1)).sum())
    n = a.argmax(dim=-1).numel()
    return f"{flips} of the {n} positions (all leading indices) change their argmax"


# the count must be exact; the fraction may be a float32 mean (within 1 float32 ulp,
# 6e-8 relative, of qlab's float64), while one flip more or less changes it by at
# least 1/N of itself (N <= 36 positions here). No argmax ties in the inputs.
@task("flip_rate", "flip_rate", points=2,
      implements=("qlab.metrics.flip_rate",),
      reference=lambda a_logits, b_logits: qlab.metrics.flip_rate(a_logits, b_logits),
      compare=close(rtol=1e-6, explain=_flip_explain),
      signature="flip_rate(a_logits (..., V), b_logits (..., V)) -> float in [0, 1]")
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
    # monotone: a rescaling changes every logit, not the order: nothing flips
    a = _distinct_logits(g, (randint(g, 2, 4), randint(g, 2, 8), 16), 1.0)
    cases.append((a, a * choice(g, (0.5, 2.0)) + randint(g, -3, 3)))
    # everything flips: the argmax of -a is the argmin of a
    a = _distinct_logits(g, (randint(g, 2, 10), choice(g, (2, 7, 32))), 1.0)
    cases.append((a, -a))
    return cases
