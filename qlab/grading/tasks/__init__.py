"""Task modules, one per chapter: ``ch01_affine.py`` ... ``ch07_quality.py`` and the Triton
labs ``ch08_*`` ... ``ch10_*``.

Every module in this package whose name starts with ``ch`` is imported, and registers
its tasks with ``qlab.grading.registry.register`` at import time. To add a chapter
(e.g. the Triton labs), drop in ``ch08_triton.py``; nothing else needs editing.
"""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("ch"):
        importlib.import_module(f"{__name__}.{_info.name}")
