"""benchmarks/gpu_session.sh's guards, without running the benchmark: a broken Python stops
the session at the preflight with a non-zero exit, and the logs still reach $OUT."""

import subprocess
from pathlib import Path

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
