"""Interpreter selection (qlab/kernels/_backend.py), checked in fresh interpreters."""

import os
import subprocess
import sys

RUN_DEQUANT = (
    "import torch, qlab, qlab.kernels as qk\n"
    "qt = qlab.quantize(torch.randn(4, 64), 'int4', 32)\n"
    "out = qk.dequantize_int4(qlab.pack_int4(qt.codes), qt.scales, 32)\n"
    "assert torch.equal(out, qlab.dequantize(qt))\n"
    "print('INTERPRET', qk.INTERPRET, type(qk.dequant._dequant_int4_kernel).__name__)\n"
)


def _python(code: str, **env_changes: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a GPU machine
    env.pop("TRITON_INTERPRET", None)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_no_gpu_picks_the_interpreter_with_a_one_line_notice():
    result = _python(RUN_DEQUANT)
    assert result.returncode == 0, result.stderr
    assert "INTERPRET True InterpretedFunction" in result.stdout
    notice = [line for line in result.stderr.splitlines() if "qlab.kernels" in line]
    assert len(notice) == 1 and "CPU interpreter" in notice[0]


def test_triton_imported_first_still_works():
    # `import triton` before qlab.kernels: tl.zeros, tl.sum, ... must be rebuilt.
    result = _python("import triton, triton.language as tl\n" + RUN_DEQUANT)
    assert result.returncode == 0, result.stderr
    assert "INTERPRET True" in result.stdout


def test_explicit_choice_is_respected():
    # TRITON_INTERPRET=0 without a GPU: real @triton.jit kernels (for AOT compilation).
    code = "import qlab.kernels as qk; print(qk.INTERPRET, type(qk.fp8._fp8_gemm_kernel).__name__)"
    result = _python(code, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "JITFunction"]
    assert "CPU interpreter" not in result.stderr


def test_no_triton_gives_a_clear_message():
    # As on macOS/Windows, where Triton has no wheels.
    result = _python("import sys\nsys.modules['triton'] = None\nimport qlab.kernels\n")
    assert result.returncode != 0
    assert "ImportError: qlab.kernels needs Triton" in result.stderr
    assert "Linux only" in result.stderr and "Colab" in result.stderr


NO_NUMPY = (
    "import sys, warnings\n"
    "sys.modules['numpy'] = None  # as in an image with torch and triton only\n"
    "warnings.filterwarnings('ignore', 'Failed to initialize NumPy')  # torch's own notice\n"
)


def test_imports_with_torch_and_triton_alone():
    # A fresh GPU image (TRITON_INTERPRET unset there; =0 here: the same @triton.jit path).
    code = NO_NUMPY + (
        "import torch, qlab, qlab.kernels as qk, qlab.kernels.bench\n"
        "print(qk.INTERPRET, qlab.quantize(torch.ones(2, 32), 'int4', 32).codes.sum().item())\n"
    )
    result = _python(code, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "448"]  # 2 x 32 codes of 7


def test_the_interpreter_without_numpy_says_so():
    result = _python(NO_NUMPY + "import qlab.kernels\n")
    assert result.returncode != 0
    assert "interpreter (TRITON_INTERPRET=1" in result.stderr
    assert "pip install numpy" in result.stderr
