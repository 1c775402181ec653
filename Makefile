# Two commands: `make demo` and `make test`. Both create or reuse .venv.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo compare test test-all test-gpu lint bench clean

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x $(PY) ]; then \
	  base=$$(tools/find-python.sh); \
	  echo "creating $(VENV) with $$base"; \
	  "$$base" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e ".[test]"; \
	touch $(STAMP)

# Trains the tiny GPT on the Python standard library (1-2 minutes on CPU).
demo: $(STAMP)
	$(PY) examples/gpt/train.py --preset tiny --steps 300 --out out/demo

# The kernel against the reference: error and timing on this machine.
compare: $(STAMP)
	$(PY) examples/demo.py

# CI's command: everything but the `slow` tier (the experimental kernel
# options' further interpreter cases and their segment-id lowerings), on
# every core (pytest-xdist).
test: $(STAMP)
	$(PY) -m ruff check jaxflash tests examples tools
	$(PY) -m pytest -q -n auto -m "not slow" tests

# Every CPU test, the slow tier included.
test-all: $(STAMP)
	$(PY) -m ruff check jaxflash tests examples tools
	$(PY) -m pytest -q -n auto tests

# GPU tests only (run on a CUDA machine).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

# On a GPU machine: the benchmark grid, results under docs/benchmarks/.
bench: $(STAMP)
	$(PY) -m jaxflash.bench

lint: $(STAMP)
	$(PY) -m ruff check jaxflash tests examples tools

clean:
	rm -rf $(VENV) .pytest_cache
