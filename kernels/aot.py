"""Ahead-of-time builds for real GPUs, on any CPU: qlab.kernels.compile_for.

    compile_for("w4a16", M=1, N=4096, K=4096)          # sm_90 (Hopper) by default
    -> {"ptx", "cubin", "sass", "n_regs", "spill_bytes", "ptxas", "main_loop", "shared",
        "grid", "config", "kernel", "meta", "launches"}

It builds exactly what the wrapper would launch for that shape: the wrapper's own plan
(kernels/w4a16.py `plan`, kernels/fp8.py `plan_gemm`), the default config of the shape's
M bucket (or `config=`), the split-K the wrapper would pick on an H100 (132 SMs, or
`sms=`), and Triton's own argument specialization (16-byte alignment, divisibility by 16),
then Triton's GPU pipeline TTIR -> TTGIR -> LLVM -> PTX -> cubin (ptxas) for `arch`.
No driver is needed. The kernels on a machine without a GPU are interpreter functions, so
the build runs in other Pythons with TRITON_INTERPRET=0 (up to tens of seconds per
build, depending on the machine; Triton caches), kept for later builds until they have
been idle for two minutes by default (compile_many's docstring says when one is reused).

What the GPU runs is the cubin's SASS, not the PTX: ptxas may serialise what the PTX
pipelined. So each launch also carries, from the tools that ship inside the triton wheel:

    cubin        the binary (bytes)
    sass         its disassembly (cuobjdump -sass)
    n_regs       registers per thread; shared: static + dynamic shared memory bytes
    spill_bytes  STACK + LOCAL bytes per thread (cuobjdump --dump-resource-usage); the
                 driver's LOCAL alone misses spills to the stack frame
    ptxas        ptxas -v's numbered messages, e.g. "C7515: ... wgmma.mma_async
                 instructions are serialized ..." and its "spill_stores" byte count
    main_loop    sass_main_loop(sass): SASS instructions, global-load bytes (per thread) and
                 wgmma drains (WARPGROUP.DEPBAR.LE gsb0, 0x0) per iteration of the main loop

n_spills (= spill_bytes) stays for older callers. Helpers below read PTX and SASS.
"""

from __future__ import annotations

import atexit
import base64
import json
import math
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

__all__ = [
    "KERNELS",
    "compile_for",
    "compile_many",
    "close_build_processes",
    "mma_instructions",
    "k_loop",
    "global_load_widths",
    "sass_instructions",
    "sass_loop_body",
    "sass_split_k_path",
    "sass_main_loop",
    "DRAIN",
]

KERNELS = ("w4a16", "fp8", "dequant")
_DTYPES = ("bf16", "fp16")


def compile_for(kernel: str, M: int, N: int, K: int, arch: int = 90, **opts) -> dict:
    """Compile the launch the wrapper of `kernel` ("w4a16", "fp8", "dequant") would make for
    x (M, K) and a weight (N, K), for compute capability `arch` (80, 89, 90, 100).

    opts: dtype ("bf16" | "fp16", the activations), group_size (w4a16, default 128),
    fast_accum (fp8, default False), config (a qlab.kernels.configs.Config), sms (default 132).
    Returns the main kernel's "ptx", "cubin", "sass", "n_regs", "spill_bytes" (= "n_spills"),
    "ptxas" (messages and spill stores), "main_loop" (see sass_main_loop), "shared", "grid",
    "config", "kernel" (its name) and "meta" (its constexprs), plus "launches": the same for
    every launch the wrapper makes, main one first (fp8: the GEMM, then the act quantizer).
    """
    return compile_many([dict(kernel=kernel, M=M, N=N, K=K, arch=arch, **opts)])[0]


