"""Launch configurations of every kernel, defined once (like Triton tutorials' get_autotune_config).

A Config is a tile shape plus warps and pipeline stages. Each kernel has a short, explicit
list per batch-size bucket, so a decode step (M = 1) and a prefill (M = 4096) never share
a tile shape:

    bucket    M          W4A16                              FP8 (E4M3)
    decode    1          tensor-core GEMV, split-K (*)      swap-AB wgmma, 16 token columns
    small     2..16      swap-AB GEMM, 16 token columns     swap-AB, 16 token columns
    medium    17..128    swap-AB GEMM, 64-128 columns       swap-AB, 64-128 columns
    large     > 128      swap-AB GEMM, 128 columns          grouped (L2-swizzled) 128x128 tiles

(*) mma.sync on the decode layout (kernels/w4a16.py), 32 rows per warp; where that layout
does not apply (w4a16.groups_per_step is None), the plain CUDA-core GEMV on the plain layout
(GEMV_PLAIN, one config).

The FIRST config of each list is the default: what runs when nothing is timed (the CPU
interpreter, ahead-of-time builds, QLAB_AUTOTUNE=0). On a GPU, `choose` times every config
of the bucket once per (kernel, bucket, M rounded up to a power of two, N, K, dtype, and the
W4A16 group size or the FP8 fast_accum) key with triton.testing.do_bench and keeps the
fastest; `chosen()` shows what each key picked. The lists are small on purpose: a GPU
session has minutes, not hours.

Split-K: when the output tiles alone would leave SMs idle (the W4A16 decode GEMV of a
4096 x 4096 layer has 32 row blocks of 128 rows for 132 SMs), the K loop is split over
`split_k` programs per tile and the partial sums are added in a fixed order (see
kernels/_tiles.py). `split_k_for` picks the smallest power of two that gives at least
TARGET_CTAS_PER_SM programs per SM.
"""

from __future__ import annotations

import contextlib
import math
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch
import triton
import triton.testing

from qlab.kernels import _backend, _tiles

__all__ = [
    "Config",
    "Launch",
    "CONFIGS",
    "M_BUCKETS",
    "m_bucket",
    "configs_for",
    "split_k_for",
    "device_sms",
    "choose",
    "chosen",
    "recording",
    "autotune_enabled",
]

H100_SMS = 132  # H100 SXM and H200: the SM count assumed when there is no GPU to ask
TARGET_CTAS_PER_SM = 2  # programs per SM a split-K launch aims for (latency hiding)
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Config:
    """One launch configuration. block_m is the token (M) side of a tile, block_n the
    output-feature (N) side, block_k the reduction step; group_m is the grouped tile
    order (group_m row tiles walk the same weight tiles while they are in L2)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Launch:
    """One kernel launch, fully decided: calling it runs `kernel[grid](*args, **meta)`.
    The wrappers build these; qlab.kernels.compile_for compiles the same ones ahead of time."""

    kernel: triton.runtime.JITFunction
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # tl.constexpr values plus num_warps
    config: Config | None = None

    def __call__(self) -> None:
        if _LOG is not None:
            _LOG.append(self)
        try:
            self.kernel[self.grid](*self.args, **self.meta)
        except BaseException:
            with contextlib.suppress(RuntimeError):  # a dead CUDA context cannot be reset
                _tiles.reset_counters()  # an aborted launch leaves no split-K counter dirty
            raise

    def describe(self) -> dict:
        """Kernel name, grid and config: what a benchmark row records about a launch."""
        name = getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__
        config = self.config.as_dict() if self.config else None
        return {"kernel": name, "grid": list(self.grid), "config": config}


_LOG: list[Launch] | None = None


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Collect every Launch run inside the block (the benchmark records what ran)."""
    global _LOG
    outer, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = outer


# (upper bound on M, bucket name), in order
M_BUCKETS: tuple[tuple[float, str], ...] = (
    (1, "decode"),
    (16, "small"),
    (128, "medium"),
    (math.inf, "large"),
)

