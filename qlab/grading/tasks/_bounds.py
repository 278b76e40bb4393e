"""Out-of-bounds tl.load / tl.store in a Triton kernel, caught on the CPU interpreter.

An unmasked ``tl.load`` that runs past the end of a tensor usually goes unnoticed: the
lanes it reads beyond the data are thrown away by a masked store, so the result is right
while the kernel reads memory it does not own (on a GPU: garbage, or an illegal-address
fault once the tensor ends at an allocation boundary). An unmasked ``tl.store`` corrupts
the heap and kills the process later ("double free or corruption").

On Triton's interpreter (``TRITON_INTERPRET=1``) every load and store is a gather or
scatter on raw addresses, so both can be checked. Inside ``with checking():`` each
launch records the address range of every tensor argument (its elements, from sizes and
strides), and each load and store must address, on every active lane (mask true), a
single one of those tensors; otherwise :class:`OutOfBounds` is raised before memory is
touched, naming the kernel's source line. Outside the context nothing changes.

Self-contained on purpose (stdlib, numpy, triton): ``qlab grade`` may run this file's
source inside a student's kernel, where qlab itself could be patched.
"""

from __future__ import annotations

import contextlib
import linecache
import sys

import numpy as np

__all__ = ["OutOfBounds", "checking"]

_STATE = {"depth": 0, "installed": False}
_LAUNCHES: list = []  # stack of (kernel code object, [(lo, hi, name), ...]) per running launch


class OutOfBounds(IndexError):
    """A kernel load or store addressed memory outside every tensor argument."""


@contextlib.contextmanager
def checking():
    """Check the loads and stores of every interpreted Triton launch inside the block."""
    _install()
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1


def _install() -> None:
    """Wrap the interpreter's launch, load and store once (no-op without Triton)."""
    if _STATE["installed"]:
        return
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # no Triton (macOS): nothing to check
        _STATE["installed"] = True
        return
    builder, launch = interp.interpreter_builder, interp.GridExecutor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store

    def checked_launch(self, *args, **kwargs):
        if not _STATE["depth"]:
            return launch(self, *args, **kwargs)
        named = list(zip(self.arg_names, args, strict=False)) + list(kwargs.items())
        _LAUNCHES.append((getattr(self.fn, "__code__", None), _extents(named)))
        try:
            return launch(self, *args, **kwargs)
        except Exception as e:  # the interpreter wraps kernel errors: give ours back plainly
            cause = e.__cause__
            if isinstance(cause, OutOfBounds):
                raise OutOfBounds(str(cause)) from None
            raise
        finally:
            _LAUNCHES.pop()

    def checked_load(ptrs, mask, *rest, **kw):
        _check("tl.load reads", ptrs, mask)
        return load(ptrs, mask, *rest, **kw)

    def checked_store(ptrs, value, mask, *rest, **kw):
        _check("tl.store writes", ptrs, mask)
        return store(ptrs, value, mask, *rest, **kw)

    interp.GridExecutor.__call__ = checked_launch
    builder.create_masked_load = checked_load
    builder.create_masked_store = checked_store
    _STATE["installed"] = True


def _extents(named) -> list[tuple[int, int, str]]:
    """(first byte, end byte, argument name) of each tensor argument's elements."""
    out = []
    for name, t in named:
        if not (hasattr(t, "data_ptr") and hasattr(t, "stride")) or t.numel() == 0:
            continue
        lo_el = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
        hi_el = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
        base, size = t.data_ptr(), t.element_size()
        out.append((base + lo_el * size, base + (hi_el + 1) * size, name))
    return out


def _check(what: str, ptrs, mask) -> None:
    if not _STATE["depth"] or not _LAUNCHES:
        return
    code, extents = _LAUNCHES[-1]
    addr = np.asarray(ptrs.data).astype(np.uint64)
    addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
    if not addr.size:
        return
    width = max(1, _element_bits(ptrs.dtype) // 8)
    home = np.full(addr.shape, -1)  # index of the tensor each active lane falls in
    for i, (lo, hi, _) in enumerate(extents):
        inside = (addr >= np.uint64(lo)) & (addr + np.uint64(width) <= np.uint64(hi))
        home = np.where((home < 0) & inside, i, home)
    found = home[home >= 0]
    first = int(found[0]) if found.size else None  # the tensor this access belongs to
    bad = addr[(home < 0) | (home != (-1 if first is None else first))]
    if bad.size:
        raise OutOfBounds(_message(what, code, extents, first, bad, addr.size, width))


def _element_bits(dtype) -> int:
    while hasattr(dtype, "element_ty"):
        dtype = dtype.element_ty
    return int(getattr(dtype, "primitive_bitwidth", 8))


def _message(what, code, extents, first, bad, n_lanes, width) -> str:
    target = "every tensor argument"
    if first is not None:
        lo, hi, name = extents[first]
        if int(bad.max()) >= hi:
            n, side = (int(bad.max()) - hi) // width + 1, "past its end"
        else:
            n, side = (lo - int(bad.min()) + width - 1) // width, "before its start"
        target = f"`{name}` (up to {n} element{'s' * (n != 1)} {side})"
    fix = "mask=..., other=0" if what.startswith("tl.load") else "mask=..."
    return (
        f"{what} outside its tensor{_kernel_line(code)}: {bad.size} of {n_lanes} lanes miss "
        f"{target}; pass {fix} with the mask true only inside the tensor"
    )


def _kernel_line(code) -> str:
    """' (kernel `name`, line N: source)' from the innermost frame running the kernel."""
    frame = sys._getframe()
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None or code is None:
        return ""
    source = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f" (kernel `{code.co_name}`, line {frame.f_lineno}" + (f": {source})" if source else ")")
