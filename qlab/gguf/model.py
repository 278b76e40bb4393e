"""A model through GGUF without a file: the weights a llama.cpp-style runtime would use."""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from qlab.gguf.types import GGUFTensor


def to_state_dict(tensors: Mapping[str, GGUFTensor]) -> dict[str, torch.Tensor]:
    """name -> float32 dequantized tensor (e.g. of qlab.gguf.load(path))."""
    return {k: t.dequantize() for k, t in tensors.items()}


@torch.no_grad()
def dequantized_model(model: nn.Module, tensors: Mapping[str, GGUFTensor]) -> nn.Module:
    """A copy of `model` whose parameters are the dequantized GGUF tensors (same names)."""
    out = copy.deepcopy(model)
    state = out.state_dict()
    for k, v in to_state_dict(tensors).items():
        state[k].copy_(v.reshape(state[k].shape))
    return out
