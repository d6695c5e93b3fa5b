"""Shared test fixtures: paths, real-data guards and an NVFlare simulator runner."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One intra-op thread per process: the suite's parallelism is its processes (test workers, simulated sites,
# deployments), and on CI's two cores every extra torch / OpenMP thread spins against them (test_method_zoo.py's
# in-process federated rounds took 4.7x the CPU time with torch's default of a thread per core). Set before torch
# is imported; the processes a test starts inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
"""The shared real data next to the checkout (``../shared/data``: the jobs' relative data roots name it too)."""


def real_data(name: str) -> Path:
    """The folder of a real dataset under ../shared/data; skip when absent (fail in CI, where it must run)."""
    path = SHARED_DATA / name
    if not path.is_dir():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{path} is absent but CI=true: the real-data tests must run in CI")
        pytest.skip(f"real data {path} not available on this machine")
    return path


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-report",
        default=None,
        metavar="FILE",
        help="append one JSON line per test to FILE: its CPU seconds (this process, the child processes it "
        "reaped and the simulator launchers the worker's fork server ran for it, each with its server and sites) "
        "and wall seconds, setup and teardown included (the suite's budget)",
    )


def _machine_cpu_s() -> float | None:
    """The machine's busy CPU seconds since boot (``/proc/stat``: user + nice + system + irq + softirq + steal)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session):
    session.config._machine_cpu0 = (_machine_cpu_s(), time.monotonic())


def pytest_sessionfinish(session, exitstatus):
    """With --cpu-report, the run's last line (the controller's, not a test worker's): the whole machine's busy
    CPU seconds and the wall seconds of the run. The tests' lines count what each test's process and the children
    it reaped used; the deployments' servers and hospitals (started in sessions of their own, not reaped by the
    test) are only in this line."""
    report = session.config.getoption("--cpu-report")
    cpu0, wall0 = getattr(session.config, "_machine_cpu0", (None, None))
    if not report or os.environ.get("PYTEST_XDIST_WORKER") or cpu0 is None:
        return
    line = {
        "run": "machine",
        "cpu_s": round(_machine_cpu_s() - cpu0, 1),
        "wall_s": round(time.monotonic() - wall0, 1),
        "cores": os.cpu_count(),
    }
    with open(report, "a") as f:
        f.write(json.dumps(line) + "\n")


def _chunk_sizes(n: int, workers: int) -> list[int]:
    """How pytest-xdist's ``worksteal`` deals ``n`` tests to ``workers`` at the start: contiguous chunks, the
    remaining tests split evenly over the workers still without one."""
    sizes = []
    for i in range(workers):
        sizes.append((n - sum(sizes)) // (workers - i))
    return sizes


def deal(items: list, workers: int) -> list:
    """``items`` reordered for ``--dist worksteal`` on ``workers`` workers, so that the tests that mostly wait
    start first and apart: each ``deployment`` module (its tests together, in their order: they share one
    deployment) goes to the start of one of the first ``workers - 1`` chunks (the fewest deployment tests first;
    one worker starts on the tests that need the CPU), then the ``integration`` tests are dealt over all chunks
    (the fewest first), then the other tests fill each chunk to its size, in their order. A worker steals from the
    end of another's chunk, so a deployment module is never split."""
    sizes = _chunk_sizes(len(items), workers)
    modules: dict = {}
    for item in items:
        if item.get_closest_marker("deployment") is not None:
            modules.setdefault(item.module.__name__, []).append(item)
    chunks: list[list] = [[] for _ in range(workers)]
    weight = [0] * workers
    for tests in sorted(modules.values(), key=len, reverse=True):
        fits = [i for i in range(max(1, workers - 1)) if len(chunks[i]) + len(tests) <= sizes[i]]
        if not fits:
            return items  # chunks too small to keep a module whole: the order as collected
        i = min(fits, key=lambda j: weight[j])
        chunks[i] += tests
        weight[i] += 10 * len(tests)
    placed = {id(t) for tests in modules.values() for t in tests}
    for item in items:
        if id(item) in placed or item.get_closest_marker("integration") is None:
            continue
        i = min((j for j in range(workers) if len(chunks[j]) < sizes[j]), key=lambda j: weight[j])
        chunks[i].append(item)
        weight[i] += 1
        placed.add(id(item))
    rest = iter([item for item in items if id(item) not in placed])
    for i in range(workers):
        while len(chunks[i]) < sizes[i]:
            chunks[i].append(next(rest))
    return [item for chunk in chunks for item in chunk]


