"""The thread policy (qlab/_tensor.py): thread counts from the CPUs this process may use,
passive waiting, and the same policy for notebooks, tests, the grader and the site."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import qlab._tensor as threads_mod
from qlab._tensor import (
    apply_thread_policy,
    cgroup_cpu_limit,
    thread_count,
    thread_env,
    torch_threads,
    usable_cpus,
)

REPO = Path(__file__).resolve().parents[1]


def _cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup tree and /proc/self/cgroup file."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return tmp_path, tmp_path / "proc_cgroup"


def test_cgroup_v2_quota(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.5
    (root / "cpu.max").write_text("max 100000\n")  # no quota
    assert cgroup_cpu_limit(root, proc) is None


def test_cgroup_v2_quota_of_the_process_own_group(tmp_path):
    root, proc = _cgroup(
        tmp_path, "0::/user.slice/job\n", {"user.slice/job/cpu.max": "200000 100000\n"}
    )
    assert cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_quota(tmp_path):
    files = {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000"}
    root, proc = _cgroup(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/\n", files)
    assert cgroup_cpu_limit(root, proc) == 0.5
    (root / "cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_information_means_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path, tmp_path / "absent") is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads_mod, "cgroup_cpu_limit", lambda: None)
    assert usable_cpus() == 4
    monkeypatch.setattr(threads_mod, "cgroup_cpu_limit", lambda: 1.5)
    assert usable_cpus() == 2  # a quota of 1.5 CPUs keeps 2 threads busy part of the time
    monkeypatch.setattr(threads_mod, "cgroup_cpu_limit", lambda: 0.2)
    assert usable_cpus() == 1


def test_the_users_settings_win(monkeypatch):
    monkeypatch.setattr(threads_mod, "usable_cpus", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert thread_count() == 6
    assert thread_env() == {
        "OMP_NUM_THREADS": "6",
        "MKL_NUM_THREADS": "6",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert thread_env(1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert thread_count() == 3
    assert thread_env() == {
        "OMP_NUM_THREADS": "3",
        "MKL_NUM_THREADS": "3",
        "OMP_WAIT_POLICY": "ACTIVE",
    }


def test_apply_caps_torch_threads_and_torch_threads_restores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_mod, "usable_cpus", lambda: 1)
    try:
        torch.set_num_threads(2)
        assert apply_thread_policy() == 1 and torch.get_num_threads() == 1  # capped
        monkeypatch.setattr(threads_mod, "usable_cpus", lambda: 4)
        assert apply_thread_policy() == 1  # a smaller count set before is kept
        with torch_threads():  # the policy's count
            assert torch.get_num_threads() == 4
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_import_qlab_uses_the_cpus_the_process_may_use():
    """A process pinned to one CPU gets one torch thread, without OMP_NUM_THREADS; and
    torch_threads leaves deterministic mode alone unless asked (setting it imports
    torch._inductor, seconds of start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "import qlab, torch; from qlab._tensor import torch_threads\n"
        "with torch_threads(1): pass\n"
        "print(torch.get_num_threads(), 'torch._inductor' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1", "False"]


def test_the_tests_and_make_run_with_passive_waiting():
    assert os.environ["OMP_WAIT_POLICY"]  # tests/conftest.py sets it before torch loads
    makefile = (REPO / "Makefile").read_text()
    assert "export OMP_WAIT_POLICY ?= PASSIVE" in makefile


def test_the_grader_kernels_get_the_policy(tmp_path):
    from qlab.grading.session import GradeOptions, kernel_env

    env = kernel_env(GradeOptions(), tmp_path, [])
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"  # --jobs kernels share
    assert env["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
