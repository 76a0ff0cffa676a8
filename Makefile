# Quick start: `make bench` (the default benchmark) and `make test` (the test suite).
# Each creates the virtualenv .venv on first use.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: bench test test-gpu clean

bench: $(VENV)/.ready
	$(BIN)/moekit bench

test: $(VENV)/.ready
	$(BIN)/python -m pytest -q -n 2 tests

$(VENV)/.ready: pyproject.toml scripts/setup_venv.sh
	./scripts/setup_venv.sh $(VENV)

clean:
	rm -rf $(VENV)