def dealing(config) -> int:
    """The number of workers when this is a worker of ``pytest -n N --dist worksteal`` (``make test``), else 0. A
    worker's own ``--dist`` is "no": the controller's command line (and ``PYTEST_ADDOPTS``) say how it schedules."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    controller = " ".join(
        [*getattr(config, "workerinput", {}).get("mainargv", []), os.environ.get("PYTEST_ADDOPTS", "")]
    )
    return workers if workers > 1 and re.search(r"--dist[= ]worksteal", controller) else 0


def pytest_collection_modifyitems(session, config, items):
    """Under ``pytest -n N --dist worksteal`` (``make test``), deal the tests as :func:`deal` says. Every worker
    collects and reorders alike (the order is a function of the collected tests and N only)."""
    workers = dealing(config)
    if workers:
        items[:] = deal(items, workers)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    report = item.config.getoption("--cpu-report")
    if not report:
        yield
        return
    t0, w0, f0 = os.times(), time.monotonic(), FORKED_CPU[0]
    yield
    t1 = os.times()
    line = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "start": round(time.time() - (time.monotonic() - w0), 1),
        "cpu_s": round(sum(t1[:4]) - sum(t0[:4]) + FORKED_CPU[0] - f0, 2),
        "wall_s": round(time.monotonic() - w0, 2),
    }
    with open(report, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def _method_registry_restored():
    """A test that registers a method of its own (a rule that raises, ...) leaves the registry as it found it:
    the README's methods table is checked against the registry, in whichever worker and order."""
    from fedpartial.methods import base, load_all

    load_all()  # the built-in methods first: load_all runs once per process, whatever the test that calls it
    before = dict(base._REGISTRY)
    yield
    base._REGISTRY.clear()
    base._REGISTRY.update(before)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One prepared-dataset cache for the whole session (FEDPARTIAL_CACHE)."""
    return tmp_path_factory.mktemp("fedpartial_cache")


SCHEDULE_KEYS = ("warmup_rounds", "warm_rounds", "labelled_only_rounds")  # the methods' first-stage lengths


def one_round_first_stage(method) -> dict:
    """``method_args`` that shorten a registered method's first stage (warm-up, labelled-only rounds) to 1 round,
    so that round 2 of a short run is its second stage; {} for a method without one."""
    return {k: 1 for k in SCHEDULE_KEYS if k in method.option_names()}


HAM_WITHOUT_TABLE = {"protocol": "missing_k", "k": 3, "table": None}
"""A HAM10000 job's ``dataset.prepare`` on fewer sites than its table's 5: each site missing 3 of the 7 classes."""


def copy_job(
    job: str,
    dest: Path,
    num_rounds: int | None = None,
    executor_args: dict | None = None,
    min_clients: int | None = None,
    sites: int | None = None,
) -> Path:
    """Copy jobs/<job> to dest with the package built into its apps and the given overrides; ``sites``: the job
    on that many simulated sites (its ``dataset.prepare.num_sites`` and its ``min_clients``)."""
    from fedpartial.data.presets import deep_merge
    from fedpartial.tools.build_jobs import customise_job

    if sites is not None:
        executor_args = deep_merge(executor_args or {}, {"dataset": {"prepare": {"num_sites": sites}}})
        min_clients = sites if min_clients is None else min_clients
    return customise_job(REPO / "jobs" / job, dest, num_rounds, executor_args, min_clients=min_clients)


# NVFlare failures that leave a simulator or a recipe run waiting forever instead of exiting: the simulator gives a
# site's worker process a fixed 60 s to connect (``simulator_runner.py``, "Failed to create connection to the child
# process"; no knob in NVFlare 2.9), after which that site's thread ends and the server waits for it until the
# round's timeout. Seen under load (both cores busy).
START_FAILURES = ("Failed to create connection to the child process", "run_client_thread error")
START_RETRIES = 1


_FORKS: list = []  # this test worker's fork server for simulator launchers (started at the first run)
FORKED_CPU: list[float] = [0.0]  # CPU seconds of the launchers it forked that ended (the CPU report adds them)
LAUNCHER = ["-m", "fedpartial.fl.simulator"]


def _popen(cmd: list[str], env: dict, cwd: Path, out, err):
    """``subprocess.Popen(cmd, ..., start_new_session=True)``; a simulator launcher (``python -m
    fedpartial.fl.simulator``) is forked from this worker's :class:`fedpartial.processes.ForkServer` instead (torch,
    TorchDynamo and NVFlare imported once per worker, not once per run: about 6 CPU-s a run). The launcher then
    runs as it does under ``job.py`` (its own fork server, server process and site workers)."""
    from fedpartial.fl.simulator import FORK_ENV, PRELOAD, SIMULATOR

    if cmd[1:3] == LAUNCHER and cmd[0] == sys.executable and os.environ.get(FORK_ENV, "1") != "0":
        from fedpartial.processes import ForkServer

        if not _FORKS:
            _FORKS.append(ForkServer.spawn((*PRELOAD, SIMULATOR)))
        try:
            return _FORKS[0].popen(cmd, env=env, cwd=str(cwd), setsid=True, stdout=out.fileno(), stderr=err.fileno())
        except OSError:
            pass
    return subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=out, stderr=err, text=True, start_new_session=True)


def _start_failure(text: str) -> str | None:
    return next((line for line in text.splitlines() if any(f in line for f in START_FAILURES)), None)


def run_watched(
    cmd: list[str],
    env: dict,
    timeout: int,
    logs: list[Path] = (),
    cwd: Path = REPO,
    retries: int = START_RETRIES,
    before_retry=None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` like ``subprocess.run(capture_output=True, text=True)``, watching its output and ``logs`` (files
    it writes, e.g. the simulator's server log) for a :data:`START_FAILURES` line: then it is killed at once (its
    whole process group) and run again, at most ``retries`` times (``before_retry()`` first, e.g. to clear the
    workspace); a last failed start ends with ``returncode`` -9 and the failure line plus the output's tail, never
    after waiting for ``timeout``."""
    import signal
    import tempfile
    import time

    for attempt in range(retries + 1):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            # only what this attempt writes: each log's size and inode taken BEFORE the process starts (taken
            # after, a line written at once was counted as old, and the attempt waited for its timeout: seen
            # under load); a log written anew (another inode, or shorter) is read from its start
            start = {f: (f.stat().st_size, f.stat().st_ino) if f.is_file() else (0, None) for f in logs}
            proc = _popen(cmd, env, cwd, out, err)
            t0, failure = time.time(), None

            def written(f: Path) -> str:
                if not f.is_file():
                    return ""
                size, ino = start[f]
                with open(f, "rb") as fh:
                    st = os.fstat(fh.fileno())
                    fh.seek(size if st.st_ino == ino and st.st_size >= size else 0)
                    return fh.read().decode(errors="replace")

            while proc.poll() is None:
                time.sleep(1.0)
                out.seek(0), err.seek(0)
                text = out.read() + err.read() + "".join(written(f) for f in logs)
                failure = _start_failure(text)
                if failure or time.time() - t0 > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
            FORKED_CPU[0] += getattr(proc, "cpu_s", 0.0)
        if failure is None:
            if time.time() - t0 > timeout and proc.returncode != 0:
                raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
            return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        print(f"start failure (attempt {attempt + 1} of {retries + 1}): {failure.strip()}", file=sys.stderr)
        if attempt < retries and before_retry is not None:
            before_retry()
    return subprocess.CompletedProcess(cmd, -9, stdout, f"{stderr}\nSTART FAILED: {failure.strip()}")


