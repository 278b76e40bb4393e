"""Fixtures shared by the tests that run llama.cpp itself
(tests/gguf/test_gguf_llamacpp_{runtime,tinylm,quantize}.py)."""

import make_llamacpp_reference as reference  # tests/gguf/, on sys.path under pytest
import pytest


@pytest.fixture(scope="module")
def llama_cpp():
    """llama-cpp-python, or skip (fail under QLAB_LLAMACPP=require): see llama_cpp_or_skip."""
    return reference.llama_cpp_or_skip()
