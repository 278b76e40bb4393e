"""The PTQ baselines of notebook 14 that take more than a moment: GPTQ (chapter 13) at the bit
widths of the shipped QAT runs, saved like them (codes + fp16 scales).

    python -m qlab.qat.baselines            -> qlab/qat/gptq_w4g64.pt, gptq_w3g64.pt, gptq_w2g64.pt

Each is ``qlab.ptq.calibrate.quantize_model(tinylm, "gptq", weights, 64)``: sequential GPTQ
of the 16 block linears on its default calibration text (32 windows of 256 bytes from the
TRAINING split, seeded), 1 torch thread. Round-to-nearest needs no file: notebook 14
computes it. W4A4's GPTQ baseline is gptq_w4g64 with int4 activations per token, applied at
evaluation like every activation quantizer (qlab.lm.quality.quantize_activations).
tests/qat/test_baselines.py re-runs one: bit for bit on the CPU that wrote it; on another
CPU GPTQ passes last-bit differences on to later codes, so it compares the first layer's
codes and the model's KL to float.
"""

from __future__ import annotations

import argparse
import time

import torch

from qlab._tensor import torch_threads
from qlab.lm.model import TinyLM, load_checkpoint
from qlab.lm.train import CHECKPOINT
from qlab.ptq.calibrate import quantize_model
from qlab.qat.checkpoint import load_quantized, save_quantized
from qlab.qat.modules import with_qtensors
from qlab.qat.train import HERE, RUNS

GPTQ_RUNS = {f"gptq_{name}": r for name, r in RUNS.items() if r.acts is None}


def gptq_baseline(weights: str, group: int, base: TinyLM | None = None) -> tuple[TinyLM, dict]:
    """(TinyLM of QuantLinear layers holding GPTQ's QTensors, meta). 1 torch thread."""
    with torch_threads(1):
        base = load_checkpoint(CHECKPOINT)[0] if base is None else base
        t0 = time.time()
        cal = quantize_model(base, "gptq", weights, group, progress=False)
        meta = {"method": "gptq", "weights": weights, "group": group, "threads": 1,
                "seconds": round(time.time() - t0, 1), "torch": str(torch.__version__)}
        return with_qtensors(base, cal.qtensors), meta


def load_baseline(name: str) -> tuple[TinyLM, dict]:
    """A shipped GPTQ baseline (a key of GPTQ_RUNS, e.g. 'gptq_w3g64')."""
    if name not in GPTQ_RUNS:
        raise KeyError(f"no shipped baseline {name!r}; choose from {sorted(GPTQ_RUNS)}")
    return load_quantized(HERE / f"{name}.pt")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=sorted(GPTQ_RUNS))
    args = ap.parse_args(argv)
    for name in args.names:
        recipe = GPTQ_RUNS[name]
        model, meta = gptq_baseline(recipe.weights, recipe.group)
        save_quantized(model, HERE / f"{name}.pt", **meta)
        print(f"{name}: {meta}")


if __name__ == "__main__":
    main()
