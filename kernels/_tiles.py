"""Pieces every GEMM-like kernel here shares: tile order, the split-K epilogue, its buffers.

Split-K, deterministically. With split_k > 1 the K loop of one output tile is shared by
split_k programs. Each writes its fp32 partial tile to a workspace, then counts itself in
on a per-tile counter; the program that arrives last adds the split_k partials in the
fixed order 0, 1, ..., split_k - 1 (so the result does not depend on which program
finished first), writes the output and resets the counter for the next launch:

    store partial[pid_k, tile]                       # fp32, every element of the tile
    barrier                                          # all threads' stores issued first
    arrived = atomic_add(counter[tile], 1)           # acq_rel, GPU scope
    if arrived == split_k - 1:                       # the last one in
        out[tile] = sum(partial[i, tile] for i in range(split_k))   # loads bypass L1 (.cg)
        counter[tile] = 0

One launch, no memset, no atomics on the data. The counters live in a per-device buffer
that is zero between launches; two launches using it must not run concurrently on
different CUDA streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tile_coords", "store_or_reduce", "split_k_buffers", "reset_counters"]


@triton.jit
def tile_coords(pid, num_rows, num_cols, GROUP: tl.constexpr):
    """Program id -> (row tile, column tile) in grouped order: GROUP row tiles sweep the
    column tiles together, so the column operand's tiles are reused while still in L2
    (Triton's matmul tutorial, "L2 cache optimizations"). GROUP = 1: row-major order."""
    if GROUP == 1:
        return pid // num_cols, pid % num_cols
    return tl.swizzle2d(pid // num_cols, pid % num_cols, num_rows, num_cols, GROUP)


@triton.jit
def store_or_reduce(
    acc,  # fp32 tile, any shape
    out_ptrs,  # pointers of the tile's outputs, acc's shape
    out_mask,  # which of them exist (ragged edges)
    ws_ptr,  # fp32 workspace (split_k, num_tiles, TILE)
    count_ptr,  # int32 counters (num_tiles,), zero between launches
    local,  # int32 offsets 0..TILE-1 of acc's elements, acc's shape
    tile,  # this tile's index
    num_tiles,
    pid_k,  # which part of K this program summed
    split_k,  # how many parts (1: no split)
    TILE: tl.constexpr,  # elements per tile
):
    """Write acc (cast to the output type), or reduce split_k partial tiles in a fixed order."""
    if split_k == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ws_ptr + (pid_k * num_tiles + tile) * TILE + local, acc)
        tl.debug_barrier()  # every thread of this program has issued its partial
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            for i in range(0, split_k):  # fixed order: the sum is deterministic
                part = ws_ptr + (i * num_tiles + tile) * TILE + local
                total += tl.load(part, cache_modifier=".cg")  # from L2, never a stale L1 line
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_k_buffers(
    split_k: int, num_tiles: int, tile_elems: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 workspace, int32 counters) for a split-K launch; tiny dummies when split_k == 1."""
    device = torch.device(device)
    if split_k == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, _counters(1, device)
    workspace = torch.empty(split_k * num_tiles * tile_elems, dtype=torch.float32, device=device)
    return workspace, _counters(num_tiles, device)


def reset_counters() -> None:
    """Zero every split-K counter. After a launch that did not finish (an exception inside
    the interpreter's grid, an interrupt), tiles stay counted in and the next launch would
    never write them; Launch calls this when a launch raises."""
    for counters in _COUNTERS.values():
        counters.zero_()


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters, kept per device (the kernels leave them at zero)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return _COUNTERS[device]