def compile_many(requests: list[dict], timeout: float = 600, workers: int | None = None,
                 keep: bool = True) -> list[dict]:  # fmt: skip
    """compile_for for several requests, on `workers` build processes at once (default: one
    per usable CPU, at most 4), each building its share in order.

    A build process is a Python with TRITON_INTERPRET=0 that imports torch, Triton and the
    kernels once (about 3 CPU s on a 2.0 GHz Xeon core, often more than the builds). With
    keep=True (the default) it is kept, about 300 MB, for later calls from this process
    with the same environment (PYTEST_CURRENT_TEST aside), working folder and kernel
    sources (kernels/*.py, by size and modification time), until it has been idle for
    IDLE_EXIT_S seconds (QLAB_AOT_IDLE_S overrides), this process ends,
    close_build_processes() is called, or it is still building when the call fails (its
    timeout, a crash, Ctrl-C, or an error in another share): then it is killed. A kept
    process that ended cleanly before replying (its idle time ran out as the call came) is
    passed over for the next kept one or a fresh one. keep=False ends the processes this
    call used (kept ones included) after it. `timeout` (seconds) holds for each attempt
    at a process's share of the requests."""
    from qlab._tensor import usable_cpus

    for r in requests:
        _check_request(r)
    # identical requests are built once
    keys = [json.dumps(_jsonable(r), sort_keys=True) for r in requests]
    unique = list(dict.fromkeys(keys))
    if len(unique) < len(requests):
        done = compile_many([json.loads(k) for k in unique], timeout, workers, keep)
        built = dict(zip(unique, done, strict=True))
        return [built[k] for k in keys]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")  # the build needs no GPU
    key, idle_exit = _server_key(env), _idle_exit()
    workers = max(1, min(workers or min(usable_cpus(), 4), len(requests)))
    shares = [list(range(i, len(requests), workers)) for i in range(workers)]
    used: list[_Server] = []
    lock, stopping = threading.Lock(), threading.Event()

    def build(share: list[int]) -> list[dict]:
        payload = [_jsonable(requests[i]) for i in share]
        while True:
            if stopping.is_set():
                raise RuntimeError("stopped: another share failed or the call was interrupted")
            server = _Server.take(key) or _Server(env, key, idle_exit)
            with lock:  # busy, or stopped: never neither (see below)
                used.append(server)
                if stopping.is_set():
                    server.killed = True
                    raise RuntimeError("stopped: another share failed or the call was interrupted")
                server.busy = True
            try:
                return server.build(payload, timeout)
            except _NoReply as e:
                if not (server.reused and e.exit_code == 0):
                    raise  # a crash, a kill, Ctrl-C or the timeout: no second try

    pool = ThreadPoolExecutor(workers)  # each thread waits on its own process
    try:
        futures = [pool.submit(build, share) for share in shares]
        for f in wait(futures, return_when=FIRST_EXCEPTION).done:
            f.result()  # the first failure, whichever share it is in, raises here
        done = [f.result() for f in futures]
    except BaseException:  # an error or Ctrl-C: kill the builds in flight, do not wait
        with lock:
            stopping.set()
            for server in used:
                if server.busy:
                    server.killed = True
                    server.proc.kill()
        raise
    finally:
        pool.shutdown(wait=True)
        for server in used:
            server.release(keep)
    results: list[dict | None] = [None] * len(requests)
    for share, built_share in zip(shares, done, strict=True):
        for i, built in zip(share, built_share, strict=True):
            for launch in built["launches"]:
                launch["cubin"] = base64.b64decode(launch["cubin"])
            results[i] = dict(built["launches"][0], launches=built["launches"])
    return results


IDLE_EXIT_S = 120.0  # a kept build process ends after this long without a request


def _idle_exit() -> float:
    value = os.environ.get("QLAB_AOT_IDLE_S", "")
    try:
        seconds = float(value) if value else IDLE_EXIT_S
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 86400:
        raise ValueError(f"QLAB_AOT_IDLE_S must be seconds in (0, 86400], got {value!r}")
    return seconds


