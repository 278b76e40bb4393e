"""Issue 24: a spec rule about memory, checked while the learner's function runs.

`fwht`'s spec forbids forming the n x n Hadamard matrix (the point of the fast transform is
O(n log n)). The task declares a SizeLimit (qlab/grading/tasks/ch12_outliers.py, F4): no
tensor (checked at every torch operation) and no Python allocation (numpy arrays, lists:
traced) may hold more than max(4 x the input's elements, 144). Matrix builders compute the
right values, so only the rule can fail them: on every seed, in `check` here and in `qlab
grade` (the hostile class of tests/grading/test_grading_hostile.py holds one).
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from qlab.grading import CheckFailed, _harness, check, get_task
from qlab.grading.registry import make_cases
from qlab.ptq import fwht as qlab_fwht
from qlab.ptq import hadamard

SEEDS = tuple(range(8))
RULE = "the spec forbids forming the n x n matrix"
HEADER = """
import math
import numpy as np
import torch

H12 = qlab_hadamard(12) * math.sqrt(12)  # the setup cell's +-1 matrix
"""
# the honest solution (solutions/12_outliers.ipynb): butterflies, and H12 for the 12 part
HONEST = """
def fwht(x):
    n = x.shape[-1]
    m = 12 if n % 12 == 0 else 1
    p = n // m
    y = x.reshape(-1, m, p).float()
    h = 1
    while h < p:
        pairs = y.reshape(y.shape[0], m, p // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(-1, m, p)
        h *= 2
    if m == 12:
        y = torch.einsum("ij,rip->rjp", H12, y)
    return (y / math.sqrt(n)).reshape(x.shape)
"""
# Sylvester's construction in torch, then one matmul: what a student writes first
MATRIX_FWHT = """
def fwht(x):
    n = x.shape[-1]
    m = 12 if n % 12 == 0 else 1
    h = torch.ones(1, 1)
    while h.shape[0] < n // m:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if m == 12:
        h = torch.kron(H12, h)
    return x @ h / math.sqrt(n)
"""
# the same in numpy only (no torch operation sees the matrix)
NUMPY_FWHT = """
def fwht(x):
    n = x.shape[-1]
    m = 12 if n % 12 == 0 else 1
    h = np.ones((1, 1))
    while h.shape[0] < n // m:
        h = np.block([[h, h], [h, -h]])
    if m == 12:
        h = np.kron(H12.numpy(), h)
    return torch.from_numpy((x.numpy() @ h / math.sqrt(n)).astype(np.float32))
"""
# catches the size error and falls back to the butterflies: still fails (the limit was crossed)
SNEAKY_FWHT = (
    HONEST.replace("def fwht(x):", "def _fast(x):")
    + MATRIX_FWHT.replace("def fwht(x):", "def _slow(x):")
    + """
def fwht(x):
    try:
        return _slow(x)
    except MemoryError:
        return _fast(x)
"""
)
# the matrix built once, outside the graded call (a cell of its own), then used
CACHED_FWHT = """
_H = {n: qlab_hadamard(n) for n in (2**k for k in range(1, 11))}
_H.update({n: qlab_hadamard(n) for n in (12 * 2**k for k in range(0, 8))})

def fwht(x):
    return x @ _H[x.shape[-1]]
"""
BUILDERS = {"torch": MATRIX_FWHT, "numpy": NUMPY_FWHT, "sneaky": SNEAKY_FWHT,
            "cached": CACHED_FWHT}


def _fn(source: str):
    ns = {"qlab_hadamard": hadamard}
    exec(textwrap.dedent(HEADER + source), ns)
    return ns["fwht"]


def test_the_honest_solution_passes_under_the_limit(capsys):
    fn = _fn(HONEST)
    for seed in SEEDS:
        check("fwht", fn, seed=seed, quiet=True)
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_a_matrix_builder_is_right_but_fails_on_every_seed(kind, capsys):
    fn = _fn(BUILDERS[kind])
    for case in make_cases(get_task("fwht"), 0):  # the values are right: only the rule fails
        torch.testing.assert_close(fn(*case), qlab_fwht(*case), rtol=1e-5, atol=2e-5)
    for seed in SEEDS:
        with pytest.raises(CheckFailed, match="SizeLimit") as err:
            check("fwht", fn, seed=seed, quiet=True)
        assert RULE in str(err.value), str(err.value)
    capsys.readouterr()


def test_the_size_limit_names_the_tensor_and_survives_a_caught_error():
    def big(x):
        return torch.zeros(40, 40).sum() + x

    def caught(x):
        try:
            torch.zeros(1000)
        except MemoryError:
            pass
        return x

    def listed(x):
        return x + len([0.5] * 100_000)  # 800 kB of list: traced Python memory

    x = torch.ones(3)
    records = _harness.run_cases(big, [(x,), (x,)], limits=[2000, 1000], rule="the rule")
    assert "ok" in records[0]  # 1600 elements <= 2000
    assert records[1]["error"].startswith("SizeLimit: big made a tensor of 1600 elements (40 x 40)")
    assert records[1]["error"].endswith("; the rule")
    assert "made a tensor of 1000" in _harness.run_cases(caught, [(x,)], limits=[10])[0]["error"]
    assert "allocated" in _harness.run_cases(listed, [(x,)], limits=[10])[0]["error"]
    assert "ok" in _harness.run_cases(listed, [(x,)])[0]  # no limit: nothing checked
    view = torch.zeros(4).expand(1000, 4)  # a view holds its storage's 4 elements
    assert "ok" in _harness.run_cases(lambda v: v.sum(), [(view,)], limits=[100])[0]


def test_only_fwht_declares_a_size_limit():
    from qlab.grading import all_tasks

    assert [g for g, t in all_tasks().items() if t.size_limit] == ["fwht"]
    limit = get_task("fwht").size_limit
    for case in make_cases(get_task("fwht"), 1):
        n = case[0].shape[-1]
        if n >= 256:  # the last case: an n x n matrix never fits, whatever the rows
            assert n * n > limit.elements(*case)
    assert math.isclose(np.float32(limit.elements(torch.zeros(1, 12))), 144)


def test_the_size_limit_does_not_import_torch_dynamo_and_holds_with_it():
    """torch's dispatch-mode wrapper imports torch._dynamo (1 s of CPU in each grading kernel
    that checks a task with a size limit);
    the limit keeps its plain method where nothing imported torch._dynamo, takes torch's
    wrapper once something did, and catches the large tensor both times (a fresh process:
    the tests before this one may have imported it). A function that compiles inside the
    limit is not tried here."""
    code = textwrap.dedent("""
        import sys, torch
        from qlab.grading import _harness
        wrapped = []  # the size limit's methods that TorchDispatchMode hands to the wrapper
        real = torch._disable_dynamo
        torch._disable_dynamo = lambda fn, *a, **k: (
            "size_limit" in fn.__qualname__ and wrapped.append(fn) or real(fn, *a, **k))
        big = lambda v: torch.zeros(40, 40).sum() + v
        for _ in range(2):
            error = _harness.run_cases(big, [(torch.ones(3),)], limits=[100])[0]["error"]
            print("torch._dynamo" in sys.modules, len(wrapped),
                  error.startswith("SizeLimit: <lambda> made"))
            import torch._dynamo
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.stdout.split("\n")[:2] == ["False 0 True", "True 1 True"], done.stderr[-2000:]
