"""TinyLM: a small byte-level causal transformer with a KV cache.

A GPT-style decoder, written to be read: pre-norm blocks (LayerNorm -> attention ->
residual, LayerNorm -> MLP -> residual), learned absolute position embeddings, no
biases in the linear layers, and the output head tied to the byte embedding.

Every matrix multiply a quantizer cares about is an ``nn.Linear`` inside a block:

    attn.qkv  (d -> 3d)     attn.proj  (d -> d)
    mlp.fc1   (d -> 4d)     mlp.fc2    (4d -> d)

so weight-only and activation quantization can be applied to exactly those modules
(see ``qlab.lm.quality``). Keys and values pass through ``Attention.kv_transform``
(identity by default) before they are stored in the cache: that is the single place
where a per-token KV-cache quantizer is attached. ``Attention.qkv_transform`` (also None
by default) sees the queries and ALL cached keys/values right before attention reads
them, for schemes that need more than one token at a time (``qlab.kv``).

Shapes: B batch, T new tokens, S cached + new tokens, H heads, D head dim, C = H * D.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

QKVTransform = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
VOCAB_SIZE = 256  # byte-level: every byte value is a token, no tokenizer needed


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = VOCAB_SIZE
    block_size: int = 256  # longest context (positions 0..block_size-1)
    n_layer: int = 4
    n_head: int = 3  # head_dim 64: NF4 (64), MX (32) and NVFP4 (16) blocks fit in a head
    d_model: int = 192

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class KVCache:
    """Per-layer keys and values of the tokens seen so far.

    ``keys[i]`` / ``values[i]``: float tensors of shape (B, H, S, D) for layer i, or
    None before the first token. What is stored is what ``kv_transform`` returned, so a
    quantized cache holds (fake-)quantized values, exactly like a real int8/fp8 cache.
    """

    def __init__(self, n_layer: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer

    @property
    def length(self) -> int:
        """Tokens cached so far (read it before a forward pass: layers append in order)."""
        return self.layer_length(0)

    def layer_length(self, layer: int) -> int:
        k = self.keys[layer]
        return 0 if k is None else k.shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store new keys/values (B, H, T, D) for ``layer``; return all of them (B, H, S, D)."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # Applied to K and V (B, H, T, D) before they enter the cache / the attention.
        self.kv_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Applied to (q (B, H, T, D), k, v (B, H, S, D)) after the cache append, so it sees
        # every cached position (the T queries sit at S - T..S - 1); returns (q, k, v) for
        # this attention only, the cache keeps what kv_transform returned. See qlab.kv.
        self.qkv_transform: QKVTransform | None = None

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # shape: (B, T, C) -> (B, H, T, D)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.kv_transform is not None:
            k, v = self.kv_transform(k), self.kv_transform(v)
        past = 0
        if cache is not None:
            past = cache.layer_length(layer)  # not cache.length: earlier layers already appended
            k, v = cache.append(layer, k, v)
        if self.qkv_transform is not None:
            q, k, v = self.qkv_transform(q, k, v)
        S = k.shape[2]
        # Causal mask for T new queries at positions past..past+T-1 over S keys.
        # Plain math (not F.scaled_dot_product_attention) so a decode step and a full
        # forward run the same arithmetic and agree to float32 rounding.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, S)
        if T > 1:
            qpos = torch.arange(past, past + T, device=x.device)[:, None]
            kpos = torch.arange(S, device=x.device)[None, :]
            att = att.masked_fill(kpos > qpos, float("-inf"))
        y = att.softmax(dim=-1) @ v  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)
        # Applied to the GELU output (B, T, 4d) before fc2 (None: identity); QuaRot's online
        # Hadamard sits here (qlab.ptq.quarot), so fc2's input quantizers see its output.
        self.hidden_transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.hidden_transform is not None:
            h = self.hidden_transform(h)
        return self.fc2(h)


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), layer, cache)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyLMConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # None: the output head is tied to tok_emb; an untied nn.Linear (d -> vocab) replaces
        # it in qlab.ptq.quarot's folded copies. Not in linear_layers().
        self.head: nn.Linear | None = None
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx: int64 (B, T) byte ids -> float32 logits (B, T, vocab).

        With a ``cache``, idx holds the T tokens that follow the cached ones; their
        keys/values are appended to the cache.
        """
        B, T = idx.shape
        past = 0 if cache is None else cache.length
        if past + T > self.cfg.block_size:
            raise ValueError(
                f"{past + T} positions exceed block_size {self.cfg.block_size}; "
                "evaluate shorter windows or start a new cache"
            )
        pos = torch.arange(past, past + T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for i, block in enumerate(self.blocks):
            x = block(x, i, cache)
        if self.head is not None:
            return self.head(self.ln_f(x))
        return self.ln_f(x) @ self.tok_emb.weight.T  # tied output head

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.n_layer)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n_new: int) -> torch.Tensor:
        """Greedy decoding with the KV cache: (B, T) -> (B, T + n_new)."""
        cache = self.new_cache()
        logits = self(idx, cache)
        out = [idx]
        for i in range(n_new):
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            out.append(nxt)
            if i < n_new - 1:  # the last token's logits would go unused
                logits = self(nxt, cache)
        return torch.cat(out, dim=1)

    def linear_layers(self) -> dict[str, nn.Linear]:
        """The quantizable matmuls of the blocks, by name, e.g. ``blocks.0.attn.qkv``."""
        return {n: m for n, m in self.named_modules()
                if isinstance(m, nn.Linear) and n.startswith("blocks.")}

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def save_checkpoint(model: TinyLM, path, **meta) -> None:
    """fp32 state_dict + config + free-form metadata (loss, steps, time)."""
    torch.save({"config": asdict(model.cfg), "state_dict": model.state_dict(), "meta": meta}, path)


def load_checkpoint(path) -> tuple[TinyLM, dict]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = TinyLM(TinyLMConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model, ckpt["meta"]
