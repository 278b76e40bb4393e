"""House rule: ruff clean (pyproject.toml holds the configuration)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