def _server_key(env: dict[str, str]) -> tuple:
    """What a kept build process must share with a call: the environment (but the variable
    pytest changes around every test), the working folder, and the size and modification
    time of each kernels/*.py, so that a process that imported a kernel before it was
    edited is not used for it (an edit that keeps the size and falls in the same mtime
    tick as the one before goes unseen)."""
    folder = os.path.dirname(os.path.abspath(__file__))
    sources = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(folder, name))
            sources.append((name, st.st_size, st.st_mtime_ns))
    variables = tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
    return variables, os.getcwd(), tuple(sources)


class _NoReply(RuntimeError):
    """The build process ended, or was ended at the timeout, before it replied."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Server:
    """One build process (`python -m qlab.kernels.aot FD IDLE_S`): a JSON line of requests
    on its stdin, a JSON line of results (or of the build's traceback) on its own pipe FD;
    its stdout and stderr go to a file, so nothing it prints can pass for a reply. Idle
    ones wait in _IDLE, by key; one is kept only after a complete exchange."""

    _IDLE: dict[tuple, list[_Server]] = {}
    _LOCK = threading.Lock()
    _LIVE: weakref.WeakSet[_Server] = weakref.WeakSet()  # every one not closed yet

    def __init__(self, env: dict[str, str], key: tuple, idle_exit: float):
        self.key, self.reused, self.ok, self.busy, self.killed = key, False, False, False, False
        self.err = tempfile.TemporaryFile()  # its stdout and stderr, for the error message
        self.replies, write = os.pipe()  # raw descriptors: no lock a fork could inherit held
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "qlab.kernels.aot", str(write), repr(idle_exit)],
                stdin=subprocess.PIPE, stdout=self.err, stderr=self.err, env=env,
                pass_fds=(write,),
            )  # fmt: skip
        except BaseException:
            os.close(self.replies)
            self.err.close()
            raise
        finally:
            os.close(write)
        self._LIVE.add(self)

    @classmethod
    def take(cls, key: tuple) -> _Server | None:
        """An idle process for `key`, if any; reaps every idle one that has ended."""
        with cls._LOCK:
            ended = [s for idle in cls._IDLE.values() for s in idle if s.proc.poll() is not None]
            for k in list(cls._IDLE):
                cls._IDLE[k] = [s for s in cls._IDLE[k] if s not in ended]
                if not cls._IDLE[k]:
                    del cls._IDLE[k]
            server = cls._IDLE[key].pop() if key in cls._IDLE else None
        for s in ended:
            s.close()
        if server is not None:
            server.reused = True
        return server

    def build(self, requests: list[dict], timeout: float) -> list[dict]:
        """Send the requests; read the reply until `timeout` seconds have passed."""
        self.ok = False
        err_start = os.fstat(self.err.fileno()).st_size
        try:
            self.proc.stdin.write((json.dumps(requests) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # it had ended: reading below finds its end
            pass
        line, timed_out = self._read_reply(time.monotonic() + timeout)
        self.busy = False
        if line.endswith(b"\n"):
            reply = json.loads(line)  # nothing but _serve's json.dumps lines come this way
            self.ok = True
            if "error" in reply:
                raise RuntimeError(f"ahead-of-time build failed:\n{reply['error'][-4000:]}")
            return reply["results"]
        if timed_out:
            self.proc.kill()
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.err.seek(err_start)
        tail = self.err.read().decode(errors="replace")[-4000:]
        why = (f"timed out after {timeout:g} s" if timed_out
               else f"its build process ended (exit code {code})")  # fmt: skip
        raise _NoReply(f"ahead-of-time build failed: {why}\n{tail}", code)

    def _read_reply(self, deadline: float) -> tuple[bytes, bool]:
        """Bytes up to the first newline, or all until the pipe's end; and whether the
        deadline came first."""
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                return b"".join(chunks), True
            chunk = os.read(self.replies, 1 << 20)
            chunks.append(chunk)
            if not chunk or chunk.endswith(b"\n"):  # one reply per request: nothing after it
                return b"".join(chunks), False

    def release(self, keep: bool) -> None:
        if keep and self.ok and not self.killed and self.proc.poll() is None:
            with self._LOCK:
                self._IDLE.setdefault(self.key, []).append(self)
        else:
            if not self.ok or self.killed:
                self.proc.kill()  # failed or never asked: no need to wait for it
            self.close()

    def close(self) -> None:
        """End the process: it ends when its input closes (killed if it has not in 10 s)."""
        self._LIVE.discard(self)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.replies >= 0:
            os.close(self.replies)
            self.replies = -1
        self.err.close()

    @classmethod
    def close_all(cls) -> None:
        with cls._LOCK:
            servers = [s for idle in cls._IDLE.values() for s in idle]
            cls._IDLE.clear()
        for server in servers:  # all of them start ending at once
            try:
                server.proc.stdin.close()
            except OSError:
                pass
        for server in servers:
            server.close()

    @classmethod
    def forget_in_child(cls) -> None:
        """In a fork of this process: drop the kept processes, and point this fork's
        copies of every build process's pipes at /dev/null (a plain dup2: no lock), so that
        they never keep a build process from seeing its input close."""
        null = os.open(os.devnull, os.O_RDWR)
        for server in list(cls._LIVE):
            for fd in (server.proc.stdin.fileno(), server.replies):
                if fd >= 0:
                    os.dup2(null, fd)
        os.close(null)
        cls._IDLE, cls._LIVE = {}, weakref.WeakSet()
        cls._LOCK = threading.Lock()


def close_build_processes() -> None:
    """End every kept build process now (they end by themselves when idle or at exit)."""
    _Server.close_all()


atexit.register(close_build_processes)
os.register_at_fork(after_in_child=_Server.forget_in_child)


def _check_request(r: dict) -> None:
    if r.get("kernel") not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {r.get('kernel')!r}")
    for name in ("M", "N", "K"):
        if isinstance(r[name], bool) or not isinstance(r[name], int) or r[name] <= 0:
            raise ValueError(f"{name} must be a positive int, got {r[name]!r}")
    if r.get("dtype", "bf16") not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {r.get('dtype')!r}")
    known = {"kernel", "M", "N", "K", "arch", "dtype", "group_size", "fast_accum", "config", "sms"}
    if set(r) - known:
        raise TypeError(f"unknown options {sorted(set(r) - known)}; known: {sorted(known)}")


def _jsonable(r: dict) -> dict:
    r = dict(r)
    if r.get("config") is not None and not isinstance(r["config"], dict):
        r["config"] = r["config"].as_dict()
    return r


# ----------------------------------------------------------------------------- PTX reading
def mma_instructions(ptx: str) -> list[str]:
    """The distinct tensor-core instructions: wgmma (sm_90), tcgen05.mma (sm_100), mma.sync."""
    return sorted(set(re.findall(r"(?:wgmma\.mma_async|tcgen05\.mma|mma\.sync)[\w.:]*", ptx)))


def k_loop(ptx: str) -> str:
    """The body of the kernel's main loop: from the first label LLVM marks as a loop header
    to the branch back to it."""
    header = re.search(r"^(\$L__BB\d+_\d+):[^\n]*Loop Header", ptx, re.M)
    if header is None:
        raise ValueError("no loop found in this PTX")
    back = re.compile(r"bra(?:\.uni)?\s+" + re.escape(header.group(1)) + ";")
    end = back.search(ptx, header.end())
    if end is None:
        raise ValueError(f"no branch back to {header.group(1)}")
    return ptx[header.end() : end.start()]


def global_load_widths(ptx: str) -> dict[str, int]:
    """Bytes per global load instruction -> how many there are: ld.global and cp.async."""
    widths: dict[str, int] = {}
    for vec, bits in re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx):
        key = f"ld.global {int(vec or 1) * int(bits) // 8}B"
        widths[key] = widths.get(key, 0) + 1
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*?,\s*0x([0-9a-f]+)", ptx):
        key = f"cp.async {int(size, 16)}B"
        widths[key] = widths.get(key, 0) + 1
    return widths


# ----------------------------------------------------------------------------- SASS reading
DRAIN = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b")  # wait for EVERY wgmma in flight
_SASS = re.compile(  # address, optional guard predicate (@P0, @!PT), opcode, operands
    r"^\s*/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z0-9_.]+)[^;]*?)\s*;", re.M
)
_WIDTH = {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}  # else 32 bits


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, whole instruction) of every SASS instruction,
    predicate guards (@P0, @!PT) stripped from the opcode."""
    return [(int(addr, 16), op, text) for addr, text, op in _SASS.findall(sass)]


def _load_bytes(op: str) -> int:
    """Bytes one thread reads from global memory with this opcode (0 if not a global load)."""
    if not (op.startswith("LDG.") or op == "LDG" or op.startswith("LDGSTS")):
        return 0
    widths = [_WIDTH[m] for m in op.split(".")[1:] if m in _WIDTH]
    return widths[-1] if widths else 4


def sass_main_loop(sass: str) -> dict:
    """The main loop of a kernel's SASS and what one iteration of it costs.

    Loops are backward branches (BRA to a lower address); the main loop is the innermost one
    with the most tensor-core instructions, then the most instructions (a split-K reduction
    loop may load more global bytes per thread than a K loop without MMA, but is shorter).
    Returns {"instructions", "load_bytes" (per thread, LDG + LDGSTS; predicated loads count),
    "tma_loads" (UTMALDG), "drains" (WARPGROUP.DEPBAR.LE gsb0, 0x0: every wgmma waited for),
    "mma" (HGMMA, QGMMA, HMMA), "barriers" (BAR.SYNC), "mix" (opcode -> count), "start",
    "end"}.
    """
    ins = sass_instructions(sass)
    back = [(int(t, 16), a) for a, op, text in ins if op.startswith("BRA")
            for t in re.findall(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])[:1]
            if int(t, 16) < a]  # fmt: skip
    inner = [(s, e) for s, e in back if not any(s <= s2 and e2 < e for s2, e2 in back)]
    if not inner:
        raise ValueError("no loop in this SASS")

    def summary(s: int, e: int) -> dict:
        body = [(op, text) for a, op, text in ins if s <= a <= e]
        mix: dict[str, int] = {}
        for op, _ in body:
            mix[op] = mix.get(op, 0) + 1
        return {
            "instructions": len(body),
            "load_bytes": sum(_load_bytes(op) for op, _ in body),
            "tma_loads": sum(op.startswith("UTMALDG") for op, _ in body),
            "drains": sum(bool(DRAIN.search(text)) for _, text in body),
            "mma": sum(op.startswith(("HGMMA", "HMMA", "QGMMA")) for op, _ in body),
            "barriers": sum(op.startswith("BAR.SYNC") for op, _ in body),
            "mix": dict(sorted(mix.items(), key=lambda kv: -kv[1])),
            "start": s,
            "end": e,
        }

    loops = [summary(s, e) for s, e in inner]
    return max(loops, key=lambda loop: (loop["mma"], loop["instructions"]))


