"""Fixtures shared across test folders."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def executed_chapters(tmp_path_factory) -> Path:
    """Where tests/notebooks/test_chapters.py leaves each chapter it executed; the site's
    browser test builds from these instead of executing every chapter a second time."""
    path = tmp_path_factory.getbasetemp() / "executed-chapters"
    path.mkdir(exist_ok=True)
    return path
