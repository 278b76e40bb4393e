"""A real quality measure for a sentence encoder: retrieval on text the repo ships.

The task: every paragraph of ``qlab/lm/data/corpus.txt`` (CPython docstrings) that has at
least two sentences gives a pair (its first sentence, the rest of the paragraph). Each first
sentence (the query) must find its own rest (the document) among the documents of all N
pairs, by cosine similarity of the embeddings:

    recall@1 = fraction of queries whose most similar document is their own

reported with a 95 % percentile-bootstrap interval over queries
(``qlab.lm.quality.bootstrap_mean_ci``). Next to it, the mean cosine similarity of each
text's embedding to the float32 model's embedding of the same text: a distance to the
baseline, which can move while recall does not.

    task = retrieval.RetrievalTask.build(64)          # 64 pairs, queries + documents
    ref = task.evaluate(minilm.load())                # recall@1 of float32 MiniLM
    q = task.evaluate(variant, ref)                   # + paired change, cosine to float32
    q = task.evaluate(variant, ref.embeddings)        # (cosine only)
    retrieval.calibration_texts(64)                   # other paragraphs, for calibration

Pairs are picked evenly over the corpus (every k-th), deterministically; calibration texts
come from pairs that are never evaluated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from qlab.lm.data import CORPUS_PATH
from qlab.lm.quality import bootstrap_mean_ci

__all__ = ["all_pairs", "RetrievalTask", "RetrievalResult", "calibration_texts", "score",
           "from_hits"]

MIN_QUERY_CHARS = 25  # shorter first sentences ("See above.") say too little to match
MIN_DOC_CHARS = 60
DOC_MAX_TOKENS = 64  # texts are truncated to 64 tokens (a document's median is ~35): fast
_FIRST_SENTENCE = re.compile(r"(.+?[.!?])\s+(?=[A-Z])(.*)", re.S)


@lru_cache(maxsize=1)
def all_pairs() -> tuple[tuple[str, str], ...]:
    """Every (first sentence, rest of the paragraph) of the corpus, whitespace collapsed.

    A paragraph is text between blank lines; indented paragraphs (code) are skipped; the
    first sentence ends at . ! or ? followed by whitespace and a capital letter. Pairs whose
    query or document repeats an earlier one are dropped, so each query has one answer."""
    pairs, seen_q, seen_d = [], set(), set()
    for para in CORPUS_PATH.read_text(encoding="ascii").split("\n\n"):
        if not para.strip() or para[0].isspace():
            continue
        m = _FIRST_SENTENCE.match(para)
        if m is None:
            continue
        query, doc = " ".join(m.group(1).split()), " ".join(m.group(2).split())
        if len(query) < MIN_QUERY_CHARS or len(doc) < MIN_DOC_CHARS:
            continue
        if query in seen_q or doc in seen_d:
            continue
        seen_q.add(query)
        seen_d.add(doc)
        pairs.append((query, doc))
    return tuple(pairs)


def _spread(n: int, offset: int) -> list[tuple[str, str]]:
    """n pairs evenly spaced over the corpus; offset 0 (evaluation) or 1 (calibration)."""
    pairs = all_pairs()
    if not 1 <= n <= len(pairs) // 2:
        raise ValueError(f"n must be in 1..{len(pairs) // 2}, got {n}")
    step = len(pairs) // n  # >= 2, so offsets 0 and 1 never pick the same pair
    return [pairs[i * step + offset] for i in range(n)]


def calibration_texts(n: int = 64) -> list[str]:
    """n paragraphs (query + document of pairs that are never evaluated), for statistics
    such as per-channel activation maxima."""
    return [f"{q} {d}" for q, d in _spread(n, 1)]


@dataclass
class RetrievalResult:
    """One model on one task. Intervals: 95 % percentile bootstrap over queries / texts.

    With a reference result (the float32 model on the same task), also the PAIRED change of
    recall (this model's hits minus the reference's, query by query: much tighter than
    comparing two intervals) and the cosine of each embedding to the reference's."""

    recall_at_1: float
    recall_ci: tuple[float, float]
    hits: torch.Tensor  # bool (N,): query i found document i
    embeddings: torch.Tensor  # float32 (2N, d): the N queries, then the N documents
    recall_change: float = math.nan  # recall_at_1 - reference's
    recall_change_ci: tuple[float, float] = (math.nan, math.nan)
    cosine: float = math.nan  # mean cosine to the reference embeddings
    cosine_ci: tuple[float, float] = (math.nan, math.nan)
    cosine_min: float = math.nan

    def row(self) -> str:
        lo, hi = self.recall_ci
        out = f"recall@1 {self.recall_at_1:.3f} [{lo:.3f}, {hi:.3f}]"
        if not math.isnan(self.recall_change):
            d0, d1 = self.recall_change_ci
            out += f"  change {self.recall_change:+.3f} [{d0:+.3f}, {d1:+.3f}]"
        if not math.isnan(self.cosine):
            c0, c1 = self.cosine_ci
            out += (f"  cosine to fp32 {self.cosine:.4f} [{c0:.4f}, {c1:.4f}]"
                    f" (min {self.cosine_min:.3f})")
        return out


