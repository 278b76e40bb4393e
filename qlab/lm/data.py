"""The shipped text corpus as byte tensors, split into train and validation.

``data/corpus.txt`` (~1 MB of ASCII English, see ``data/README.md``) is cut into
consecutive chunks of ``CHUNK_BYTES``; every ``VAL_EVERY``-th chunk (indices 9, 19,
29, ...) is held out for validation, the rest is training text. Interleaving keeps
both splits drawn from the same mix of modules while no validation byte is ever
trained on.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
CHUNK_BYTES = 16_384
VAL_EVERY = 10  # 10 % of the chunks are validation


@lru_cache(maxsize=1)
def load_splits() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): uint8 tensors of byte ids."""
    raw = torch.frombuffer(bytearray(CORPUS_PATH.read_bytes()), dtype=torch.uint8)
    chunks = raw.split(CHUNK_BYTES)
    val = [c for i, c in enumerate(chunks) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY - 1]
    return torch.cat(train), torch.cat(val)


def random_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x, y int64 (batch_size, block_size), y is x shifted by one byte.

    The window starts come from ``generator`` only, so a seeded generator gives the
    same batches on every machine.
    """
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(block_size + 1)[None, :]
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def eval_windows(data: torch.Tensor, n_windows: int, block_size: int) -> torch.Tensor:
    """The first ``n_windows`` non-overlapping windows of ``block_size + 1`` bytes,
    evenly spaced over ``data``: int64 (n_windows, block_size + 1). Deterministic."""
    span = block_size + 1
    n_max = len(data) // span
    if n_windows > n_max:
        raise ValueError(f"only {n_max} windows of {span} bytes fit in {len(data)} bytes")
    stride = n_max // n_windows
    starts = torch.arange(n_windows) * stride * span
    return data[starts[:, None] + torch.arange(span)[None, :]].long()


def encode(text: str) -> torch.Tensor:
    """str -> int64 (len,) byte ids (UTF-8)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids) -> str:
    """byte ids -> str (invalid UTF-8 shown as U+FFFD)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
