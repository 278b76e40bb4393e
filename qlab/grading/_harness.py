"""Plain-data wire format between the grader and a student's kernel.

This file has two lives:
- imported normally (``qlab.grading._harness``) by the learner-side ``check`` and by
  the grader, which use :func:`encode` / :func:`decode`;
- its SOURCE TEXT is sent into a student's kernel by ``qlab grade`` and run there in
  a private namespace (it must not import qlab: a student may have patched it; only
  :func:`install_watch` does, in the kernel's first cell, before any student code runs).

Only plain data crosses the boundary: JSON whose leaves are ``None``, ``bool``,
``int``, ``str``, floats as ``float.hex`` strings, and tensors as
``{"__tensor__": dtype, "shape": [...], "data": base64 of the raw little-endian
bytes}``. Anything else a student function returns (a tensor subclass, an object
with a lying ``__eq__`` or ``__array__``) is refused with a message, and the grader
rebuilds tensors from bytes in its own process (:func:`decode` validates every field).
"""

import base64
import contextlib
import importlib
import json
import os
import sys
import traceback
import tracemalloc
import types

import numpy as np
import torch

# dtype name -> (torch dtype, numpy dtype); bfloat16 is sent as float32 (exact).
_DTYPES = {
    "bool": (torch.bool, np.bool_),
    "uint8": (torch.uint8, np.uint8),
    "int8": (torch.int8, np.int8),
    "int16": (torch.int16, np.int16),
    "int32": (torch.int32, np.int32),
    "int64": (torch.int64, np.int64),
    "float16": (torch.float16, np.float16),
    "float32": (torch.float32, np.float32),
    "float64": (torch.float64, np.float64),
}
_TORCH_NAME = {v[0]: k for k, v in _DTYPES.items()}
_NUMPY_NAME = {np.dtype(v[1]): k for k, v in _DTYPES.items()}
_MAX_DEPTH = 8
# the watch's state lives in a module of its own, so that every harness cell finds it
_WATCH_MODULE = "__qlab_watch__"
REGISTRY_LABEL = "qlab.grading.registry (a task's reference)"


class WireError(ValueError):
    """A value that cannot cross the grader boundary (wrong type, bad bytes)."""


def _tensor_to_wire(a: np.ndarray, name: str) -> dict:
    a = np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C")  # keeps 0-d shapes
    return {
        "__tensor__": name,
        "shape": [int(n) for n in a.shape],
        "data": base64.b64encode(a.tobytes()).decode("ascii"),
    }


def encode(obj, _depth=0):
    """Python value -> JSON-able plain data. Exact types only (no subclasses)."""
    if _depth > _MAX_DEPTH:
        raise WireError("return value nested too deeply")
    t = type(obj)
    if obj is None or t is bool or t is int or t is str:
        return obj
    if t is float:
        return {"__float__": obj.hex()}
    if t is torch.Tensor:
        a = obj.detach()
        if a.device.type != "cpu":
            a = a.cpu()
        if a.dtype == torch.bfloat16:
            a = a.float()  # exact: every bfloat16 is a float32
        if a.dtype not in _TORCH_NAME:
            raise WireError(
                f"tensors of dtype {a.dtype} are not accepted; return an integer "
                "or float tensor (uint8, int8..int64, float16, float32, float64)"
            )
        return _tensor_to_wire(a.contiguous().numpy(), _TORCH_NAME[a.dtype])
    if t is np.ndarray:
        if obj.dtype not in _NUMPY_NAME:
            raise WireError(f"arrays of dtype {obj.dtype} are not accepted")
        return _tensor_to_wire(obj, _NUMPY_NAME[obj.dtype])
    if isinstance(obj, np.generic) and t.__module__ == "numpy":
        return encode(obj.item(), _depth + 1)
    if t is tuple or t is list:
        return {"__seq__": [encode(v, _depth + 1) for v in obj]}
    raise WireError(
        f"a {t.__module__}.{t.__qualname__} cannot be graded: return plain torch "
        "tensors, Python numbers, or tuples of them"
    )


