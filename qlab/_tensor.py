"""Input handling shared by every qlab entry point: one place for the rules."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def as_float32(x, what: str = "x") -> torch.Tensor:
    """Torch tensor or numpy array -> contiguous float32 torch tensor (a copy when needed).

    fp16 / bf16 / fp64 inputs are converted to float32 (qlab computes in fp32).
    Integer and bool inputs are refused: quantizing codes again is almost always a bug.
    """
    if not isinstance(x, torch.Tensor):
        import numpy as np  # here, not at the top: `import qlab` needs torch alone

        if isinstance(x, np.ndarray) or np.isscalar(x) or isinstance(x, (list, tuple)):
            x = torch.as_tensor(np.asarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor or numpy array, got {type(x).__name__}")
    if not (x.is_floating_point()):
        raise TypeError(
            f"{what} has dtype {x.dtype}; qlab quantizes floating-point data. "
            f"Convert first, e.g. x.float()"
        )
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{what} is already float8 ({x.dtype}); convert to float32 first")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous()


def check_finite(x: torch.Tensor, scheme_name: str) -> None:
    """Refuse NaN/inf for schemes whose scale rule has no defined answer for them."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):  # one cheap pass screens the rest
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise ValueError(
            f"x has {int(bad.sum())} NaN/inf value(s); scheme {scheme_name!r} has no defined "
            "result for them (one inf would set the scale of its whole group). "
            "Clean the input (torch.nan_to_num) or use an MX scheme, where a NaN/inf "
            "gives its block a NaN scale (OCP MX v1.0)."
        )


# ---------------------------------------------------------------- thread policy
# One policy for notebooks, tests, the grader's kernels and the site build:
# - threads = the CPUs this process may use (affinity mask, cgroup CPU quota), not
#   os.cpu_count(), which counts the machine's CPUs even where a container or taskset
#   allows two; the user's OMP_NUM_THREADS wins when set.
# - OMP_WAIT_POLICY=PASSIVE: an OpenMP thread that waits sleeps at once instead of
#   spinning (without it libgomp spins 300,000 times first: GOMP_SPINCOUNT in the libgomp
#   manual), so waiting threads do not take the cores that other processes, or this
#   one's own main thread, need. OpenMP reads it once, when torch loads it, so it must be
#   in the process's environment: `make lab`, `make test` and `make site` export it, and
#   the kernels the tests, the grader and the site build start get thread_env().
WAIT_POLICY = "PASSIVE"
_CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(
    root: Path = _CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """This process's cgroup CPU quota in CPUs (e.g. 1.5), None when there is none.

    cgroup v2: ``cpu.max`` = "<quota> <period>" or "max <period>"; v1: ``cpu.cfs_quota_us``
    / ``cpu.cfs_period_us`` (quota -1 = none). Read in the process's own cgroup folder and
    at the mount's top (where a container sees its own limit); the smallest applies."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:  # not Linux
        return None
    limits = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            for folder in {root / rel, root}:
                text = _read(folder / "cpu.max")
                if text and text.split()[0] != "max":
                    quota, period = text.split()
                    limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):  # v1, mounted as cpu or cpu,cpuacct
            for folder in {root / controllers / rel, root / controllers, root / "cpu"}:
                quota = _read(folder / "cpu.cfs_quota_us")
                period = _read(folder / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0:
                    limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def usable_cpus() -> int:
    """How many CPUs this process can keep busy at once: its affinity mask
    (os.sched_getaffinity), capped by its cgroup CPU quota rounded up; at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask to read
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, math.ceil(limit))
    return max(1, n)


def thread_count() -> int:
    """Threads for torch: OMP_NUM_THREADS when the user set it (a positive integer), else
    usable_cpus()."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else usable_cpus()


def thread_env(threads: int | None = None) -> dict[str, str]:
    """Environment variables that give a child process (a Jupyter kernel, a worker) the
    policy: ``threads`` (default thread_count()) OpenMP and MKL threads, passive waiting
    (the user's OMP_WAIT_POLICY wins when set)."""
    n = str(threads if threads is not None else thread_count())
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or WAIT_POLICY,
    }


def apply_thread_policy() -> int:
    """Cap this process's torch threads at thread_count() (`import qlab` calls it); returns
    torch's thread count after. Only ever lowers it: torch's own default counts physical
    cores and ignores a cgroup quota, while a smaller count set before (e.g.
    torch.set_num_threads(1)) is kept. When OMP_NUM_THREADS is set, torch already follows
    it and nothing changes. The wait policy cannot change once torch is loaded: it comes
    from the environment."""
    n = thread_count()
    if not os.environ.get("OMP_NUM_THREADS") and torch.get_num_threads() > n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


@contextmanager
def torch_threads(n: int | None = None, deterministic: bool | None = None) -> Iterator[None]:
    """Run torch on n threads (default: the policy's thread_count()) inside the block (and,
    when given, with deterministic algorithms on or off), then restore what was set before.

    n = 1 for loops of small ops (a GPTQ column, a GGUF block, a widget update): with
    several threads each op waits at a barrier for every thread, and on a busy machine
    one descheduled thread turns a microsecond op into milliseconds. Training runs pin
    their thread count so that a run is reproducible bit for bit.

    torch.use_deterministic_algorithms is called only when ``deterministic`` is given: its
    first call imports torch._inductor (2 s of CPU, more on a busy machine)."""
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(n if n is not None else thread_count())
    if deterministic is not None:
        torch.use_deterministic_algorithms(deterministic)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        if deterministic is not None:
            torch.use_deterministic_algorithms(before[1])