@dataclass
class RetrievalTask:
    """N queries and their N documents."""

    queries: list[str]
    documents: list[str]

    @classmethod
    def build(cls, n: int = 64) -> RetrievalTask:
        """n pairs spread evenly over the corpus (deterministic)."""
        pairs = _spread(n, 0)
        return cls([q for q, _ in pairs], [d for _, d in pairs])

    @property
    def texts(self) -> list[str]:
        return self.queries + self.documents

    def evaluate(self, model: nn.Module,
                 reference: RetrievalResult | torch.Tensor | None = None,
                 n_boot: int = 1000) -> RetrievalResult:
        """Embed queries and documents with ``model.embed`` (texts truncated to
        DOC_MAX_TOKENS tokens) and score them (see ``score``)."""
        emb = model.embed(self.texts, max_length=DOC_MAX_TOKENS)  # shape: (2N, d), unit rows
        return score(emb, len(self.queries), reference, n_boot)


def score(emb: torch.Tensor, n: int,
          reference: RetrievalResult | torch.Tensor | None = None,
          n_boot: int = 1000) -> RetrievalResult:
    """Recall@1 from unit-norm embeddings (2N, d): N queries, then their N documents in the
    same order; with ``reference`` (a result on the same texts) the paired recall change and
    the cosine of each embedding to the reference's (given only the reference's embeddings
    (2N, d), the cosine alone)."""
    sims = emb[:n] @ emb[n:].T  # shape: (N, N), cosine: rows are unit vectors
    hits = sims.argmax(dim=1) == torch.arange(n)
    cos = None
    if reference is not None:
        ref_emb = reference if isinstance(reference, torch.Tensor) else reference.embeddings
        if ref_emb.shape != emb.shape:
            raise ValueError(f"reference embeddings {tuple(ref_emb.shape)} must match "
                             f"{tuple(emb.shape)}: evaluate the same task")
        cos = (emb.double() * ref_emb.double()).sum(dim=1)  # shape: (2N,)
    ref_hits = reference.hits if isinstance(reference, RetrievalResult) else None
    return from_hits(hits, cos, ref_hits, n_boot, emb)


def from_hits(hits: torch.Tensor, cosines: torch.Tensor | None = None,
              reference_hits: torch.Tensor | None = None, n_boot: int = 1000,
              embeddings: torch.Tensor | None = None) -> RetrievalResult:
    """A RetrievalResult from what ``score`` measures per text: hits, bool (N,), query i found
    document i; cosines (2N,) of each embedding to the reference's; reference_hits (N,) of
    the reference model, for the paired recall change. Used for shipped results
    (qlab.lm.ch12_results), which keep these instead of the embeddings."""
    hits = torch.as_tensor(hits, dtype=torch.bool)
    emb = torch.empty(0) if embeddings is None else embeddings
    res = RetrievalResult(float(hits.double().mean()), bootstrap_mean_ci(hits, n_boot),
                          hits, emb)
    if reference_hits is not None:
        diff = hits.double() - torch.as_tensor(reference_hits).double()  # (N,) -1 / 0 / +1
        res.recall_change = float(diff.mean())
        res.recall_change_ci = bootstrap_mean_ci(diff, n_boot)
    if cosines is not None:
        cos = torch.as_tensor(cosines, dtype=torch.float64)
        res.cosine, res.cosine_min = float(cos.mean()), float(cos.min())
        res.cosine_ci = bootstrap_mean_ci(cos, n_boot)
    return res
