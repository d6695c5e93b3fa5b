# Two commands for a newcomer:
#   make demo   -> sets everything up (venv, package, job folders) and runs a federated job on the ICH phantom
#                  (python jobs/$(DEMO_JOB)/job.py: the job's NVFlare recipe in the simulator, SimEnv)
#   make test   -> sets everything up and runs the test suite (what CI runs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WS ?= workspaces
DEMO_JOB ?= fedmlp_ich
# three test workers on CI's two cores: the deployment tests mostly wait on NVFlare (polling, heartbeats, job
# starts), so a third worker uses the cores they leave idle; tests/conftest.py deals the tests so that the deployment
# modules start at once on two workers while the third starts on the simulator runs. On a machine where that kept
# both cores 94 % busy (the machine line of `make test` with --cpu-report) a fourth worker was no faster (21 min 13 s
# vs 20 min 41 s); on a faster one, 73 % busy with three, four took 6 min 21 s against 7 min 5 s
# (`make test TEST_WORKERS=4`)
TEST_WORKERS ?= 3

.PHONY: setup jobs check-jobs check-readme demo lint test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.installed: requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	touch $@

setup: $(VENV)/.installed jobs

# export every jobs/<name>/job.py into its NVFlare job folder (meta.json, app/config, app/custom; git-ignored)
jobs: $(VENV)/.installed
	$(BIN)/fedpartial-build-jobs

check-jobs: $(VENV)/.installed
	$(BIN)/fedpartial-build-jobs --check

demo: setup
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python jobs/$(DEMO_JOB)/job.py --workspace $(WS)
	$(BIN)/python -m fedpartial.tools.show_results $(WS)/$(DEMO_JOB)

# the README's expected demo output is the output of the README's commands (run as written; CI runs this)
check-readme: setup
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python benchmarks/readme_demo.py

# the formatter and the lint rules of pyproject.toml [tool.ruff] (seconds); `ruff format` then fixes a format
lint: $(VENV)/.installed
	$(BIN)/ruff format --check --quiet custom tests benchmarks admin jobs
	$(BIN)/ruff check --quiet custom tests benchmarks admin jobs

# PYTHONDONTWRITEBYTECODE= : Python keeps the compiled modules (__pycache__, git-ignored) even where the machine's
# environment says not to write them; every simulated site, server and deployment process imports the package anew
test: setup lint
	PATH=$(abspath $(BIN)):$$PATH PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=30 tests

clean:
	rm -rf $(WS) jobs/*/app jobs/*/meta.json
