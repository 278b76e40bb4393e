"""Input handling shared by every qlab entry point: one place for the rules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def as_float32(x, what: str = "x") -> torch.Tensor:
    """Torch tensor or numpy array -> contiguous float32 torch tensor (a copy when needed).

    fp16 / bf16 / fp64 inputs are converted to float32 (qlab computes in fp32).
    Integer and bool inputs are refused: quantizing codes again is almost always a bug.
    """
    if isinstance(x, np.ndarray) or np.isscalar(x) or isinstance(x, (list, tuple)):
        x = torch.as_tensor(np.asarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor or numpy array, got {type(x).__name__}")
    if not (x.is_floating_point()):
        raise TypeError(
            f"{what} has dtype {x.dtype}; qlab quantizes floating-point data. "
            f"Convert first, e.g. x.float()"
        )
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{what} is already float8 ({x.dtype}); convert to float32 first")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous()


def check_finite(x: torch.Tensor, scheme_name: str) -> None:
    """Refuse NaN/inf for schemes whose scale rule has no defined answer for them."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):  # one cheap pass screens the rest
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise ValueError(
            f"x has {int(bad.sum())} NaN/inf value(s); scheme {scheme_name!r} has no defined "
            "result for them (one inf would set the scale of its whole group). "
            "Clean the input (torch.nan_to_num) or use an MX scheme, where a NaN/inf "
            "gives its block a NaN scale (OCP MX v1.0)."
        )


@contextmanager
def torch_threads(n: int, deterministic: bool | None = None) -> Iterator[None]:
    """Run torch on n threads inside the block (and, when given, with deterministic
    algorithms on or off), then restore what was set before.

    n = 1 for loops of small ops (a GPTQ column, a GGUF block, a widget update): with
    several threads each op waits at a barrier for every thread, and on a busy machine
    one descheduled thread turns a microsecond op into milliseconds. Training runs pin
    their thread count so that a run is reproducible bit for bit."""
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(n)
    if deterministic is not None:
        torch.use_deterministic_algorithms(deterministic)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])
