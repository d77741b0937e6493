# Two commands do all the set-up work on a fresh machine:
#   make demo   # install into .venv (first time), then the main job: pretrain a tiny model,
#               # evaluate under KV compression, fine-tune with compression in the loop, evaluate
#   make test   # install into .venv (first time), then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo test test-slow lint bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# CPU torch first, from the wheel on disk, so pip does not pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: install
	OMP_NUM_THREADS=1 $(BIN)/python recipes/finetune_compress.py

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
