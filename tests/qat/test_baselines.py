"""The shipped GPTQ baselines of notebook 14 come back from their script, bit for bit."""

import torch

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
    """GPTQ is deterministic for a given torch build and thread count (1): a change in
    chapter 13's GPTQ or its calibration text shows up here (then re-run
    `python -m qlab.qat.baselines`)."""
    shipped, _ = load_baseline("gptq_w2g64")
    fresh, _ = gptq_baseline("int2", 64)
    for name, lin in shipped.linear_layers().items():
        other = fresh.get_submodule(name).qweight
        assert torch.equal(lin.qweight.codes, other.codes), name
        assert torch.equal(lin.qweight.scales, other.scales), name
