"""nbformat for the grader's processes, imported without jsonschema's ``rfc3987_syntax``.

nbformat imports jsonschema (for its error details, and as its validator when asked), and
jsonschema, when ``rfc3987_syntax`` is installed (Jupyter's ``jupyter-events`` pulls it
in) and the GPL ``rfc3987`` is not, imports it to check the "iri" and "iri-reference"
string formats: it builds 39 lark parsers at import, 0.84 s of CPU (measured on the
course machine) in each process that
imports nbformat: ``qlab grade``, each of its workers, ``qlab assign``. nbformat checks
no string formats, so these processes import it with that package hidden (jsonschema
then leaves those two formats unchecked, in this process only).
"""

import sys

if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
    sys.modules["rfc3987_syntax"] = None  # import fails: jsonschema skips those formats
    try:
        import nbformat
    finally:
        del sys.modules["rfc3987_syntax"]
import nbformat  # noqa: E402

__all__ = ["nbformat"]
