"""Shared test fixtures: paths, real-data guards and an NVFlare simulator runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def real_data(name: str) -> Path:
    """The folder of a real dataset under ../shared/data; skip when absent (fail in CI, where it must run)."""
    path = SHARED_DATA / name
    if not path.is_dir():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{path} is absent but CI=true: the real-data tests must run in CI")
        pytest.skip(f"real data {path} not available on this machine")
    return path


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One prepared-dataset cache for the whole session (FEDPARTIAL_CACHE)."""
    return tmp_path_factory.mktemp("fedpartial_cache")


SCHEDULE_KEYS = ("warmup_rounds", "warm_rounds", "labelled_only_rounds")  # the methods' first-stage lengths


def one_round_first_stage(method) -> dict:
    """``method_args`` that shorten a registered method's first stage (warm-up, labelled-only rounds) to 1 round,
    so that round 2 of a short run is its second stage; {} for a method without one."""
    return {k: 1 for k in SCHEDULE_KEYS if k in method.option_names()}


def copy_job(job: str, dest: Path, num_rounds: int | None = None, executor_args: dict | None = None,
             min_clients: int | None = None) -> Path:
    """Copy jobs/<job> to dest with the package built into its apps and the given overrides."""
    from fedpartial.tools.build_jobs import customise_job

    return customise_job(REPO / "jobs" / job, dest, num_rounds, executor_args, min_clients=min_clients)


def run_simulator(job_dir: Path, workspace: Path, n: int, env: dict | None = None, timeout: int = 600,
                  threads: int | None = None) -> subprocess.CompletedProcess:
    """`nvflare simulator JOB -w WS -n N -t T` as a user runs it."""
    nvflare = Path(sys.executable).parent / "nvflare"
    cmd = [str(nvflare), "simulator", str(job_dir), "-w", str(workspace), "-n", str(n), "-t", str(threads or n)]
    full_env = {**os.environ, "FEDPARTIAL_DATA_DIR": str(REPO), **(env or {})}
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


RECIPE_RUNNER = """
import json, sys
from pathlib import Path
from nvflare.recipe import SimEnv
from fedpartial.tools.build_jobs import job_recipe
job, root, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
recipe = job_recipe(Path("jobs") / job, **overrides)
recipe.execute(SimEnv(num_clients=recipe.num_sites, num_threads=recipe.num_sites, workspace_root=root))
"""


def run_recipe(job: str, workspace_root: Path, overrides: dict | None = None, sites: int | None = None,
               env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``jobs/<job>/job.py``'s recipe (with ``overrides``) run in NVFlare's SimEnv from the checkout, as
    ``python jobs/<job>/job.py`` does, WITHOUT ``FEDPARTIAL_DATA_DIR`` (the sites find data from the checkout);
    results in ``workspace_root/<job>``."""
    overrides = dict(overrides or {})
    if sites is not None:
        overrides["num_sites"] = sites
    full_env = {k: v for k, v in os.environ.items() if k != "FEDPARTIAL_DATA_DIR"}
    full_env.update(env or {})
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    cmd = [sys.executable, "-c", RECIPE_RUNNER, job, str(workspace_root), json.dumps(overrides)]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def results_of(workspace: Path) -> dict:
    path = workspace / "server" / "simulate_job" / "results.json"
    assert path.is_file(), f"no results.json in {workspace}"
    return json.loads(path.read_text())


def server_log(workspace: Path) -> str:
    path = workspace / "server" / "log.txt"
    return path.read_text() if path.is_file() else ""
