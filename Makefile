# kvsvc: two commands for a new machine -- `make demo` (a real P->D transfer) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build of torch unless an NVIDIA GPU is present; override with TORCH_SPEC=... on GPU nodes.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
STAMP := $(VENV)/.installed

NODE_STAMP := clients/node/node_modules/.installed

.PHONY: venv demo test test-full lint proto proto-check bench clean node

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[server,dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvsvc demo

test: $(STAMP) proto-check node
	$(BIN)/python -m pytest -q -m "not full"

test-full: $(STAMP) proto-check node
	$(BIN)/python -m pytest -q

# The Node.js client's packages (skipped, with a note, where Node.js is absent).
node: $(NODE_STAMP)

$(NODE_STAMP): clients/node/package.json clients/node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd clients/node && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: the Node.js client test will be skipped"; fi

lint: $(STAMP)
	$(BIN)/ruff check kvsvc tests clients/python
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvsvc bench --json bench/results.json

proto: $(STAMP)
	$(BIN)/python -m kvsvc.protogen

proto-check: $(STAMP)
	$(BIN)/python -m kvsvc.protogen --check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache clients/node/node_modules
