"""The shipped GPTQ baselines of notebook 14 come back from their script."""

from qlab.lm import quality as Q
from qlab.qat import QuantLinear
from qlab.qat.baselines import GPTQ_RUNS, gptq_baseline, load_baseline


def test_shipped_baselines_load_and_match_their_recipe():
    assert sorted(GPTQ_RUNS) == ["gptq_w2g64", "gptq_w3g64", "gptq_w4g64"]
    for name, recipe in GPTQ_RUNS.items():
        model, meta = load_baseline(name)
        assert (meta["method"], meta["weights"], meta["group"]) == ("gptq", recipe.weights, 64)
        lin = model.blocks[2].mlp.fc2
        assert isinstance(lin, QuantLinear) and lin.qweight.scheme.name == recipe.weights


def test_the_script_reproduces_a_shipped_baseline():
    """GPTQ is deterministic for one CPU, torch build and thread count (1), but another CPU's
    BLAS sums in another order, and GPTQ's error feedback turns a last-bit difference into
    another code that then moves the rest of its row: on an AMD EPYC the first three layers
    of the int4 baseline came back bit for bit, later layers differed in up to 25 % of their
    codes, and the model's KL to float within 0.2 % (RTN's is 6x larger). So the first layer
    (calibrated on the float model's own inputs) must agree in 99 % of its codes (other
    calibration text moves 17 % of them) and the model's KL lie within 2 % of the shipped one's
    (a change in chapter 13's GPTQ or its calibration shows up here: then re-run
    `python -m qlab.qat.baselines`)."""
    shipped, _ = load_baseline("gptq_w4g64")
    fresh, _ = gptq_baseline("int4", 64)
    first = "blocks.0.attn.qkv"
    same = shipped.get_submodule(first).qweight.codes == fresh.get_submodule(first).qweight.codes
    assert same.float().mean() >= 0.99
    windows = Q.validation_windows(8, 256)
    ref = Q.logits(Q.load_model(), windows)
    kl_shipped = Q.compare(ref, Q.logits(shipped, windows), windows).kl
    kl_fresh = Q.compare(ref, Q.logits(fresh, windows), windows).kl
    assert abs(kl_fresh - kl_shipped) <= 0.02 * kl_shipped, (kl_fresh, kl_shipped)
