"""Notebook 13's precomputed results, and the script that makes them.

    python -m qlab.ptq.ch13_results            # ~10 min on 2 cores; rewrites both files

Twenty-one sequential calibrations (RTN, AWQ's scale search, GPTQ, GPTQ + act_order at int4
and int3, on TinyLM and on MiniLM, and five calibration-set sizes of GPTQ int3 on TinyLM) and
their evaluations take minutes, over notebook 13's 60 s budget, so they are shipped like
TinyLM's checkpoint:

    ch13_results.json          the tables: TinyLM perplexity / KL / flip rate and MiniLM
                               retrieval / embedding cosine, with 95 % bootstrap intervals,
                               relative layer errors, calibration seconds; a calibration-
                               set-size sweep; MiniLM's per-query hits (float32's and each
                               row's) and the paired recall change they give
    tinylm_gptq_int4_g64.pt    the GPTQ int4 g64 TinyLM as packed codes + fp16 scales: the
                               weights notebook 13 runs through the W4A16 Triton kernel

tests/ptq/test_calibrate.py recomputes a TinyLM row, a MiniLM row and the GPTQ weights, and
compares.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from qlab.lm import minilm, retrieval  # chapter 12's encoder and its retrieval task
from qlab.lm import quality as Q
from qlab.packing import pack_int4, unpack_int4
from qlab.ptq import calibrate as C
from qlab.quantize import QTensor
from qlab.schemes import get_scheme

HERE = Path(__file__).parent
RESULTS = HERE / "ch13_results.json"
GPTQ_WEIGHTS = HERE / "tinylm_gptq_int4_g64.pt"

VARIANTS = (("rtn", False), ("awq", False), ("gptq", False), ("gptq", True))  # (method, act)
SCHEMES = ("int4", "int3")
TINYLM = {"group_size": 64, "calib_windows": 32, "eval_windows": 64}  # K = 192: not 128
CALIB_SIZES = (1, 4, 16, 32, 64)  # windows of 256 training bytes, GPTQ int3
MINILM = {"group_size": 128, "calib_texts": 64, "eval_pairs": 128}


def _ci(pair) -> list[float]:
    return [float(pair[0]), float(pair[1])]


def _bits(hits: torch.Tensor) -> str:
    """Per-query hits as a string of 0 / 1 (query i found its document)."""
    return "".join("1" if h else "0" for h in hits.tolist())


def tinylm_row(base, ref, windows, method: str, act_order: bool, scheme: str,
               calib: torch.Tensor) -> tuple[dict, C.Calibrated]:
    """One calibration of TinyLM, measured on the validation windows."""
    r = C.quantize_model(base, method, scheme, TINYLM["group_size"], calib=calib,
                         act_order=act_order, progress=False)
    c = Q.compare(ref, Q.logits(r.model, windows), windows)
    row = {"method": method, "act_order": act_order, "scheme": scheme,
           "calib_windows": len(calib), "ppl": c.ppl, "ppl_change": c.ppl_change,
           "ppl_change_ci": _ci(c.ppl_change_ci), "kl": c.kl, "kl_ci": _ci(c.kl_ci),
           "flip_rate": c.flip_rate, "flip_rate_ci": _ci(c.flip_rate_ci),
           "rel_error_mean": sum(r.rel_errors.values()) / len(r.rel_errors),
           "rel_errors": r.rel_errors, "seconds": r.seconds}
    return row, r


def tinylm_results() -> dict:
    base = Q.load_model()
    windows = Q.validation_windows(TINYLM["eval_windows"])
    ref = Q.logits(base, windows)
    calib = C.calibration_windows(TINYLM["calib_windows"])
    rows = []
    for scheme in SCHEMES:
        for method, act in VARIANTS:
            row, r = tinylm_row(base, ref, windows, method, act, scheme, calib)
            rows.append(row)
            print(f"TinyLM {method}{'+act' if act else ''} {scheme}: KL {row['kl']:.4f}")
            if (method, act, scheme) == ("gptq", False, "int4"):
                save_gptq_weights(r.qtensors)
    sweep = [tinylm_row(base, ref, windows, "gptq", False, "int3",
                        C.calibration_windows(n))[0] for n in CALIB_SIZES]
    return {**TINYLM, "ppl_ref": Q.perplexity(ref, windows), "rows": rows,
            "calib_sweep": sweep}


def minilm_row(base, task, ref, inputs, method: str, act_order: bool, scheme: str) -> dict:
    """One calibration of MiniLM, measured on the retrieval pairs against float32's `ref`."""
    r = C.quantize_model(base, method, scheme, MINILM["group_size"], inputs=inputs,
                         act_order=act_order, progress=False)
    e = task.evaluate(r.model, ref)
    return {"method": method, "act_order": act_order, "scheme": scheme,
            "recall": e.recall_at_1, "recall_ci": _ci(e.recall_ci),
            "hits": _bits(e.hits), "recall_change": e.recall_change,
            "recall_change_ci": _ci(e.recall_change_ci),
            "cosine": e.cosine, "cosine_ci": _ci(e.cosine_ci),
            "rel_error_mean": sum(r.rel_errors.values()) / len(r.rel_errors),
            "seconds": r.seconds}


