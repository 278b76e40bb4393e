"""Fixtures shared by the tests that run llama.cpp itself
(tests/gguf/test_gguf_llamacpp_{runtime,tinylm,quantize}.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import make_llamacpp_reference as reference  # tests/gguf/, on sys.path under pytest
import pytest

import qlab.gguf as G
from qlab.gguf.types import GGUFTensor
from qlab.lm import minilm, quality


@pytest.fixture(scope="module")
def llama_cpp():
    """llama-cpp-python, or skip (fail under QLAB_LLAMACPP=require): see llama_cpp_or_skip."""
    return reference.llama_cpp_or_skip()


Exported = tuple[Path, dict[str, GGUFTensor]]


@pytest.fixture(scope="session")
def llamacpp_export(tmp_path_factory) -> Callable[[str, str], Exported]:
    """export(which, recipe) -> (path, written): qlab.gguf.export_llamacpp of the shipped
    MiniLM (which="minilm") or TinyLM ("tinylm") with a recipe name, without an imatrix,
    exported on first use and shared by the three files' tests (the same weights and
    recipe give the same file; nothing here is written to after export). Tests that
    export something else (an imatrix, a dict of types) still export it themselves."""
    folder = tmp_path_factory.mktemp("llamacpp-export")
    models = {"minilm": minilm.load, "tinylm": quality.load_model}
    loaded, done = {}, {}

    def export(which: str, recipe: str) -> Exported:
        if (which, recipe) not in done:
            if which not in loaded:
                loaded[which] = models[which]()
            path = folder / f"{which}-{recipe}.gguf"
            done[which, recipe] = path, G.export_llamacpp(loaded[which], path, recipe)
        return done[which, recipe]

    return export
