"""The roofline model of a linear layer y = x @ W.T: bytes and FLOPs counted, pure functions.

A kernel moving B bytes and doing F FLOPs takes at least

    max(F / peak FLOP/s, B / bandwidth)

on a device (qlab.cost.Device: datasheet bandwidth and dense tensor-core peaks). Its
arithmetic intensity F / B against the ridge point peak / bandwidth says which bound
applies. This is a MODEL: it charges nothing for unpacking, launches or latency, so a
measured kernel whose data comes from HBM (kernels/bench.py reads a flush buffer before
every call) can only be slower; a warm L2 can report more bandwidth than HBM has.
kernels/bench.py puts it beside every measurement.

A third roof, instruction issue: an SM issues at most one warp instruction per clock from
each of its 4 schedulers, 128 thread-instructions per clock. On Hopper an SM also does 4,096
dense bf16 tensor-core FLOPs per clock, so the datasheet's bf16 peak fixes the clock and

    issue rate = SMs x 128 x clock = peak_bf16 / 32     thread-instructions per second

(H100 SXM: 989.4e12 / 32 = 30.9e12, 9.2 per byte of its 3.35 TB/s; H200: 6.4 per byte of
4.8 TB/s). Four schedulers of 32 threads per clock: the H100 whitepaper's SM diagram. The
bf16 peak implies 1.83 GHz; the datasheet's fp32 peak, 67e12 = SMs x 128 fp32 lanes x 2
FLOPs per clock, implies 1.98 GHz, which would give 10.0 and 7.0 per byte: the model takes
the conservative clock (notebook 09 computes both). A kernel whose main loop issues I SASS
instructions per byte it streams cannot stream faster than issue rate / I bytes per second
(issue_seconds; I from compile_for). Issue is not the only instruction roof: a Hopper
partition has 16 INT32 units, half its issue width, so integer and logic instructions
(LOP3, shifts, LEA, compares) take two clocks per warp if they all run there; notebook 09
counts them in the W4A16 GEMV's loop (about 5 % more clocks than issuing the whole loop).

Kernels counted (x is (M, K) bf16, W is (N, K), y is (M, N) bf16, group g):

    torch_bf16        F.linear in bf16 (cuBLAS)
    w4a16             qlab.kernels.w4a16_linear: int4 codes + an fp16 scale per group
    tinygemm          torch._weight_int4pack_mm: int4 + a bf16 scale AND zero per group
    dequant_bf16      dequantize to a bf16 W in memory, then F.linear: W crosses twice more
    fp8_gemm          qlab.kernels.fp8_scaled_mm: E4M3 x and W, fp32 scales, GEMM only
    torch_scaled_mm   torch._scaled_mm on the same operands, GEMM only
    fp8               qlab.kernels.fp8_linear: the fused activation quantizer + fp8_gemm
    torch_fp8         torch eager quantization (amax, x / s in fp32, cast) + _scaled_mm
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import qlab
from qlab.cost import Device

__all__ = [
    "PRECISION",
    "Bound",
    "device",
    "flops",
    "bytes_moved",
    "expected_seconds",
    "bound",
    "ridge_intensity",
    "model_rows",
    "stops_paying_m",
    "issue_rate",
    "issue_seconds",
]

GROUP_SIZE = 128
# dense, per SM: twice an A100 SM's 2,048 (H100 whitepaper: 2x the MMA rate clock for clock;
# A100: 108 SMs x 2,048 x 1.41 GHz = 312e12); H100 SXM: 132 SMs x 4,096 x 1.83 GHz = 989.4e12
HOPPER_BF16_FLOPS_PER_CLOCK = 4096
THREAD_INSTRUCTIONS_PER_CLOCK = 4 * 32  # per SM: 4 schedulers x 32 threads (H100 whitepaper)
# Which tensor-core peak bounds each kernel's arithmetic.
PRECISION = {
    "torch_bf16": "bf16",
    "w4a16": "bf16",
    "tinygemm": "bf16",
    "dequant_bf16": "bf16",
    "fp8_gemm": "fp8",
    "torch_scaled_mm": "fp8",
    "fp8": "fp8",
    "torch_fp8": "fp8",
}


@dataclass(frozen=True)
class Bound:
    """Which roof limits a kernel, and where a measured time sits under it."""

    kind: str  # "memory" | "compute"
    seconds: float  # the model's lower bound on the time
    intensity: float  # FLOPs per byte
    ridge: float  # FLOPs per byte where the two roofs meet
    percent: float | None = None  # of the bound achieved by a measured time


def device(name_or_device: str | Device) -> Device:
    """A qlab.cost.Device, by itself or by its qlab.cost.DEVICES name."""
    if isinstance(name_or_device, Device):
        return name_or_device
    if name_or_device not in qlab.cost.DEVICES:
        known = ", ".join(qlab.cost.DEVICES)
        raise KeyError(f"no datasheet figures for {name_or_device!r}; known: {known}")
    return qlab.cost.DEVICES[name_or_device]


def flops(m: int, n: int, k: int) -> int:
    """2 M N K: one multiply and one add per (m, n, k)."""
    return 2 * m * n * k


def bytes_moved(kernel: str, m: int, n: int, k: int, group_size: int = GROUP_SIZE) -> int:
    """Every byte the kernel(s) must read and write at least once (a lower bound on traffic:
    a split-K launch's fp32 workspace, written and read back, is not counted).

    bf16 activations and outputs are 2 bytes; packed int4 is K/2 bytes per row plus its
    group metadata; fp8 is 1 byte plus an fp32 scale per row or column.
    """
    x16, out16, groups = 2 * m * k, 2 * m * n, n * (k // group_size)
    fp8_gemm = m * k + n * k + 4 * (m + n) + out16  # fp8 x, fp8 W, scales, output
    if kernel == "torch_bf16":
        return x16 + 2 * n * k + out16
    if kernel == "w4a16":
        return x16 + n * k // 2 + 2 * groups + out16
    if kernel == "tinygemm":
        return x16 + n * k // 2 + 4 * groups + out16  # bf16 scale and bf16 zero per group
    if kernel == "dequant_bf16":  # read packed + scales, write W in bf16, then F.linear
        return (n * k // 2 + 2 * groups + 2 * n * k) + (x16 + 2 * n * k + out16)
    if kernel in ("fp8_gemm", "torch_scaled_mm"):
        return fp8_gemm
    if kernel == "fp8":  # one pass per row: read x, write fp8 x and its scale
        return fp8_gemm + x16 + m * k + 4 * m
    if kernel == "torch_fp8":  # amax (read x), x.float() / s (read x, write fp32), cast
        return fp8_gemm + x16 + (x16 + 4 * m * k) + (4 * m * k + m * k) + 8 * m
    raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(PRECISION)}")


def ridge_intensity(dev: str | Device, precision: str = "bf16") -> float:
    """FLOPs per byte at which a kernel turns from bandwidth- to compute-bound."""
    dev = device(dev)
    return dev.peak_flops[precision] / dev.bandwidth_bytes_per_s


def _peak(dev: Device, kernel: str) -> float | None:
    if kernel not in PRECISION:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(PRECISION)}")
    return dev.peak_flops.get(PRECISION[kernel])


def expected_seconds(kernel: str, m: int, n: int, k: int, dev: str | Device,
                     group_size: int = GROUP_SIZE) -> float:  # fmt: skip
    """The model's lower bound on the time: max(FLOPs / peak, bytes / bandwidth)."""
    return bound(kernel, m, n, k, dev, group_size=group_size).seconds


def bound(kernel: str, m: int, n: int, k: int, dev: str | Device, seconds: float | None = None,
          group_size: int = GROUP_SIZE) -> Bound:  # fmt: skip
    """Which roof applies to `kernel` at this shape, its time, and (given a measured
    `seconds`) the percent of that bound achieved: bandwidth or FLOP/s."""
    dev = device(dev)
    peak = _peak(dev, kernel)
    f, b = flops(m, n, k), bytes_moved(kernel, m, n, k, group_size)
    memory = b / dev.bandwidth_bytes_per_s
    compute = f / peak if peak else math.inf
    ridge = peak / dev.bandwidth_bytes_per_s if peak else math.inf
    kind = "compute" if compute > memory else "memory"
    t = max(memory, compute)
    percent = None if seconds is None else 100.0 * t / seconds
    return Bound(kind=kind, seconds=t, intensity=f / b, ridge=ridge, percent=percent)


def model_rows(dev: str | Device, shapes, ms, kernels=("torch_bf16", "w4a16", "fp8"),
               group_size: int = GROUP_SIZE) -> list[dict]:  # fmt: skip
    """The model over shapes (label, N, K) x M: time, TFLOP/s, GB/s, intensity, speedup
    over torch_bf16. Kernels without tensor cores for their precision are left out."""
    dev = device(dev)
    rows = []
    for label, n, k in shapes:
        for m in ms:
            base = expected_seconds("torch_bf16", m, n, k, dev, group_size)
            for kernel in kernels:
                if not _peak(dev, kernel):
                    continue  # e.g. no fp8 tensor cores on an A100
                b = bound(kernel, m, n, k, dev, group_size=group_size)
                nbytes = bytes_moved(kernel, m, n, k, group_size)
                rows.append(
                    {
                        "shape": label, "N": n, "K": k, "M": m, "kernel": kernel,
                        "time_s": b.seconds, "tflops": flops(m, n, k) / b.seconds / 1e12,
                        "gbps": nbytes / b.seconds / 1e9, "intensity": b.intensity,
                        "bound": b.kind, "speedup_vs_bf16": base / b.seconds,
                    }
                )  # fmt: skip
    return rows


def stops_paying_m(rows: list[dict], shape: str, kernel: str, gain: float = 1.1) -> int | None:
    """Smallest M at which `kernel` is less than `gain` x faster than bf16 (None: never)."""
    for row in sorted(rows, key=lambda r: r["M"]):
        if row["shape"] == shape and row["kernel"] == kernel and row["speedup_vs_bf16"] < gain:
            return row["M"]
    return None


def issue_rate(dev: str | Device) -> float:
    """Thread-instructions per second a Hopper-class device can issue: peak_bf16 / 32
    (its clock from the bf16 peak, 128 thread-instructions per SM per clock)."""
    dev = device(dev)
    clocks_times_sms = dev.peak_flops["bf16"] / HOPPER_BF16_FLOPS_PER_CLOCK
    return clocks_times_sms * THREAD_INSTRUCTIONS_PER_CLOCK


def issue_seconds(instructions_per_byte: float, nbytes: float, dev: str | Device) -> float:
    """The issue roof: time to issue the instructions that stream nbytes at
    `instructions_per_byte` SASS instructions per byte (a MODEL: perfect issue, no stalls)."""
    return instructions_per_byte * nbytes / issue_rate(dev)
