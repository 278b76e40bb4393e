"""Time qlab's quantizers on a 4096 x 4096 fp32 matrix, against baselines run in the same process.

    python benchmarks/bench_quantize.py [--size 4096] [--repeat 5]

Prints, per scheme, the median time of fake-quantization; for int4 g128 the ratio to a
plain-torch fake-quantizer (the same math written inline); for FP8 the ratio of qlab's
encode to torch's native float8 cast. Targets (issue 3): FP8 encode within 3x of the
cast; MXFP4 / NVFP4 fake-quantization under 0.5 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qlab


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_torch_int4(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """The baseline: symmetric int4, groups along K, fp16 scales, inline torch (also the
    RTN baseline of bench_gptq.py)."""
    g = x.reshape(x.shape[0], -1, group)  # shape: (rows, K // group, group)
    s = (g.abs().amax(-1, keepdim=True) / 7).half().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.clamp(torch.round(g / s), -7, 7) * s).reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    print(f"{args.size}x{args.size} fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeat}")

    base = median_time(lambda: plain_torch_int4(x), args.repeat)
    ours = median_time(lambda: qlab.fake_quantize(x, "int4", 128), args.repeat)
    assert torch.equal(plain_torch_int4(x), qlab.fake_quantize(x, "int4", 128))
    print(f"int4 g128 fake-quantize: qlab {ours * 1e3:8.1f} ms | plain torch {base * 1e3:8.1f} ms"
          f" | ratio {ours / base:.2f}x")

    for name, tdtype in [("fp8_e4m3fn", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]:
        fmt = qlab.formats.get(name)
        like_torch = name == "fp8_e4m3fn"  # torch 2.13 saturates e4m3fn, overflows e5m2 to inf
        cast = median_time(lambda t=tdtype: x.to(t), args.repeat)
        same = median_time(lambda f=fmt, s=like_torch: f.encode(x, saturate=s), args.repeat)
        sat = median_time(lambda f=fmt: f.encode(x), args.repeat)
        gen = median_time(lambda f=fmt, s=like_torch: f.encode_generic(x, s), args.repeat)
        print(f"{name} encode vs torch cast {cast * 1e3:6.1f} ms: same semantics "
              f"{same / cast:.2f}x (target <= 3x) | saturating (qlab default) {sat / cast:.2f}x"
              f" | generic integer codec {gen / cast:.1f}x")

    print("fake-quantize per scheme (default granularity; int/fp8 per channel):")
    for scheme in qlab.SCHEME_NAMES:
        gran = "channel" if qlab.get_scheme(scheme).scale_rule in ("absmax", "minmax") else None
        t = median_time(lambda s=scheme, g=gran: qlab.fake_quantize(x, s, g), args.repeat)
        note = " (target < 0.5 s)" if scheme in ("mxfp4", "nvfp4") else ""
        print(f"  {scheme:12s} {t * 1e3:8.1f} ms{note}")


if __name__ == "__main__":
    main()
