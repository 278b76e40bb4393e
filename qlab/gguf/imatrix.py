"""The importance matrix: llama.cpp's data-aware rounding, collected here in plain torch.

llama-imatrix runs calibration text through the model and records, for every weight matrix
that multiplies activations in a transformer block (see below), the mean over tokens of
each input column's squared activation:

    imatrix[j] = mean over tokens t of x[t, j]^2          (x: the matmul's input)

That is the diagonal of X^T X / n: half the diagonal of the layer Hessian H = 2 X^T X / n
that GPTQ uses whole (chapter 13, qlab.ptq.hessian). AWQ ranks input channels by a related
statistic, the mean |x[t, j]| (qlab.ptq.awq.act_mean_abs), not the mean square. The
quantizer then picks scales (and, through them, rounding) that minimise
sum_j w_j (x_j - x_hat_j)^2 instead of the plain error, with weights that depend on the type
(ggml-quants.c, quantize_row_*_impl): w_j = imatrix[j] * sqrt(sigma^2 + x_j^2) for Q4_0,
Q4_1, Q5_0, Q5_1 (sigma^2 the mean of x^2 over the row) and Q3_K, Q4_K, Q5_K
(sigma^2 = 2 sum x^2 / 256 over the super-block); w_j = imatrix[j] for Q6_K; Q8_0 ignores
the imatrix. Columns that see large activations are reproduced more carefully. Nothing is
moved between columns (unlike GPTQ's error feedback) and no weights are rescaled (unlike
AWQ): only the search is weighted.

llama-imatrix (tools/imatrix/imatrix.cpp, collect_imatrix) records only the matrices whose
name starts with "blk." (and output.weight with --process-output): never token_embd, so
never a head tied to it. importance() records every nn.Linear, and its `head` argument
adds a statistic llama-imatrix does not produce.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


@torch.no_grad()
def importance(
    model: nn.Module, inputs: torch.Tensor | Iterable[torch.Tensor],
    head: dict[str, nn.Module] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """name -> (in_features,) float32 mean squared input activation, for every nn.Linear
    weight of `model` (keyed "<module>.weight", like state_dict), over the calls
    model(batch) for batch in inputs. head: weight name -> module whose OUTPUT is that
    weight's input (a tied output head, e.g. {"tok_emb.weight": model.ln_f} for TinyLM)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def record(key: str, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float64) ** 2
        sums[key] = sums.get(key, 0) + x2.sum(dim=0)
        counts[key] = counts.get(key, 0) + x2.shape[0]

    hooks = [
        m.register_forward_hook(lambda _m, args, _out, k=f"{n}.weight": record(k, args[0]))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    hooks += [
        m.register_forward_hook(lambda _m, _args, out, k=k: record(k, out))
        for k, m in (head or {}).items()
    ]
    try:
        for batch in [inputs] if isinstance(inputs, torch.Tensor) else inputs:
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    return {k: (sums[k] / counts[k]).to(torch.float32) for k in sums}