def decode(obj, _depth=0, _budget=None):
    """Plain data -> Python/torch values, validating every field (grader side)."""
    if _budget is None:
        _budget = [256 * 2**20]
    if _depth > _MAX_DEPTH + 1:
        raise WireError("value nested too deeply")
    t = type(obj)
    if obj is None or t is bool or t is int or t is str:
        return obj
    if t is not dict:
        raise WireError(f"unexpected {t.__name__} on the wire")
    if set(obj) == {"__float__"} and type(obj["__float__"]) is str:
        return float.fromhex(obj["__float__"])
    if set(obj) == {"__seq__"} and type(obj["__seq__"]) is list:
        return tuple(decode(v, _depth + 1, _budget) for v in obj["__seq__"])
    if set(obj) == {"__tensor__", "shape", "data"}:
        name, shape, data = obj["__tensor__"], obj["shape"], obj["data"]
        if type(name) is not str or name not in _DTYPES:
            raise WireError(f"unknown dtype {name!r}")
        if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
            raise WireError("bad shape")
        if type(data) is not str:
            raise WireError("bad tensor data")
        raw = base64.b64decode(data, validate=True)
        _budget[0] -= len(raw)
        if _budget[0] < 0:
            raise WireError("returned data too large")
        tdtype, npdtype = _DTYPES[name]
        n = 1
        for d in shape:
            n *= d
        if n * np.dtype(npdtype).itemsize != len(raw):
            raise WireError("tensor bytes do not match its shape")
        a = np.frombuffer(raw, dtype=np.dtype(npdtype).newbyteorder("<")).reshape(shape)
        return torch.from_numpy(a.astype(npdtype, copy=True))
    raise WireError("unexpected object on the wire")


def dumps(obj) -> str:
    return json.dumps(encode(obj), separators=(",", ":"), allow_nan=False)


def loads(text: str):
    return decode(json.loads(text))


def _watch_state():
    state = sys.modules.get(_WATCH_MODULE)
    if state is None:
        state = types.ModuleType(_WATCH_MODULE)
        state.active, state.seen, state.wrapped = frozenset(), set(), {}
        sys.modules[_WATCH_MODULE] = state
    return state


def _recording(fn, label, state):
    """fn, but a call while ``label`` is active is noted (no __wrapped__ to unwrap)."""

    def watched(*args, **kwargs):
        if label in state.active:
            state.seen.add(label)
        return fn(*args, **kwargs)

    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(watched, attr, getattr(fn, attr, None))
    watched.__qlab_label__ = label
    return watched


def _resolve(dotted):
    """(owner, attribute name, object) for a dotted name. Attributes first ("qlab.quantize"
    is the function, not the module of that name), a submodule where a path goes on
    ("qlab.ptq.awq.awq_scales": the module qlab.ptq.awq, not the function qlab.ptq.awq)."""
    parts = dotted.split(".")
    owner, obj = None, importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        nxt = getattr(obj, parts[i], None)
        last = i == len(parts) - 1
        if nxt is None or not (last or isinstance(nxt, (types.ModuleType, type))):
            nxt = importlib.import_module(".".join(parts[: i + 1]))
        owner, obj = obj, nxt
    return owner, parts[-1], obj


def _rebind(original, wrapper, namespaces):
    for ns in namespaces:
        for key, value in list(ns.items()):
            if value is original:
                ns[key] = wrapper


