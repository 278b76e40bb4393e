"""Pick where Triton kernels run, BEFORE any @triton.jit decorator executes.

    CUDA GPU present      -> kernels compile and run natively on the GPU
    no CUDA GPU (laptop)  -> TRITON_INTERPRET=1: the same kernel source runs on the
                             CPU through Triton's interpreter (numpy), slowly, so the
                             kernel labs work anywhere Triton installs (Linux; there
                             are no macOS/Windows wheels). Not a GPU's semantics in
                             every operation: its fp32 -> bf16 cast truncates, its
                             fp32 -> fp8 cast neither rounds to nearest-even nor
                             saturates (notebook 08 shows both), and float sums may
                             round differently (kernels/tolerance.py).

`@triton.jit` reads TRITON_INTERPRET when it decorates a function, so this module
must be imported before the kernel modules; kernels/__init__.py (qlab.kernels) imports it first.
An explicit TRITON_INTERPRET is respected: =1 on a GPU machine interprets (handy for
debugging with print); =0 on a machine without a GPU gives real @triton.jit kernels
that can be compiled ahead of time (qlab.kernels.compile_for, kernels/aot.py, which the
tests in tests/kernels/test_kernel_aot.py use) but not launched.
"""

from __future__ import annotations

import os
import sys

import torch

NO_TRITON_MESSAGE = (
    "qlab.kernels needs Triton, which ships wheels for Linux only (no macOS or Windows). "
    "Run the kernel notebooks (08-11) on Linux, a GPU box or Google Colab: "
    "`pip install triton` there. Every other notebook works without it."
)

NO_NUMPY_MESSAGE = (
    "qlab.kernels: Triton's CPU interpreter (TRITON_INTERPRET=1, chosen when there is no "
    "CUDA GPU) needs numpy: `pip install numpy`. On a GPU, or with TRITON_INTERPRET=0 for "
    "ahead-of-time builds, qlab.kernels needs torch and triton only."
)

HAS_CUDA: bool = torch.cuda.is_available()
_TRUE = ("1", "true", "on", "yes")  # how Triton reads a boolean environment variable

if not HAS_CUDA and not os.environ.get("TRITON_INTERPRET", "").strip():
    os.environ["TRITON_INTERPRET"] = "1"
    print(
        "qlab.kernels: no CUDA GPU found, running Triton kernels on the CPU interpreter "
        "(correct results, not performance).",
        file=sys.stderr,
    )

# Triton >= 3.9 warns on every GPU compile unless this is set; "1" keeps the behaviour
# of every earlier release (mul+add may fuse into FMA). No effect on older Triton.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_language_was_imported = "triton.language" in sys.modules

try:
    import triton  # noqa: F401  (imported after TRITON_INTERPRET is settled)
except ImportError as err:  # macOS/Windows (tests/kernels/test_kernel_backend.py)
    if err.name == "numpy":  # triton/runtime/interpreter.py imports numpy; a GPU build does not
        raise ImportError(NO_NUMPY_MESSAGE) from err
    raise ImportError(NO_TRITON_MESSAGE) from err

#: True when kernels run on Triton's CPU interpreter.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE

# Checked: Triton 3.9's interpreter runs every kernel here; 3.6's mishandles some of them
# (signed zeros, NumPy 2 scalars) while its GPU compiler builds them all (AOT tests).
INTERPRETER_MIN_TRITON = (3, 9)
if INTERPRET and tuple(int(p) for p in triton.__version__.split(".")[:2]) < INTERPRETER_MIN_TRITON:
    print(
        f"qlab.kernels: Triton {triton.__version__}'s CPU interpreter gets some of these kernels "
        "wrong; on a CPU use Triton >= 3.9 (make lab installs it).",
        file=sys.stderr,
    )


def _reinterpret_triton_language() -> None:
    """`import triton` before qlab.kernels built Triton's own @jit library functions
    (tl.zeros, tl.sum, tl.cdiv, ...) for a GPU; rebuild them for the interpreter, or a
    kernel would fail with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, InterpretedFunction(value.fn))


if INTERPRET and _language_was_imported:
    _reinterpret_triton_language()

#: Where kernel inputs should live: "cuda" with a GPU, else "cpu".
DEVICE: str = "cuda" if HAS_CUDA else "cpu"


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels need their tensors on DEVICE (CPU tensors only under the interpreter)."""
    for t in tensors:
        if not INTERPRET and t.device.type != "cuda":
            raise ValueError(
                f"tensor on {t.device} but Triton kernels run on the GPU here; "
                "move inputs with .cuda() (or .to(qlab.kernels.DEVICE))"
            )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"inputs are on different devices {sorted(map(str, devices))}")


def check_linear_weight(weight) -> None:
    """An nn.Linear-shaped weight: a floating-point torch tensor (N=out, K=in)."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(
            f"weight must be a floating-point torch tensor (N, K), got "
            f"{getattr(weight, 'dtype', type(weight).__name__)}"
        )
    if weight.ndim != 2:
        raise ValueError(
            f"weight must be 2-D (out_features N, in_features K) like nn.Linear.weight, "
            f"got shape {tuple(weight.shape)}"
        )


def needs_int64(*tensors) -> bool:
    """True when an element offset into one of the tensors can pass 2**31 - 1: the kernels
    then compute row offsets (row * stride) in int64 (their INDEX_64 flag), since int32
    products would wrap, e.g. y of a 128K-vocabulary lm_head at 16.7K tokens (M * N > 2**31).
    Smaller launches keep int32 offsets: the same binary as before, no 64-bit multiplies."""
    for t in tensors:
        dims = [(size, t.stride(d)) for d, size in enumerate(t.shape)]
        if any(size == 0 for size, _ in dims):
            continue
        if sum((size - 1) * stride for size, stride in dims) >= 2**31 - 1:
            return True
    return False


SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def check_activation(x, K: int | None = None, dtypes=SIXTEEN_BIT, two_d: bool = False) -> None:
    """Activations for a kernel: a contiguous tensor of one of `dtypes`, last dimension K
    (when given), exactly 2-D (M, K) when two_d. Every wrapper checks its x through this."""
    if not isinstance(x, torch.Tensor) or x.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        hint = "; cast with x.half() or x.bfloat16()" if dtypes == SIXTEEN_BIT else ""
        raise TypeError(
            f"x must be a {names} tensor, got {getattr(x, 'dtype', type(x).__name__)}{hint}"
        )
    if two_d and x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if K is not None and (x.ndim == 0 or x.shape[-1] != K):
        raise ValueError(
            f"x has shape {tuple(x.shape)} but the weight expects in_features K = {K} "
            "as the last dimension"
        )
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call x.contiguous() first")
