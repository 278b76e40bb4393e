"""qlab.lm.retrieval: the pairs, the split, recall@1 and its paired change."""

import math

import pytest
import torch

from qlab.lm import retrieval


def test_pairs_are_unique_sentences_and_splits_disjoint():
    pairs = retrieval.all_pairs()
    assert len(pairs) > 1000
    queries, docs = [q for q, _ in pairs], [d for _, d in pairs]
    assert len(set(queries)) == len(queries) and len(set(docs)) == len(docs)
    assert all(q[-1] in ".!?" and len(q) >= retrieval.MIN_QUERY_CHARS for q in queries)
    assert all(d[0].isupper() and len(d) >= retrieval.MIN_DOC_CHARS for d in docs)
    task = retrieval.RetrievalTask.build(64)
    assert task.queries == retrieval.RetrievalTask.build(64).queries  # deterministic
    calib = retrieval.calibration_texts(64)
    assert len(calib) == 64 and not any(q in c for q in task.queries for c in calib)
    with pytest.raises(ValueError, match="n must be"):
        retrieval.RetrievalTask.build(len(pairs))


def test_score_counts_hits_and_pairs_the_change():
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=1)
    perfect = torch.cat([q, q])  # every document equals its query
    r = retrieval.score(perfect, 8)
    assert r.recall_at_1 == 1.0 and r.hits.all() and math.isnan(r.cosine)
    swapped = torch.cat([q, q[[1, 0, 2, 3, 4, 5, 6, 7]]])  # documents 0 and 1 exchanged
    s = retrieval.score(swapped, 8, r)
    assert s.hits.tolist() == [False, False] + [True] * 6 and s.recall_at_1 == 0.75
    assert s.recall_change == -0.25 and s.recall_change_ci[1] <= 0
    assert s.cosine < 1.0 and s.cosine_min < 0.9
    same = retrieval.score(perfect, 8, r)
    assert same.recall_change == 0.0 and same.recall_change_ci == (0.0, 0.0)
    assert same.cosine == pytest.approx(1.0) and "recall@1 1.000" in same.row()
    cos_only = retrieval.score(swapped, 8, r.embeddings)  # a tensor: the cosine alone
    assert cos_only.cosine == s.cosine and math.isnan(cos_only.recall_change)
    assert "change" not in cos_only.row() and "cosine" in cos_only.row()
    with pytest.raises(ValueError, match="same task"):
        retrieval.score(perfect[:10], 5, r)


def test_from_hits_rebuilds_what_score_measured():
    g = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=1)
    ref = retrieval.score(torch.cat([q, q]), 8)
    noisy = torch.nn.functional.normalize(torch.cat([q, q]) + 0.6 * torch.randn(16, 16,
                                                                                generator=g), dim=1)
    s = retrieval.score(noisy, 8, ref)
    cos = (noisy.double() * ref.embeddings.double()).sum(dim=1)
    r = retrieval.from_hits(s.hits, cos, ref.hits)
    for field in ("recall_at_1", "recall_ci", "recall_change", "recall_change_ci", "cosine",
                  "cosine_ci", "cosine_min"):
        assert getattr(r, field) == getattr(s, field), field
    assert torch.equal(r.hits, s.hits) and r.embeddings.numel() == 0