def install_watch(targets, user_ns=None):
    """Make every call of the callables named in ``targets`` (dotted names) recordable.

    Each is replaced by a recording wrapper wherever qlab's modules (and ``user_ns``) bind
    it, a method on its class; the registry's task references are wrapped too (also those
    registered later). Calls are recorded only inside :func:`watching`. Returns the names
    that could not be found.
    """
    state, missing = _watch_state(), []
    for dotted in targets:
        try:
            owner, name, obj = _resolve(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
            continue
        if getattr(obj, "__qlab_label__", None) is None:
            wrapper = _recording(obj, dotted, state)
            wrapper.__qlab_original__ = obj
            state.wrapped[dotted] = wrapper
            if isinstance(owner, type):
                setattr(owner, name, wrapper)
            mods = [m for k, m in list(sys.modules.items()) if k.split(".")[0] == "qlab"]
            _rebind(obj, wrapper, [vars(m) for m in mods if isinstance(m, types.ModuleType)])
        if user_ns is not None:
            wrapper = state.wrapped.get(dotted)
            _rebind(getattr(wrapper, "__qlab_original__", None), wrapper, [user_ns])
    _watch_registry(state)
    return missing


def _watch_registry(state):
    registry = importlib.import_module("qlab.grading.registry")
    if getattr(registry.register, "__qlab_label__", None):
        return

    def wrap(task):
        if getattr(task.reference, "__qlab_label__", None) is None:
            ref = _recording(task.reference, REGISTRY_LABEL, state)
            object.__setattr__(task, "reference", ref)  # a frozen dataclass
        return task

    for task in list(registry._TASKS.values()):
        wrap(task)
    original = registry.register

    def register(task):
        return original(wrap(task))

    register.__qlab_label__ = REGISTRY_LABEL
    registry.register = register


@contextlib.contextmanager
def watching(labels):
    """Record calls of the watched callables named in ``labels`` (and the registry's)."""
    state = _watch_state()
    state.active, state.seen = frozenset([*labels, REGISTRY_LABEL]), set()
    try:
        yield state
    finally:
        state.active = frozenset()


def run_cases(fn, cases, guard=None, cell_names=False, limits=None, rule=""):
    """Call fn(*args) for each case; return one plain record per case.

    guard: a context manager factory entered around each call (e.g. the Triton
    out-of-bounds checker), or None. An error record names the line of the student's
    code it came from (``Cell In[5], line 3`` with ``cell_names`` in IPython). Inside
    :func:`watching`, a record lists the references the call used (``borrowed``).
    limits: per case, the most elements one tensor or array may hold during the call
    (:func:`size_limit`; ``rule`` is the spec's sentence for the message), or None.
    """
    records = []
    state = sys.modules.get(_WATCH_MODULE)
    for i, args in enumerate(cases):
        if state is not None:
            state.seen = set()
        before = [_bits(a) for a in args]
        limit = limits[i] if limits else None
        over = []
        try:
            with contextlib.ExitStack() as stack:
                if limit is not None:
                    over = stack.enter_context(size_limit(limit, getattr(fn, "__name__", "")))
                if guard is not None:
                    stack.enter_context(guard())
                out = fn(*args)
            changed = [j for j, a in enumerate(args) if _bits(a) != before[j]]
            if over:
                records.append({"error": "; ".join(filter(None, (over[0], rule)))})
            elif changed:
                records.append({"error": _changed_inputs(changed)})
            else:
                records.append({"ok": encode(out)})
        except (Exception, SystemExit) as e:  # the student's error is the result
            if over:  # the limit was crossed (even if the function caught the error)
                records.append({"error": "; ".join(filter(None, (over[0], rule)))})
            else:
                records.append({"error": _describe(e)[:500] + where(e, cell_names)})
        if state is not None and state.seen:
            records[-1]["borrowed"] = sorted(state.seen)
    return records


class SizeLimitError(MemoryError):
    """The function made or used a tensor or array larger than its task allows."""


# Python-level bytes a call may allocate on top of 8 bytes per allowed element
# (interpreter objects of the call itself); a numpy array is counted here (tracemalloc)
_PY_SLACK = 128 * 2**10


@contextlib.contextmanager
def size_limit(limit, who=""):
    """Yield a list that gets a message once the block holds too much in one piece.

    Every torch operation inside the block (torch dispatch) is checked: an input or output
    tensor whose storage holds more than ``limit`` elements raises :class:`SizeLimitError`
    there. Python allocations (numpy arrays, lists) are traced: a peak above 8 bytes per
    element plus ``_PY_SLACK`` is reported after the block. The message stays in the list
    even if the function catches the error.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    found = []
    who = f"{who} " if who else ""

    def check(values):
        for t in tree_leaves(values):
            if isinstance(t, torch.Tensor) and _held(t) > limit:
                if not found:
                    shape = " x ".join(map(str, t.shape))
                    found.append(
                        f"SizeLimit: {who}made a tensor of {t.numel()} elements ({shape}); "
                        f"at most {limit} are allowed in this case"
                    )
                raise SizeLimitError(found[0])

    class _Mode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            # torch wraps __torch_dispatch__ so that torch.compile skips it, a wrapper that
            # imports torch._dynamo on its first call (1 s of CPU, measured). torch decides
            # when this class is made, at each size_limit: if nothing has imported
            # torch._dynamo by then (so nothing was compiled), the method stays plain, and a
            # function that compiles for the first time inside the limit can have torch.compile
            # trace this method too; once torch._dynamo is imported, torch's wrapper is used.
            return "torch._dynamo" in sys.modules

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            check((args, kwargs))
            out = func(*args, **(kwargs or {}))
            check(out)
            return out

    with _Mode():  # the first use imports modules: not the function's memory
        torch.zeros(1).add_(1)
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        with _Mode():
            yield found
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if started:
            tracemalloc.stop()
        if peak > 8 * limit + _PY_SLACK and not found:
            found.append(
                f"SizeLimit: {who}allocated {peak} bytes of Python memory (numpy arrays, lists) "
                f"at once; at most {8 * limit + _PY_SLACK} are allowed in this case"
            )


def _held(t):
    """Elements a tensor holds: its own, or its storage's when that is smaller (a view)."""
    try:
        return min(t.numel(), t.untyped_storage().nbytes() // max(1, t.element_size()))
    except (RuntimeError, NotImplementedError):  # no storage (e.g. a meta tensor)
        return t.numel()


def _bits(a):
    """(shape, dtype, raw bytes) of a tensor argument, to see whether a call changed it."""
    if type(a) is not torch.Tensor:
        return None
    t = a.detach().cpu().contiguous().reshape(-1)
    return (tuple(a.shape), str(a.dtype), t.view(torch.uint8).numpy().tobytes())


def _changed_inputs(changed):
    which = ", ".join(f"argument {i + 1}" for i in changed)
    return (
        f"InputModified: the function changed its input ({which}) in place; inputs are "
        "read-only: work on a copy (e.g. h = h.clone())"
    )


def _describe(exc):
    """'Type: message'; Triton's InterpreterError("ValueError(...)") shows the error inside."""
    inner, depth = exc, 0
    while type(inner).__name__ == "InterpreterError" and inner.__cause__ and depth < 8:
        inner, depth = inner.__cause__, depth + 1
    if inner is not exc:
        return f"{type(inner).__name__}: {inner} (in a Triton kernel)"
    return f"{type(exc).__name__}: {exc}"


def _library_roots():
    """Folders whose code is not the student's: Python, site-packages, qlab, this file."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for name in ("qlab", "qlab.kernels"):
        mod = sys.modules.get(name)
        roots.update(getattr(mod, "__path__", None) or [])
    own = globals().get("__file__")
    if own:
        roots.add(os.path.dirname(own))
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def _is_student(filename, roots):
    if filename.startswith("<"):  # exec'd code: the grader's own, or a test's cell
        return not filename.startswith(("<frozen", "<qlab"))
    return not os.path.realpath(filename).startswith(roots)


def where(exc, cell_names=False):
    """' (Cell In[5], line 3: `src`)' for the student's line an exception came from, or ''.

    Follows the exception's cause chain from the original error outwards (Triton's
    interpreter re-raises kernel errors as InterpreterError from the original one, whose
    traceback holds the kernel's own line) and takes the innermost student frame.
    """
    chain, e = [], exc
    while e is not None and len(chain) < 8 and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    roots = _library_roots()
    for e in reversed(chain):
        tb = traceback.extract_tb(e.__traceback__)
        frames = [f for f in tb if _is_student(f.filename, roots)]
        if frames:
            f = frames[-1]
            src = (f.line or "").strip()[:120]
            return f" ({_label(f.filename, f.lineno, cell_names)}" + (f": `{src}`)" if src else ")")
    return ""


def _label(filename, lineno, cell_names):
    if cell_names:
        shell = getattr(__import__("builtins"), "get_ipython", lambda: None)()
        name = None
        try:
            name = shell.compile.format_code_name(filename)
        except Exception:  # noqa: BLE001 - no IPython, or another version: plain names
            pass
        if name:
            return f"{name[0]} {name[1]}, line {lineno}"
    if filename.startswith("<") or os.path.basename(filename)[:1].isdigit():
        return f"line {lineno}"  # exec'd code, or an IPython cell file: the line says enough
    return f"{filename}, line {lineno}"


def _kernel_main(
    user_ns, func_name, payload, result_path, limit, guard_src=None, watch=(), sizes=None, rule=""
):
    """Entry point inside the student's kernel (called by the grader's cell).

    Writes the result as one JSON document to ``result_path`` (not to stdout, which the
    student may have replaced): first to a temporary name, then renamed, so the grader
    never reads half a file. ``guard_src``: source of a self-contained module whose
    ``checking()`` is entered around each call (None: no guard). ``watch``: the task's
    declared references (installed by the grader's first cell: :func:`install_watch`).
    ``sizes``, ``rule``: the task's per-case size limits (see :func:`run_cases`), or None.
    """
    cases = [decode(c) for c in json.loads(base64.b64decode(payload))]
    guard = None
    if guard_src:
        ns = {"__name__": "__qlab_guard__"}
        exec(compile(guard_src, "<qlab guard>", "exec"), ns)
        guard = ns.get("checking")
    fn = user_ns.get(func_name)
    if fn is None or not callable(fn):
        result = {"missing": f"no function named {func_name!r} is defined in the notebook"}
    else:
        with watching(watch):
            result = {"records": run_cases(fn, cases, guard, limits=sizes, rule=rule)}
    text = json.dumps(result, separators=(",", ":"), allow_nan=False)
    if len(text) > limit:
        too_big = f"the result of {func_name} is larger than {limit // 2**20} MB"
        text = json.dumps({"missing": too_big})
    tmp = result_path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, result_path)
