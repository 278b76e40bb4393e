"""Kernel launcher used by ``qlab grade``: set resource limits, import, then start ipykernel.

Run as a script (``python _launch.py -f CONNECTION_FILE``) so it imports nothing of
qlab before the limits are in place. Limits come from the environment:
QLAB_GRADER_MEM_BYTES (RLIMIT_AS: a 10 GB allocation fails with MemoryError instead of
taking the machine), QLAB_GRADER_CPU_S (RLIMIT_CPU, a backstop to the grader's own
wall-clock limit) and QLAB_GRADER_NPROC (RLIMIT_NPROC, processes and threads: set in the
bwrap sandbox only, whose user namespace counts just the sandbox's own on Linux >= 5.14
(older kernels count all of the user's), to twice the submission's budget, at least 512,
never above the user's hard limit, a backstop for a fork loop between two of the
supervisor's measurements; Linux does not apply it to root). The user's own limit
(``ulimit -u``; not for the host's root; before 5.14, or where bwrap makes no user
namespace, the backstop replaces a lower soft one) still counts all of that user's
processes and threads, and a cgroup's pids.max all of its tasks: where they leave less
room than the budget, a fork is refused (BlockingIOError; a new thread: RuntimeError)
before the supervisor sees a breach (docs/INSTRUCTORS.md). Core dumps are off and written
files are capped at 256 MB. The submission as a whole is held to its budget by the
grader's supervisor (``budget.py``).
"""

import gc
import os
import resource
import sys


def _limit(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value if hard == resource.RLIM_INFINITY else hard))


def main() -> None:
    sys.path.pop(0)  # this script's folder: keep qlab/grading/* from shadowing modules
    mem = int(os.environ.get("QLAB_GRADER_MEM_BYTES", "0"))
    if mem > 0:
        _limit(resource.RLIMIT_AS, mem)
    cpu = int(os.environ.get("QLAB_GRADER_CPU_S", "0"))
    if cpu > 0:
        _limit(resource.RLIMIT_CPU, cpu)
    nproc = int(os.environ.get("QLAB_GRADER_NPROC", "0"))
    if nproc > 0:
        _limit(resource.RLIMIT_NPROC, nproc)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, 256 * 2**20)
    # no debugger in a grading kernel: ipykernel imports debugpy when it can (140 more
    # modules, 0.08 s of CPU per kernel start, measured), and finds it missing here
    sys.modules["debugpy"] = None
    # ipykernel, and PyTorch, which the grader's first cell imports anyway before any of the
    # notebook's code runs, imported with the cyclic garbage collector paused: importing
    # both took 1.60 s of CPU instead of 1.69 s (mean of 20 paired runs, the course machine)
    gc.disable()
    try:
        from ipykernel import kernelapp

        try:
            import torch  # noqa: F401
        except Exception:
            pass  # a broken torch: the grader's first cell imports it again and fails (its
            # error may differ: a failed import can leave some of torch's modules loaded)
    finally:
        gc.enable()
    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
