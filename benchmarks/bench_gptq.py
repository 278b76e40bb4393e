"""Time GPTQ on one 4096 x 4096 layer against plain-torch RTN of the same layer, same run.

    python benchmarks/bench_gptq.py [--size 4096] [--repeat 3] [--group 128]

GPTQ is timed from a ready Hessian (the per-layer quantization cost; accumulating H is
part of the calibration forward pass, timed on its own line). RTN is the same scheme
(symmetric int4, fp16 group scales) written inline in torch. Goal (issue 14): GPTQ
within 20x of RTN. The Hessian comes from correlated synthetic inputs, 2 samples per
input feature, so that it is full rank like a real layer's.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_quantize import median_time, plain_torch_int4  # this folder: the same baseline

from qlab.ptq import gptq, hessian


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    n = args.size
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, n, generator=gen) * 0.02
    mix = torch.randn(n, n, generator=gen) / n**0.5 + torch.eye(n)
    x = torch.randn(2 * n, n, generator=gen) @ mix  # correlated inputs, (2n, n)
    print(f"{n}x{n} fp32, int4 g{args.group}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeat}")

    t0 = time.perf_counter()
    h = hessian(x)
    print(f"hessian of {2 * n} samples: {time.perf_counter() - t0:.2f} s (once, not in the ratio)")
    rtn = median_time(lambda: plain_torch_int4(w, args.group), args.repeat)
    ours = median_time(lambda: gptq(w, h, "int4", args.group), args.repeat)
    print(f"GPTQ {ours:.2f} s | plain-torch RTN {rtn:.3f} s | ratio {ours / rtn:.1f}x "
          "(goal: within 20x)")

    err = lambda w_hat: float(((x @ (w - w_hat).T) ** 2).mean())  # noqa: E731
    e_rtn, e_gptq = err(plain_torch_int4(w, args.group)), err(gptq(w, h, "int4", args.group)
                                                                .dequantize())
    print(f"layer output MSE: RTN {e_rtn:.3e}, GPTQ {e_gptq:.3e} ({e_gptq / e_rtn:.2f}x RTN)")


if __name__ == "__main__":
    main()
