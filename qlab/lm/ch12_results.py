"""Notebook 12's MiniLM measurements, precomputed, and the script that makes them.

    python -m qlab.lm.ch12_results          # rewrites ch12_results.json

Each row is one recipe of ``qlab.lm.outliers`` applied to every linear layer of MiniLM,
measured on chapter 12's retrieval task (64 pairs). The fourteen rows take about two minutes
of CPU (112 s of user time, measured; ten minutes of wall time on a busy 2-core machine),
more than the chapter's 60 s budget, so their per-text measurements are shipped, like
TinyLM's checkpoint, and the notebook rebuilds the results (intervals included) with
``retrieval.from_hits``. Stored per recipe: the hits of the 64 queries, the cosine of each
of the 128 embeddings to float32's, and the mean cosine on the 64 CALIBRATION texts (what
SmoothQuant's alpha is chosen by: never the evaluation texts).
Everything depends only on the shipped weights, the corpus and qlab's code.

tests/lm/test_ch12_results.py recomputes rows and compares; notebook 12 recomputes two.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path

import torch

from qlab._tensor import torch_threads
from qlab.lm import minilm, retrieval
from qlab.lm.outliers import Recipe, quantize_model

HERE = Path(__file__).parent
RESULTS = HERE / "ch12_results.json"
N_PAIRS = 64  # evaluation pairs of the retrieval task
N_CALIB = 64  # calibration paragraphs (statistics, and SmoothQuant's choice of alpha)
MAX_LENGTH = 64  # tokens per calibration text, as in the notebook
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)

RECIPES: dict[str, Recipe] = {
    "W8A8 per-tensor": Recipe(acts="int8", act_granularity="tensor"),
    "W8A8 per-token": Recipe(acts="int8", act_granularity="token"),
    "LLM.int8()": Recipe(int8_threshold=6.0),
    **{f"SmoothQuant a={a}": Recipe(acts="int8", act_granularity="tensor", smooth_alpha=a)
       for a in ALPHAS},
    "Hadamard + W8A8 per-tensor": Recipe(acts="int8", act_granularity="tensor",
                                         rotation="hadamard"),
    "W4A4 per-token": Recipe(weights="int4", acts="int4"),
    "W4A4 + random rotation": Recipe(weights="int4", acts="int4", rotation="random"),
    "W4A4 + Hadamard": Recipe(weights="int4", acts="int4", rotation="hadamard"),
    "NVFP4 (W4A4)": Recipe(weights="nvfp4", acts="nvfp4", act_granularity=None),
    "MXFP4 (W4A4)": Recipe(weights="mxfp4", acts="mxfp4", act_granularity=None),
}


def calibration_stats(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{linear name: (K,)} max |x| per input channel on the calibration texts."""
    return minilm.input_absmax(model, retrieval.calibration_texts(N_CALIB),
                               max_length=MAX_LENGTH)


def measure(model, recipe: Recipe, stats, task: retrieval.RetrievalTask,
            ref: retrieval.RetrievalResult, calib_ref: torch.Tensor) -> dict:
    """One recipe: {"hits": "0110...", "cosines": [...], "calib_cosine": float}.

    Computed on one thread: the fp32 sums of a matmul depend on how many threads split
    them, and an 8- or 4-bit code that sits at a rounding boundary flips with the last bit
    of its input, so a row measured on two threads can differ from one measured on one
    (seen: a cosine 0.003 apart for one text under SmoothQuant)."""
    with torch_threads(1):
        q = quantize_model(model, recipe, stats)
        r = task.evaluate(q, ref)
        calib = q.embed(retrieval.calibration_texts(N_CALIB), max_length=MAX_LENGTH)
    cos = (r.embeddings.double() * ref.embeddings.double()).sum(dim=1)
    calib_cos = float((calib.double() * calib_ref.double()).sum(dim=1).mean())
    return {"hits": "".join("1" if h else "0" for h in r.hits.tolist()),
            "cosines": cos.tolist(), "calib_cosine": calib_cos}


def compute(names=None) -> dict:
    """{recipe name: measure(...)} for ``names`` (default: every recipe)."""
    model = minilm.load()
    task = retrieval.RetrievalTask.build(N_PAIRS)
    ref = task.evaluate(model)
    calib_ref = model.embed(retrieval.calibration_texts(N_CALIB), max_length=MAX_LENGTH)
    stats = calibration_stats(model)
    rows = {}
    for name in names or RECIPES:
        rows[name] = measure(model, RECIPES[name], stats, task, ref, calib_ref)
        print(f"{name:28s} cosine {sum(rows[name]['cosines']) / 2 / N_PAIRS:.4f}", flush=True)
    return rows


@lru_cache(maxsize=1)
def load_rows(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text())["rows"]


def result(name: str, reference: retrieval.RetrievalResult) -> retrieval.RetrievalResult:
    """The shipped row ``name`` as a RetrievalResult against the float32 ``reference``."""
    row = load_rows()[name]
    hits = torch.tensor([c == "1" for c in row["hits"]])
    return retrieval.from_hits(hits, torch.tensor(row["cosines"]), reference.hits)


def calib_cosine(name: str) -> float:
    """Mean cosine to float32 on the calibration texts of the shipped row ``name``."""
    return load_rows()[name]["calib_cosine"]


def main() -> None:
    torch.set_num_threads(1)  # as measure() and the tests: the rows depend on the thread count
    start = time.perf_counter()
    out = {"rows": compute(),
           "meta": {"torch": torch.__version__, "seconds": time.perf_counter() - start,
                    "made_by": "python -m qlab.lm.ch12_results"}}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS} in {out['meta']['seconds']:.0f} s")


if __name__ == "__main__":
    main()
