"""check() on kernel tasks runs the learner's function in a forked child; feedback names lines.

A crash (segfault, abort), a hang or an interpreter error in a learner's Triton kernel
becomes a FAIL line with the kernel crash hint or the kernel's source line, and the
checking process (here: pytest) keeps running with its state. Plus: check returns None
on a pass (nbgrader does not warn about it) and ``show_case`` hands back the inputs.
"""

from __future__ import annotations

import ctypes
import os
import signal

import pytest
import torch

from qlab.grading import CheckFailed, check, get_task
from qlab.grading.isolate import can_fork, run_in_child
from qlab.grading.registry import make_cases

# isort: split
import qlab.kernels as qk  # first: it picks the GPU or the CPU interpreter (needs Triton)

# isort: split
import triton  # Linux wheels only; the test extra installs it there
import triton.language as tl

GID = "triton_unpack_int4"  # unpack_int4_triton(packed uint8 (R, B)) -> int8 (R, 2B)
STATE = {"calls": 0}  # the parent's state: a crash in the child must not touch it


@triton.jit
def _unpack(packed_ptr, codes_ptr, R, B, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # output columns
    mask = cols < 2 * B
    byte = tl.load(packed_ptr + rows * B + cols // 2, mask=mask, other=0)
    nibble = (byte.to(tl.int32) >> ((cols % 2) * 4)) & 0xF
    code = tl.where(nibble >= 8, nibble - 16, nibble)
    tl.store(codes_ptr + rows * (2 * B) * STRIDE + cols, code.to(tl.int8), mask=mask)


@triton.jit
def _broadcast_bug(packed_ptr, codes_ptr, R, B, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bad = tl.zeros((BLOCK, 3), tl.int8)  # not a power of two: the interpreter refuses
    tl.store(codes_ptr + cols, bad)


def _wrapper(kernel, stride: int = 1):
    def unpack_int4_triton(packed: torch.Tensor) -> torch.Tensor:
        STATE["calls"] += 1
        packed = packed.contiguous().to(qk.DEVICE)
        R, B = packed.shape
        codes = torch.empty((R, 2 * B), dtype=torch.int8, device=qk.DEVICE)
        grid = (R, triton.cdiv(2 * B, 64))
        kernel[grid](packed, codes, R, B, STRIDE=stride, BLOCK=64)
        return codes.cpu()

    return unpack_int4_triton


@pytest.fixture(autouse=True)
def _linux_only():
    if can_fork() is not None:
        pytest.fail(f"kernel checks need fork here: {can_fork()}")


def test_a_correct_kernel_passes_and_check_returns_none(capsys):
    assert check(GID, _wrapper(_unpack), seed=3) is None  # no value: nbgrader stays quiet
    assert "PASS triton_unpack_int4" in capsys.readouterr().out
    assert STATE["calls"] == 0  # the calls happened in the child


def test_a_segfault_becomes_the_crash_hint_and_the_process_survives(capsys):
    def unpack_int4_triton(packed):
        print("about to crash")
        ctypes.string_at(0)  # what an out-of-bounds store in the interpreter ends with

    with pytest.raises(CheckFailed) as err:
        check(GID, unpack_int4_triton, seed=3)
    msg = str(err.value)
    assert "case 1 of" in msg and "the kernel crashed (signal SIGSEGV)" in msg
    assert "the usual cause is an unmasked tl.store (or a wrong stride)" in msg
    assert err.value.case is not None and err.value.case[0].dtype == torch.uint8
    assert "about to crash" in capsys.readouterr().out  # the child's output is shown


def test_an_abort_names_the_case_that_was_running(capsys):
    task = get_task(GID)

    def unpack_int4_triton(packed):
        if packed.numel() == 256:  # the fixed every-byte case
            os.kill(os.getpid(), signal.SIGABRT)  # "double free or corruption" aborts
        return _wrapper(_unpack)(packed)

    with pytest.raises(CheckFailed, match="the kernel crashed \\(signal SIGABRT\\)") as err:
        check(GID, unpack_int4_triton, seed=5)
    cases = [c[0] for c in make_cases(task, 5)]
    n = next(i for i, c in enumerate(cases) if c.numel() == 256) + 1
    assert f"case {n} of {len(cases)}" in str(err.value)


def test_a_wild_store_fails_the_check_not_the_process():
    # a row stride 2^20 too large: far outside every tensor. Caught before the store by the
    # out-of-bounds checker where one is installed, else the child dies (SIGSEGV).
    with pytest.raises(CheckFailed) as err:
        check(GID, _wrapper(_unpack, stride=1 << 20), seed=3)
    msg = str(err.value)
    assert "the kernel crashed" in msg or "tl.store" in msg, msg
    assert check(GID, _wrapper(_unpack), seed=3, quiet=True) is None  # still works


def test_a_hang_times_out():
    def unpack_int4_triton(packed):
        while True:
            pass

    with pytest.raises(CheckFailed, match="did not finish within 2 s"):
        check(GID, unpack_int4_triton, seed=3, timeout=2)


def test_an_interpreter_error_names_the_kernel_line(capsys):
    with pytest.raises(CheckFailed) as err:
        check(GID, _wrapper(_broadcast_bug), seed=3)
    msg = str(err.value)
    assert "(in a Triton kernel)" in msg and "InterpreterError" not in msg.split("raised")[1]
    assert "line " in msg and "bad = tl.zeros((BLOCK, 3), tl.int8)" in msg


def test_an_error_in_plain_python_names_its_line():
    def symmetric_quantize(x, bits):
        scale = x.abs().max() / (2 ** (bits - 1) - 1)
        return x[1000], scale  # IndexError on this line

    with pytest.raises(CheckFailed, match="IndexError") as err:
        check("sym_quantize", symmetric_quantize, seed=1)
    assert "return x[1000], scale  # IndexError on this line" in str(err.value)
    assert "test_grading_check_process.py, line" in str(err.value)


def test_show_case_returns_the_failing_inputs(capsys):
    def symmetric_quantize(x, bits):
        qmax = 2 ** (bits - 1) - 1
        scale = (x.abs().max() / qmax).to(torch.float16)
        codes = torch.floor(x / scale.float() + 0.5)  # round half up: wrong on ties
        return torch.clamp(codes, -qmax, qmax).to(torch.int8), scale

    case = check("sym_quantize", symmetric_quantize, seed=11, show_case=True)
    assert isinstance(case, tuple) and isinstance(case[0], torch.Tensor)
    out = capsys.readouterr().out
    assert out.startswith("FAIL sym_quantize") and "case " in out
    with pytest.raises(CheckFailed) as err:
        check("sym_quantize", symmetric_quantize, seed=11)
    assert torch.equal(err.value.case[0], case[0]) and err.value.case[1:] == case[1:]
    label = str(err.value).split(": ", 2)[1]  # "case i of n symmetric_quantize(...)"
    assert label.startswith("case ")
    i = int(label.split()[1]) - 1
    task = get_task("sym_quantize")
    assert torch.equal(make_cases(task, 11)[i][0], case[0])  # the case the message names


def test_run_in_child_reports_partial_records():
    def fn(x):
        if x == 2:
            os._exit(7)
        return x * 10

    result = run_in_child(fn, [(1,), (2,), (3,)], timeout=30)
    assert result.records == [{"ok": 10}] and result.crash == "exit code 7"
