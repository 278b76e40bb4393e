"""qlab's encoders against llama.cpp's own C quantizer (ggml-quants.c), bit for bit.

The reference bytes in data/llamacpp_reference.npz were written by llama.cpp's
quantize_q4_0 ... quantize_q6_K (compiled with strict IEEE float) on 12 rows of 512 weights
covering the edge cases (all-zero super-block and sub-block, constant blocks of both signs,
outliers, exact ties, subnormal and overflowing fp16 scales, sparse and one-sided rows), with
and without an importance matrix; make_llamacpp_reference.py regenerates them. gguf's Python
package cannot serve here: it has no K-quant or importance-matrix encoder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import qlab.gguf as G

REF = np.load(Path(__file__).parent / "data" / "llamacpp_reference.npz")
NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("imatrix", [False, True], ids=["reference", "imatrix"])
@pytest.mark.parametrize("name", NAMES)
def test_bytes_equal_llamacpp(name, imatrix):
    x = torch.from_numpy(REF["x"])
    im = torch.from_numpy(REF["imatrix"]) if imatrix else None
    ours = G.quantize(x, name, imatrix=im).data.numpy()
    ref = REF[name + ("_imatrix" if imatrix else "")]
    bad = np.nonzero((ours != ref).any(axis=1))[0]
    assert bad.size == 0, f"{name}: rows {bad.tolist()} differ from llama.cpp"


def test_the_importance_matrix_changes_the_rounding():
    """The reference bytes themselves: with an imatrix llama.cpp writes different blocks for
    every type but Q8_0 (which ignores it), so the test above checks two code paths."""
    for name in NAMES:
        differs = not np.array_equal(REF[name], REF[name + "_imatrix"])
        assert differs == (name != "Q8_0"), name
