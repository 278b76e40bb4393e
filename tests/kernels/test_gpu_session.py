"""benchmarks/gpu_session.sh and the benchmark's isolation, on a CPU: a broken Python stops the
session at the preflight and the logs still reach $OUT; a row that raises while timing is
marked and the run goes on; a shape whose process dies is recorded and the next shape runs;
every row is on disk (JSON lines, after a header with the GPU and versions) as it finishes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qlab.kernels import baselines, bench

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_session.sh"


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_failed_preflight_stops_everything_and_still_copies_logs(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PY": "false", "OUT": str(tmp_path / "out"), "NO_PIP": "1",
           "SESSION_DIR": str(tmp_path / "logs")}  # fmt: skip
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode != 0
    assert "PREFLIGHT FAILED" in result.stdout and "benchmark" not in result.stdout
    log = (tmp_path / "out" / "session.log").read_text()
    assert "PYTHONPATH overlay" in log and "PREFLIGHT FAILED" in log


def test_a_row_that_raises_while_timing_is_marked_and_the_run_goes_on():
    def timer(fn):  # stands in for time_cold: fails for our W4A16 kernel only
        if fn.func is baselines.w4a16_linear:
            raise RuntimeError("CUDA error: out of memory (stand-in)")
        return 1e-3

    rows = []
    bench.run_shape("tiny", 32, 128, (1,), rows.append, timed=True, timer=timer)
    rows = [r for r in rows if r["record"] == "row"]
    assert [r["kernel"] for r in rows] == [c.name for c in baselines.candidates(fp8=True)]
    by = {r["kernel"]: r for r in rows}
    assert by["w4a16"]["error"].startswith("timing failed: RuntimeError: CUDA error")
    assert "time_s" not in by["w4a16"]
    assert all(r.get("time_s") == 1e-3 for k, r in by.items() if k != "w4a16"), rows


def test_a_cuda_fault_ends_the_shape_after_recording_its_row(monkeypatch):
    monkeypatch.setattr(bench, "cuda_alive", lambda: False)  # as after an illegal address
    monkeypatch.setattr(baselines, "w4a16_linear", lambda x, w: 1 / 0)
    rows = []
    with pytest.raises(bench.CudaFault, match="tiny M=1 w4a16"):
        bench.run_shape("tiny", 32, 128, (1, 2), rows.append, timed=False)
    assert rows[-1]["kernel"] == "w4a16" and "ZeroDivisionError" in rows[-1]["skipped"]
    assert {r["M"] for r in rows if r["record"] == "row"} == {1}  # M=2 never ran


def test_a_shape_whose_process_dies_is_recorded_and_the_next_shape_runs(tmp_path, monkeypatch):
    real = bench._child_command

    def command(spec):  # the middle shape's process aborts, as a CUDA fault's would
        if spec["label"] == "dies":
            return [sys.executable, "-c", "import os; os.abort()"]
        return real(spec)

    monkeypatch.setattr(bench, "_child_command", command)
    shapes = [("tiny a", 32, 128), ("dies", 32, 128), ("tiny b", 16, 128)]
    out = tmp_path / "bench.json"
    doc = bench.run(shapes, (1,), out, timed=False, isolate=True, shape_timeout_s=300)
    assert doc == json.loads(out.read_text())  # rewritten after every shape
    assert {r["shape"] for r in doc["rows"]} == {"tiny a", "tiny b"}
    assert all("error" not in r and "skipped" not in r for r in doc["rows"]), doc["rows"]
    [died] = doc["shape_failures"]
    assert died["shape"] == "dies" and died["exit_code"] != 0
    assert [f["kernel"] for f in bench.failures(doc)] == ["(shape process)"]
    assert any("shape process died" in line for line in bench.summary_lines(doc))
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    header = lines[0]
    assert header["record"] == "environment" and {"gpu", "torch", "triton"} <= set(header)
    kinds = [r["record"] for r in lines[1:]]
    n = len(baselines.candidates(fp8=True))
    assert kinds == ["shape"] + ["row"] * n + ["shape_failed", "shape"] + ["row"] * n