def minilm_setup():
    """(MiniLM, its retrieval task, float32's evaluation, the calibration-input capturer)."""
    base = minilm.load()
    task = retrieval.RetrievalTask.build(MINILM["eval_pairs"])
    ref = task.evaluate(base)
    batches = [ids for _, ids in minilm.length_batches(
        retrieval.calibration_texts(MINILM["calib_texts"]), 64)]
    return base, task, ref, C.MiniLMInputs(batches)


def minilm_results() -> dict:
    base, task, ref, inputs = minilm_setup()
    rows = []
    for scheme in SCHEMES:
        for method, act in VARIANTS:
            row = minilm_row(base, task, ref, inputs, method, act, scheme)
            rows.append(row)
            print(f"MiniLM {method}{'+act' if act else ''} {scheme}: "
                  f"recall {row['recall']:.3f}, cosine {row['cosine']:.4f}")
    return {**MINILM, "recall_ref": ref.recall_at_1, "recall_ref_ci": _ci(ref.recall_ci),
            "hits_ref": _bits(ref.hits), "rows": rows}


def save_gptq_weights(qtensors: dict[str, QTensor], path: Path = GPTQ_WEIGHTS) -> None:
    """int4 codes packed two per byte (qlab.pack_int4) + fp16 scales, per layer."""
    torch.save({name: {"packed": pack_int4(qt.codes), "scales": qt.scales,
                       "group_size": qt.granularity} for name, qt in qtensors.items()}, path)


def load_gptq_weights(path: Path = GPTQ_WEIGHTS) -> dict[str, QTensor]:
    """The shipped GPTQ int4 g64 TinyLM weights as QTensors, by layer name."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return {name: QTensor(codes=unpack_int4(d["packed"], signed=True), scales=d["scales"],
                          zero_points=None, scheme=get_scheme("int4"),
                          granularity=int(d["group_size"])) for name, d in saved.items()}


def gptq_tinylm() -> tuple[torch.nn.Module, dict[str, QTensor]]:
    """(TinyLM with the shipped GPTQ int4 g64 weights, those weights as QTensors)."""
    qts = load_gptq_weights()
    model = Q.load_model()
    layers = dict(model.named_modules())
    with torch.no_grad():
        for name, qt in qts.items():
            layers[name].weight.copy_(qt.dequantize())
    return model, qts


def load_results(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text())


def main() -> None:
    # One thread: the calibrations are many small ops, and on a shared machine each op of a
    # multi-threaded torch waits for every thread (10-100x slower); on an idle machine the
    # difference is small. The numbers do not depend on it.
    torch.set_num_threads(1)
    start = time.perf_counter()
    out = {"tinylm": tinylm_results(), "minilm": minilm_results()}
    out["meta"] = {"torch": torch.__version__, "threads": 1,
                   "seconds": time.perf_counter() - start,
                   "made_by": "python -m qlab.ptq.ch13_results"}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS} and {GPTQ_WEIGHTS} in {out['meta']['seconds']:.0f} s")


if __name__ == "__main__":
    main()
