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

# CI's command: everything but the `slow` tier, on every core
# (pytest-xdist), within 10 minutes on 2 cores.  Every backend, mask kind,
# dtype, head layout, transformation, sharding form and the GPT example
# run here in representative cases; the exhaustive grids, hypothesis
# searches and the Mosaic GPU interpreter runs beyond the per-commit set
# (which reaches every traced kernel line, tests/kernel_coverage.py) are
# `slow`.
# The slowest 15 tests are printed, to keep the budget in view.
test: $(STAMP)
	$(PY) -m ruff check jaxflash tests examples tools
	$(PY) -m pytest -q -n auto -m "not slow" --dist worksteal --durations=15 tests

# Every CPU test, the slow tier included.
test-all: $(STAMP)
	$(PY) -m ruff check jaxflash tests examples tools
	$(PY) -m pytest -q -n auto --durations=30 tests

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
