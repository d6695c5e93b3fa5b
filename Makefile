# Two commands for a newcomer:
#   make demo   -> sets everything up (venv, package, job folders) and runs a federated job on the ICH phantom
#   make test   -> sets everything up and runs the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WS ?= workspaces
DEMO_JOB ?= fedmlp_ich
DEMO_SITES ?= 5
TEST_WORKERS ?= 2

.PHONY: setup jobs demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.installed: requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	touch $@

setup: $(VENV)/.installed jobs

jobs: $(VENV)/.installed
	$(BIN)/fedpartial-build-jobs

demo: setup
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/nvflare simulator jobs/$(DEMO_JOB) -w $(WS)/$(DEMO_JOB) -n $(DEMO_SITES) -t $(DEMO_SITES)
	$(BIN)/python -m fedpartial.tools.show_results $(WS)/$(DEMO_JOB)

test: setup
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=30 tests

clean:
	rm -rf $(WS) jobs/*/app/custom