def sass_loop_body(sass: str, loop: dict) -> list[str]:
    """The instructions of `loop` (a sass_main_loop result), in order, as text."""
    return [text for a, _, text in sass_instructions(sass) if loop["start"] <= a <= loop["end"]]


def sass_split_k_path(sass: str, loop: dict) -> dict:
    """Instructions outside `loop` (a sass_main_loop result) on the path of a split-K program
    that is not the last of its tile (kernels/_tiles.py store_or_reduce): {"prologue": all
    before the loop, "epilogue": after it up to the first branch (split_k > 1 jumps past the
    plain store), then from that branch's target to the first EXIT (its partial sums stored,
    the tile's counter incremented)}. The last program of a tile also runs the reduction."""
    ins = sass_instructions(sass)
    after = [(a, text) for a, _, text in ins if a > loop["end"]]
    branch, text = next((a, t) for a, t in after if re.search(r"\bBRA\b", t))
    target = int(re.findall(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])[0], 16)
    leave = next(a for a, t in after if a > target and re.search(r"\bEXIT\b", t))
    return {
        "prologue": sum(a < loop["start"] for a, _, _ in ins),
        "epilogue": sum(a <= branch or target <= a <= leave for a, _ in after),
    }


# ----------------------------------------------------------------------------- the child
class _Fake:
    """Stands in for a tensor: shape, dtype, strides and a 16-byte aligned address."""

    def __init__(self, dtype, shape):
        self.dtype, self.shape = dtype, tuple(shape)
        self.ndim = len(self.shape)
        self.device = "meta"

    def data_ptr(self) -> int:
        return 0  # as aligned as a fresh torch allocation

    def stride(self, dim: int | None = None):
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.insert(0, step)
            step *= size
        return tuple(strides) if dim is None else strides[dim]