def run_simulator(
    job_dir: Path,
    workspace: Path,
    n: int,
    env: dict | None = None,
    timeout: int = 600,
    threads: int | None = None,
    cli: bool = False,
) -> subprocess.CompletedProcess:
    """A job folder in NVFlare's simulator as ``job.py`` runs it (``python -m fedpartial.fl.simulator JOB -w WS -n
    N -t T``: its own ports, so the suite's simulators side by side never take each other's); ``cli``: through
    the classic ``nvflare simulator`` command the README shows. Retried once on a failed start
    (:func:`run_watched`)."""
    import shutil

    args = [str(job_dir), "-w", str(workspace), "-n", str(n), "-t", str(threads or n)]
    cmd = (
        [str(Path(sys.executable).parent / "nvflare"), "simulator", *args]
        if cli
        else [sys.executable, "-m", "fedpartial.fl.simulator", *args]
    )
    full_env = {**os.environ, "FEDPARTIAL_DATA_DIR": str(REPO), **(env or {})}
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"

    def fresh():  # a failed start leaves nothing worth keeping: its simulate_job run is started anew
        shutil.rmtree(workspace / "server" / "simulate_job", ignore_errors=True)

    return run_watched(cmd, full_env, timeout, logs=[workspace / "server" / "log.txt"], before_retry=fresh)


