"""What `qlab grade` spends besides grading, kept cheap: each of its processes imports nbformat
without jsonschema's rfc3987_syntax (qlab/grading/_nbformat.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_grader_imports_nbformat_without_rfc3987_syntax_and_leaves_it_importable():
    code = (
        "import sys\nimport qlab.grading.grader, qlab.grading.session\n"
        "print(*(m in sys.modules for m in ('jsonschema', 'rfc3987_syntax', 'lark')))\n"
        "import nbformat, rfc3987_syntax\n"
        "nbformat.validate(nbformat.v4.new_notebook())\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False", "ok"]