C = Config
_FP8_SWAP_AB = (
    C(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=5),
    C(block_m=16, block_n=128, block_k=128, num_warps=8, num_stages=4),
)
CONFIGS: dict[tuple[str, str], tuple[Config, ...]] = {
    # W4A16 decode: the tensor-core GEMV on the decode layout (kernels/w4a16.py). One warp
    # per 32 rows (block_n = 32 * num_warps), 128 of K per step: 64 bytes of weights per
    # thread per step, straight into registers (no shared memory, so no stages).
    ("w4a16", "decode"): (
        C(block_m=1, block_n=128, block_k=128, num_warps=4, num_stages=1),
        C(block_m=1, block_n=64, block_k=128, num_warps=2, num_stages=1),
        C(block_m=1, block_n=256, block_k=128, num_warps=8, num_stages=1),
    ),
    # W4A16 GEMM, swap-AB: block_n output features are the 64-row side of wgmma (one
    # warpgroup per 64), block_m tokens the narrow side.
    ("w4a16", "small"): (
        C(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
        C(block_m=16, block_n=128, block_k=64, num_warps=8, num_stages=4),
    ),
    ("w4a16", "medium"): (
        C(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4),
        C(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    ),
    # (256 tokens x 128 features spills 16 bytes per thread: dropped, see test_kernel_aot.py)
    ("w4a16", "large"): (
        C(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
        C(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    ),
    # FP8, swap-AB below 129 tokens: E4M3 weights on the 64-row side of wgmma (decode and
    # small share one list: 16 tokens is the narrowest wgmma side either way).
    ("fp8", "decode"): _FP8_SWAP_AB,
    ("fp8", "small"): _FP8_SWAP_AB,
    ("fp8", "medium"): (
        C(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4),
        C(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    ),
    # FP8 large M: tokens on the 64-row side again, grouped tile order for L2 reuse. One
    # config: every 256-wide tile tried spills in the precise mode (255 registers, 144-240
    # spilled bytes per thread), and 256 x 128 serialises its precise-mode wgmmas (ptxas C7514).
    ("fp8", "large"): (C(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4),),
}
del C


# The plain-layout GEMV (W4A16 at M = 1 without the decode layout, e.g. K = 192): block_n
# rows x block_k / 2 packed bytes per step, copied with cp.async of 4 and 8 bytes per thread at
# g = 64 (TinyLM's 768 x 192: compile_for's global_load_widths; docs/KERNELS.md).
GEMV_PLAIN = Config(block_m=1, block_n=32, block_k=128, num_warps=4, num_stages=4)


def m_bucket(m: int) -> str:
    """The batch-size bucket of M tokens: "decode", "small", "medium" or "large"."""
    for upper, name in M_BUCKETS:
        if m <= upper:
            return name
    raise AssertionError("unreachable: the last bucket is unbounded")


def configs_for(kernel: str, m: int) -> tuple[Config, ...]:
    """The candidate configs of `kernel` ("w4a16" or "fp8") for M tokens; [0] is the default."""
    key = (kernel, m_bucket(m))
    if key not in CONFIGS:
        kernels = sorted({k for k, _ in CONFIGS})
        raise KeyError(f"no configs for kernel {kernel!r}; known: {', '.join(kernels)}")
    return CONFIGS[key]


def device_sms() -> int:
    """SMs of the GPU kernels launch on; an H100's 132 when there is no GPU (the interpreter
    then takes the same split-K decisions a Hopper GPU would)."""
    if _backend.HAS_CUDA and not _backend.INTERPRET:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return H100_SMS


def split_k_for(tiles: int, k_steps: int, sms: int) -> int:
    """Smallest power-of-two split of the K loop that gives `tiles` output tiles at least
    TARGET_CTAS_PER_SM programs per SM, dividing the k_steps K tiles evenly (1 = no split)."""
    split = 1
    while (
        tiles * split < TARGET_CTAS_PER_SM * sms
        and split * 2 <= MAX_SPLIT_K
        and k_steps % (split * 2) == 0
    ):
        split *= 2
    return split


# ----------------------------------------------------------------------------- autotuning
_CHOSEN: dict[tuple, Config] = {}


def autotune_enabled() -> bool:
    """Time the candidate configs? Only natively on a GPU, and not with QLAB_AUTOTUNE=0."""
    native = _backend.HAS_CUDA and not _backend.INTERPRET
    return native and os.environ.get("QLAB_AUTOTUNE", "1").strip() not in ("0", "false", "off")


def choose(kernel: str, m: int, key: tuple, launch: Callable[[Config], object]) -> Config:
    """The config `kernel` uses for M tokens and `key` (shape, dtype, ...): the fastest of the
    bucket's list when autotuning, else the first. `launch(config)` runs the kernel once.
    Decided once per (kernel, bucket, M rounded up to a power of two, *key)."""
    full_key = (kernel, m_bucket(m), triton.next_power_of_2(m), *key)
    if full_key not in _CHOSEN:
        candidates = configs_for(kernel, m)
        best = candidates[0]
        if autotune_enabled() and len(candidates) > 1:
            times = {}
            for c in candidates:
                try:
                    times[c] = triton.testing.do_bench(lambda c=c: launch(c), warmup=5, rep=20)
                except triton.runtime.errors.OutOfResources:  # e.g. shared memory of a smaller GPU
                    continue
            best = min(times, key=times.get) if times else best
        _CHOSEN[full_key] = best
    return _CHOSEN[full_key]


def chosen() -> dict[tuple, Config]:
    """Every config picked so far, keyed by (kernel, bucket, M rounded up to a power of two,
    *shape key): the visible record of what autotuning (or the default) chose."""
    return dict(_CHOSEN)