RECIPE_RUNNER = """
import json, sys
from pathlib import Path
from fedpartial.fl.simulator import SupervisedSimEnv
from fedpartial.tools.build_jobs import job_recipe
job, root, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
recipe = job_recipe(Path("jobs") / job, **overrides)
recipe.execute(SupervisedSimEnv(num_clients=recipe.num_sites, num_threads=recipe.num_sites, workspace_root=root))
"""


def run_recipe(
    job: str,
    workspace_root: Path,
    overrides: dict | None = None,
    sites: int | None = None,
    env: dict | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    """``jobs/<job>/job.py``'s recipe (with ``overrides``) run in NVFlare's SimEnv from the checkout, as
    ``python jobs/<job>/job.py`` does, WITHOUT ``FEDPARTIAL_DATA_DIR`` (the sites find data from the checkout);
    results in ``workspace_root/<job>`` (retried once on a failed start, :func:`run_watched`)."""
    import shutil

    overrides = dict(overrides or {})
    if sites is not None:
        overrides["num_sites"] = sites
    full_env = {k: v for k, v in os.environ.items() if k != "FEDPARTIAL_DATA_DIR"}
    full_env.update(env or {})
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    cmd = [sys.executable, "-c", RECIPE_RUNNER, job, str(workspace_root), json.dumps(overrides)]
    name = overrides.get("name") or job
    return run_watched(
        cmd,
        full_env,
        timeout,
        logs=[Path(workspace_root) / name / "server" / "log.txt"],
        before_retry=lambda: shutil.rmtree(Path(workspace_root) / name, ignore_errors=True),
    )


def results_of(workspace: Path) -> dict:
    path = workspace / "server" / "simulate_job" / "results.json"
    assert path.is_file(), f"no results.json in {workspace}"
    return json.loads(path.read_text())


def check_two_rounds(ws: Path, method: str) -> dict:
    """What a 2-round simulator run (test every round) must leave in its results, for any job: every site trained
    and was averaged in both rounds; the simulator's shared validation / test sets scored once each round, by the
    first site (by every site with its own model when the method keeps local parts); the best round and the
    final evaluation of both models, per class; the server's data summary and its TensorBoard events. Returns
    the results."""
    res = results_of(ws)
    sites = sorted(res["data"]["sites"], key=lambda s: int(s.rsplit("-", 1)[1]))
    assert res["method"] == method and res["num_rounds"] == 2 and len(res["rounds"]) == 2
    shared = res["data"]["shared_eval_sets"]
    assert shared["val"] == shared["test"] == [sites]  # the simulator's central sets
    n_test, n_val = res["data"]["sites"]["site-1"]["n_test"], res["data"]["sites"]["site-1"]["n_val"]
    # each shared image is scored once, by the first site; with local parts (PFL) each site scores its own model
    scorers = sites if res["local_parts"] else ["site-1"]
    for r in res["rounds"]:
        assert sorted(r["sites"]) == sorted(sites), r["sites"]  # all contributed
        assert r["rejected"] == {} and r["missing"] == [], (r["rejected"], r["missing"])  # ... and were averaged
        assert r["val"]["macro"]["auc"] is not None and r["test"] is not None
        assert r["evaluated_by"] == {"val": scorers, "test": scorers}
        assert r["val"]["n"] == n_val * len(scorers) and r["test"]["n"] == n_test * len(scorers)
    assert res["best"] is not None and res["best"]["trained_rounds"] == 1
    for model in ("FL_global_model.pt", "best_FL_global_model.pt"):
        final = res["final"][model]
        assert final["sites"] == scorers and final["test"]["n"] == n_test * len(scorers)
        assert 0.0 <= final["test"]["macro"]["auc"] <= 1.0
        assert set(final["test"]["per_class"]) == set(res["rounds"][0]["val"]["per_class"])
    assert "annotated positives per site and class" in server_log(ws)
    assert (ws / "server" / "simulate_job" / "tb_events").is_dir()
    return res


def server_log(workspace: Path) -> str:
    path = workspace / "server" / "log.txt"
    return path.read_text() if path.is_file() else ""