def _fake_buffers(split_k, num_tiles, tile_elems, device):
    import torch

    return _Fake(torch.float32, (max(split_k * num_tiles * tile_elems, 1),)), _Fake(
        torch.int32, (max(num_tiles, 1024),)
    )


def _plans(r: dict) -> list:
    """The wrapper's launches for request r, on fake tensors."""
    import torch

    from qlab.kernels import configs, dequant, fp8, w4a16

    M, N, K = r["M"], r["N"], r["K"]
    x_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[r.get("dtype", "bf16")]
    sms = r.get("sms", configs.H100_SMS)
    config = configs.Config(**r["config"]) if r.get("config") else None
    if r["kernel"] == "w4a16":
        g = r.get("group_size", 128)
        words = _Fake(torch.int32, (-(-N // 32), 4 * K)) if w4a16.groups_per_step(g, K) else None
        w = w4a16.W4A16Weight(_Fake(torch.uint8, (N, K // 2)), _Fake(torch.float16, (N, K // g)),
                              g, (N, K), words)  # fmt: skip
        config = config or configs.configs_for("w4a16", M)[0]
        x, out = _Fake(x_dtype, (M, K)), _Fake(x_dtype, (M, N))
        return [w4a16.plan(x, w, out, config, sms, buffers=_fake_buffers)]
    if r["kernel"] == "fp8":
        f8 = torch.float8_e4m3fn
        w = fp8.FP8Weight(_Fake(f8, (N, K)), _Fake(torch.float32, (N,)), "channel")
        q_x, s_x = _Fake(f8, (M, K)), _Fake(torch.float32, (M,))
        config = config or configs.configs_for("fp8", M)[0]
        quant = fp8.plan_act_quant(_Fake(x_dtype, (M, K)), q_x, s_x, mode=0)
        gemm = fp8.plan_gemm(q_x, s_x, w, _Fake(x_dtype, (M, N)), config, sms,
                             bool(r.get("fast_accum", False)), buffers=_fake_buffers)  # fmt: skip
        return [gemm, quant]
    g = r.get("group_size", 128)  # dequant: a weight (N, K) as the primer kernel reads it
    return [dequant.plan(_Fake(torch.uint8, (N, K // 2)), _Fake(torch.float16, (N, K // g)),
                         _Fake(torch.float32, (N, K)), g)]  # fmt: skip


def _build(launch, arch: int) -> dict:
    """Compile one Launch as JITFunction.run would (same binder, same specialization)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.meta)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.meta, bound, specialization, options
    )
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    tools = _read_binary(compiled.asm["ptx"], compiled.asm["cubin"], arch)
    resources = tools["resources"]
    spill_bytes = int(resources["STACK"]) + int(resources["LOCAL"])
    return {
        "kernel": fn.__name__,
        "ptx": compiled.asm["ptx"],
        "cubin": base64.b64encode(compiled.asm["cubin"]).decode(),
        "sass": tools["sass"],
        "n_regs": int(resources["REG"]),
        "spill_bytes": spill_bytes,
        "n_spills": spill_bytes,
        "ptxas": tools["ptxas"],
        "main_loop": _main_loop_or_none(tools["sass"]),
        "shared": int(compiled.metadata.shared) + int(resources["SHARED"]),
        "grid": list(launch.grid),
        "config": launch.config.as_dict() if launch.config else None,
        "meta": {k: v for k, v in launch.meta.items() if not k.startswith("num_")}
        | {"num_warps": launch.meta.get("num_warps", 4)},
    }


def _read_binary(ptx: str, cubin: bytes, arch: int) -> dict:
    """cuobjdump (resources, SASS) and ptxas -v (messages) on one build; cached on disk in
    Triton's cache, keyed by the PTX and the cubin, so a rebuild runs neither tool again."""
    import hashlib

    import triton
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.runtime.cache import get_cache_manager

    key = hashlib.sha256(ptx.encode() + cubin + f"{arch}/v1".encode()).hexdigest()
    cache = get_cache_manager(key)
    path = cache.get_file("binary.json")
    if path is not None:
        with open(path) as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        cubin_path, ptx_path = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin_path, "wb") as f:
            f.write(cubin)
        with open(ptx_path, "w") as f:
            f.write(ptx)
        dump = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", "-sass", cubin_path],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        # the flags Triton's make_cubin passes (kernels/aot.py builds with fp fusion on)
        log = subprocess.run(
            [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(arch)}", ptx_path, "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    stores = re.search(r"(\d+) bytes spill stores", log)
    result = {
        "resources": dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", dump)),
        "sass": dump,
        "ptxas": {
            "messages": [
                f"{code}: {text.strip()}" for code, text in re.findall(r"\((C\d+)\)([^\n]*)", log)
            ],
            "spill_stores": int(stores.group(1)) if stores else 0,
        },
    }
    cache.put(json.dumps(result), "binary.json")
    return result


def _main_loop_or_none(sass: str) -> dict | None:
    try:
        return sass_main_loop(sass)
    except ValueError:  # a kernel without a loop
        return None


def _serve(fd: int, idle_exit: float) -> None:
    """The build process: for each line of requests on stdin, one line of results on pipe
    `fd`. Ends at the end of its input or after `idle_exit` seconds without a request."""
    import signal
    import traceback

    # Ctrl-C in a terminal or a notebook signals the whole process group: the parent
    # decides what ends (compile_many kills the builds it is waiting for)
    signal.signal(signal.SIGINT, lambda *_: None)  # caught, not ignored: tools it starts
    # (ptxas, cuobjdump) get the default back when they exec
    os.set_inheritable(fd, False)  # a tool this build starts must not hold the reply pipe
    replies = os.fdopen(fd, "w")
    # select, then a buffered readline: right because the parent sends one line and waits
    # for its reply, so no second line can sit in sys.stdin's buffer unseen by select
    while select.select([sys.stdin], [], [], idle_exit)[0]:
        line = sys.stdin.readline()
        if not line:
            return
        try:
            text = json.dumps({"results": [{"launches": [_build(launch, r.get("arch", 90))
                                                         for launch in _plans(r)]}
                                           for r in json.loads(line)]})  # fmt: skip
        except Exception:
            text = json.dumps({"error": traceback.format_exc()})
        replies.write(text + "\n")
        replies.flush()


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run through qlab.kernels.compile_for (needs TRITON_INTERPRET=0)")
    _serve(int(sys.argv[1]), float(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip tearing down torch and Triton (seconds)
