"""End to end on localhost: the real deployment path, as users run it.

``nvflare provision`` with provisioning/project.yml (server on localhost, free ports, 3 hospitals, admins);
each hospital's data prepared with ``fedpartial-prepare`` and declared in its kit's
``local/fedpartial_data.json`` (no ``FEDPARTIAL_REQUIRE_SITE_CONFIG``: real sites never fall back to a simulated
split); server and sites started with their kits' ``startup/start.sh`` in a temporary HOME; a tiny
``fedmlp_ich`` submitted with its custom code (BYOC) by the project admin through admin/fedpartial_admin.py,
followed, downloaded, its results.json checked and ``fedpartial-predict`` run on the downloaded global model.
Then: an org admin may not submit custom code; the non-BYOC way (allow-listed installed package) deploys, and a
site without data configuration stops it with a message naming the site. Every process started here is killed
at the end, also when a test fails, and the teardown checks that none is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO
from fedpartial.tools.admin import FINISHED_OK

pytestmark = pytest.mark.integration

HOSPITALS = ["hospital-1", "hospital-2", "hospital-3"]
PROJECT_ADMIN = "admin@coordinator.org"
ADMIN_SCRIPT = REPO / "admin" / "fedpartial_admin.py"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _project_yml(dest: Path) -> Path:
    """provisioning/project.yml with the server on localhost and free ports (everything else unchanged)."""
    cfg = yaml.safe_load((REPO / "provisioning" / "project.yml").read_text())
    fl_port, admin_port = _free_ports(2)
    server = next(p for p in cfg["participants"] if p["type"] == "server")
    server.update(name="localhost", fed_learn_port=fl_port, admin_port=admin_port)
    clients = [p["name"] for p in cfg["participants"] if p["type"] == "client"]
    assert clients == HOSPITALS, f"the test expects the project's hospitals {HOSPITALS}, found {clients}"
    path = dest / "project.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _our_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (the test's temporary root)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if marker in cmd and "zombie" not in state:
            pids.append(int(d.name))
    return pids


class Deployment:
    """A provisioned federation on localhost, run from a temporary root."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.home.mkdir()
        self.groups: list[int] = []
        self.env = {**os.environ, "HOME": str(self.home), "FEDPARTIAL_CACHE": str(root / "cache"),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        # sites find their data through their own kit only (a real site needs no FEDPARTIAL_REQUIRE_SITE_CONFIG:
        # outside the simulator there is no simulated fallback); the code comes with the job (BYOC)
        for var in ("FEDPARTIAL_SITE_CONFIG", "FEDPARTIAL_REQUIRE_SITE_CONFIG", "NVFL_WORKSPACE"):
            self.env.pop(var, None)
        # NVFlare appends a job's custom/ to the END of sys.path: a fedpartial installed in the environment (e.g.
        # an editable install of another checkout) would shadow the job's copy. Put this checkout first so the
        # sites run the code under test (in CI both are the same checkout).
        self.env["PYTHONPATH"] = str(REPO / "custom")

    def provision(self) -> Path:
        yml = _project_yml(self.root)
        subprocess.run([sys.executable, "-m", "nvflare.cli", "provision", "-p", str(yml), "-w",
                        str(self.root / "ws")], check=True, env=self.env, cwd=self.root, capture_output=True)
        self.kits = self.root / "ws" / "fedpartial" / "prod_00"
        return self.kits

    def prepare_hospital_data(self) -> None:
        """Each hospital's manifests (the hospital path: fedpartial-prepare, then local/fedpartial_data.json)."""
        data = self.root / "data"
        subprocess.run([sys.executable, "-m", "fedpartial.data.prepare", "--source", "ich_phantom", "--out",
                        str(data), "--sites", "3", "--protocol", "missing_k", "--k", "3", "--source-arg",
                        "n_images=240", "--source-arg", "size=32", "--seed", "0"], check=True, env=self.env,
                       capture_output=True, cwd=self.root)
        for i, site in enumerate(HOSPITALS, start=1):
            cfg = {"datasets": {"ich_phantom": {"data_root": str(data), "train": str(data / f"site-{i}.csv"),
                                                "val": str(data / "val.csv"), "test": str(data / "test.csv")}}}
            (self.kits / site / "local" / "fedpartial_data.json").write_text(json.dumps(cfg, indent=1))

    def start(self, participant: str) -> None:
        log = open(self.root / f"{participant}.out", "w")
        proc = subprocess.Popen(["bash", str(self.kits / participant / "startup" / "start.sh")], env=self.env,
                                cwd=self.kits / participant, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.groups.append(proc.pid)

    def admin(self, *args: str, user: str = PROJECT_ADMIN, timeout: float = 200) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(ADMIN_SCRIPT), "--kit", str(self.kits / user), "--connect-timeout", "90",
               *args]
        return subprocess.run(cmd, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=timeout)

    def stop(self) -> list[int]:
        """Kill every process group started here and every process of this root (job processes run in their own
        sessions); returns the pids still alive afterwards (must be none)."""
        marker = str(self.root) + os.sep
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in self.groups:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
            for pid in _our_processes(marker):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 10
            while time.time() < deadline and _our_processes(marker):
                time.sleep(0.2)
        return _our_processes(marker)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    t0 = time.time()
    dep = Deployment(tmp_path_factory.mktemp("deploy"))
    try:
        dep.provision()
        dep.prepare_hospital_data()
        for participant in ["localhost", *HOSPITALS]:
            dep.start(participant)
        dep.job = _tiny_job(dep.root / "jobs", "fedmlp_ich", rounds=2)
        yield dep
    finally:
        left = dep.stop()
        print(f"deployment fixture: {time.time() - t0:.0f} s in all")
        assert not left, f"processes left behind: {left}"


def _tiny_job(dest: Path, name: str, rounds: int) -> Path:
    """jobs/fedmlp_ich for 3 clients, a few rounds, 32 px (the job's data come from the sites' own configuration)."""
    from fedpartial.tools.build_jobs import customise_job

    dest.mkdir(exist_ok=True)
    return customise_job(REPO / "jobs" / "fedmlp_ich", dest / name, num_rounds=rounds, min_clients=3,
                         executor_args={"dataset": {"image_size": 32}, "evaluation": {"test_every": 1}})


def test_submit_follow_download_predict(deployment):
    dep, t0 = deployment, time.time()
    out = dep.root / "results"
    proc = dep.admin("run", str(dep.job), "-o", str(out), "--timeout", "150", "--poll", "1")
    log = proc.stdout + proc.stderr
    print(log)
    assert proc.returncode == 0, log
    assert f"ended: {FINISHED_OK}" in log
    # the admin script followed the job: the training workflow's round and every site's current task (polled
    # every second: a 2-second round can fall between two polls, so not every round need show)
    assert re.search(r"scatter_and_gather round [12]/2 ", log), log
    assert all(re.search(rf"{site}: [a-z_+]+", log) for site in HOSPITALS), log

    results = json.loads(next(out.rglob("results.json")).read_text())
    assert results["method"] == "fedmlp" and results["num_rounds"] == 2
    assert sorted(results["rounds"][-1]["sites"]) == HOSPITALS
    final = next(v for k, v in results["final"].items() if k.startswith("FL_global_model"))
    # the hospitals share one test.csv here: it is scored once, by the first of them
    assert final["sites"] == sorted(HOSPITALS)[:1] and 0.0 <= final["test"]["macro"]["auc"] <= 1.0
    assert results["data"]["shared_eval_sets"]["test"] == [sorted(HOSPITALS)]
    assert re.search(r"FL_global_model\S* on test[^\n]*\nclass +BACC +AUC", log), log  # the table the script prints

    # the downloaded global model predicts on the test manifest with the training preprocessing
    csv = dep.root / "pred.csv"
    res = subprocess.run([sys.executable, "-m", "fedpartial.tools.predict", str(out), "--manifest",
                          str(dep.root / "data" / "test.csv"), "-o", str(csv)], env=dep.env, capture_output=True,
                         text=True, timeout=120, cwd=dep.root)
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(csv)
    test_rows = len(pd.read_csv(dep.root / "data" / "test.csv"))
    assert len(df) == test_rows and df.filter(like="prob_").shape[1] == 5
    assert df.filter(like="prob_").apply(lambda c: c.between(0, 1)).all().all()
    print(f"e2e job (submit -> results -> predict): {time.time() - t0:.0f} s")


def test_org_admin_may_not_submit_custom_code(deployment):
    proc = deployment.admin("submit", str(deployment.job), user="admin@hospital1.org", timeout=60)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "fedpartial-admin: error:" in log and "not authorized" in log.lower(), log


def test_installed_package_site_without_data_config_fails_naming_the_site(deployment):
    """The non-BYOC way (the package importable at every participant, here through PYTHONPATH; each kit allows
    its classes with fedpartial-allow-list; the job goes without custom code) gets the job's components built on
    the server and all sites, and a site whose data configuration is missing stops the job before any training
    with a message naming the site and where the configuration belongs."""
    dep = deployment
    job = _tiny_job(dep.root / "jobs", "fedmlp_ich_installed", rounds=1)
    kits = [str(dep.kits / p) for p in ["localhost", *HOSPITALS]]
    subprocess.run([sys.executable, "-m", "fedpartial.tools.allow_list", *kits, "--jobs", str(job)], check=True,
                   env=dep.env, capture_output=True)
    cfg = dep.kits / "hospital-2" / "local" / "fedpartial_data.json"
    cfg.rename(cfg.with_suffix(".bak"))
    try:
        proc = dep.admin("run", str(job), "--without-custom", "-o", str(dep.root / "results_bad"),
                         "--timeout", "120", "--poll", "1")
    finally:
        cfg.with_suffix(".bak").rename(cfg)
    log = proc.stdout + proc.stderr
    print(log)
    assert proc.returncode == 1, log
    assert "site 'hospital-2' has no data configured for dataset 'ich_phantom'" in log, log
    assert "hospital-2/local/fedpartial_data.json" in log  # where to put it
    assert "ended: FINISHED:EXECUTION_EXCEPTION" in log
    assert "round 1/1" not in log  # stopped before any training
    # the message comes from fedpartial's executor at hospital-2 and its data check on the server: both were
    # built from the installed, allow-listed package (refused classes would end with an UnsafeComponentError)
    assert "DATA CHECK FAILED: site 'hospital-2' failed task 'data_summary': SiteDataError" in log, log
    assert "UnsafeComponentError" not in log
    downloaded = next((dep.root / "results_bad").iterdir())
    assert not list(downloaded.rglob("custom/fedpartial"))  # the job really came without code


def test_recipe_runs_on_the_federation(deployment):
    """A job's recipe (jobs/fedavg_ich/job.py) submitted to the provisioned federation with NVFlare's ProdEnv (the
    FLARE API, the project admin's kit): it finishes, every hospital trains on its own configured data."""
    from nvflare.recipe import ProdEnv

    from fedpartial.tools.build_jobs import job_recipe

    dep = deployment
    recipe = job_recipe(REPO / "jobs" / "fedavg_ich", num_rounds=1, num_sites=3,
                        dataset={"preset": "ich_phantom", "image_size": 32}, evaluation={"test_every": 1})
    run = recipe.execute(ProdEnv(startup_kit_location=str(dep.kits / PROJECT_ADMIN), username=PROJECT_ADMIN,
                                 login_timeout=30))
    result = run.get_result(timeout=240)
    assert result is not None and "FINISHED" in str(run.get_status()), run.get_status()
    results = json.loads(next(Path(result).rglob("results.json")).read_text())
    assert results["method"] == "fedavg" and sorted(results["rounds"][0]["sites"]) == HOSPITALS
    assert {s: i["n_train"] for s, i in results["data"]["sites"].items()} == {
        h: len(pd.read_csv(dep.root / "data" / f"site-{i}.csv")) for i, h in enumerate(HOSPITALS, start=1)}
