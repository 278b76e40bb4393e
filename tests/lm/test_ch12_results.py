"""qlab.lm.ch12_results: the shipped MiniLM rows of notebook 12 are what qlab computes now."""

import pytest
import torch

from qlab._tensor import torch_threads
from qlab.lm import ch12_results as R
from qlab.lm import minilm, retrieval


def test_every_recipe_is_shipped_with_its_measurements():
    rows = R.load_rows()
    assert set(rows) == set(R.RECIPES) and len(rows) == 14  # the docstring's fourteen rows
    for name, row in rows.items():
        assert len(row["hits"]) == R.N_PAIRS and set(row["hits"]) <= {"0", "1"}, name
        assert len(row["cosines"]) == 2 * R.N_PAIRS and 0 < row["calib_cosine"] <= 1, name


@pytest.mark.parametrize("name", ["SmoothQuant a=0.75", "W4A4 + Hadamard"])
def test_shipped_rows_match_a_fresh_computation(name):
    model = minilm.load()
    task = retrieval.RetrievalTask.build(R.N_PAIRS)
    with torch_threads(1):  # as `python -m qlab.lm.ch12_results` computed them
        ref = task.evaluate(model)
        calib_ref = model.embed(retrieval.calibration_texts(R.N_CALIB), max_length=R.MAX_LENGTH)
        stats = R.calibration_stats(model)
    fresh = R.measure(model, R.RECIPES[name], stats, task, ref, calib_ref)
    shipped = R.load_rows()[name]
    assert fresh["hits"] == shipped["hits"]
    # fp32 sums may differ across CPUs in the last bits: far below the differences taught
    torch.testing.assert_close(torch.tensor(fresh["cosines"]), torch.tensor(shipped["cosines"]),
                               rtol=0, atol=1e-5)
    assert abs(fresh["calib_cosine"] - shipped["calib_cosine"]) < 1e-5
    rebuilt = R.result(name, ref)
    assert torch.equal(rebuilt.hits, torch.tensor([c == "1" for c in shipped["hits"]]))
