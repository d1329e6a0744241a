# difftrain — every target that needs the environment depends on `install`, so that on a fresh
# machine `make test` alone creates .venv, installs difftrain with its dev extras, and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DT := $(VENV)/bin/difftrain

.PHONY: install test test-fast lint format quickstart bench gpu-check clean help docs claims

help:
	@echo "make install     create $(VENV) and install difftrain with dev extras"
	@echo "make quickstart  train the quickstart model (~5 min on a 2-core CPU) and sample from it"
	@echo "make test        run the test suite (CPU)"
	@echo "make lint        ruff check + format check"
	@echo "make bench       run the benchmark scripts and write benchmarks/results/*.json"
	@echo "make claims      diff vs baseline over 3 seeds (~1 h on 2 cores): benchmarks/results/claims.md"
	@echo "make docs        regenerate the recipe reference in docs/recipes.md"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check difftrain tests benchmarks
	$(VENV)/bin/ruff format --check difftrain tests benchmarks

format: install
	$(VENV)/bin/ruff check --fix difftrain tests benchmarks
	$(VENV)/bin/ruff format difftrain tests benchmarks

quickstart: install
	$(DT) pretrain quickstart train.resume=auto
	$(DT) generate runs/quickstart --prompt 'def fibonacci(n):' --max-new-tokens 120 --seed 0

bench: install
	$(PY) benchmarks/run_all.py

# The claims study: recall-diff/-baseline and quickstart/-baseline over 3 seeds, evaluated
# (CLAIMS_ARGS passes options, e.g. CLAIMS_ARGS='--quickstart-steps 300').
claims: install
	$(PY) benchmarks/claims.py $(CLAIMS_ARGS)

gpu-check: install
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist *.egg-info

# Regenerate the recipe reference in docs/recipes.md from the schema (a test fails when it is stale).
docs: install
	$(PY) -c "import pathlib; from difftrain.recipe import recipe_reference_markdown as t; p = pathlib.Path('docs/recipes.md'); s = p.read_text(); a, b = '<!-- recipe-reference:start -->\n', '<!-- recipe-reference:end -->'; i, j = s.index(a) + len(a), s.index(b); p.write_text(s[:i] + t() + s[j:])"
