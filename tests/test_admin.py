"""Deployment helpers without a running federation: the admin script's progress / failure reporting (on a fake
FLARE API session), the real-site data policy, the project.yml and the job customisation used by the e2e test."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from conftest import REPO
from fedpartial.data.presets import resolve_dataset
from fedpartial.data.site_config import (
    REQUIRE_ENV,
    SITE_CONFIG_ENV,
    SiteDataError,
    resolve_site_data,
    site_config_required,
)
from fedpartial.tools import admin


def test_failure_lines_pick_the_sites_error(tmp_path):
    log = tmp_path / "job" / "workspace" / "log.txt"
    log.parent.mkdir(parents=True)
    err = (
        "site 'hospital-2' failed task 'data_summary': SiteDataError: site 'hospital-2' has no data configured "
        "for dataset 'ich_phantom'"
    )
    log.write_text(
        "2026-01-01 10:00:00,000 - ServerRunner - INFO - [identity=x, run=1] - Round 0 started.\n"
        f"2026-01-01 10:00:01,000 - DataSummaryProcessor - ERROR - [identity=x, peer=hospital-2] - "
        f"DATA CHECK FAILED: {err}\n"
        f"2026-01-01 10:00:02,000 - DataSummaryProcessor - ERROR - [identity=x, peer=hospital-2] - "
        f"DATA CHECK FAILED: {err}\n"
    )
    assert admin.failure_lines(tmp_path) == [f"DATA CHECK FAILED: {err}"]


def test_admin_cli_needs_a_kit_and_reads_results_offline(tmp_path, capsys):
    assert admin.main(["check", "jobs/fedavg_ich"]) == 2
    assert "--kit" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not an admin startup kit"):
        admin.open_session(tmp_path)
    res = {
        "method": "fedmlp",
        "dataset": "ich_phantom",
        "num_rounds": 2,
        "seconds_per_round": 1.5,
        "best": None,
        "final": {},
        "rounds": [],
    }
    (tmp_path / "dl" / "j1" / "workspace").mkdir(parents=True)
    (tmp_path / "dl" / "j1" / "workspace" / "results.json").write_text(json.dumps(res))
    assert admin.main(["results", str(tmp_path / "dl")]) == 0
    out = capsys.readouterr().out
    assert "# fedmlp on ich_phantom (unknown), 2 rounds, 1.5 s/round" in out and "error:" not in out
    # a failed job's download: its error lines first, and no table
    log = tmp_path / "failed" / "j2" / "workspace" / "log.txt"
    log.parent.mkdir(parents=True)
    log.write_text(
        "2026-01-01 10:00:01,000 - DataSummaryProcessor - ERROR - [identity=x, peer=h2] - DATA CHECK "
        "FAILED: site 'h2' failed task 'data_summary': SiteDataError: no data\n"
    )
    assert admin.main(["results", str(tmp_path / "failed")]) == 1
    out = capsys.readouterr().out
    assert (
        out.startswith("error: DATA CHECK FAILED: site 'h2' failed task 'data_summary'")
        and "no results table: no results.json under" in out
    )
    assert admin.main(["--kit", str(tmp_path), "check", "jobs/fedavg_ich"]) == 1
    assert "not an admin startup kit" in capsys.readouterr().err
    for gone in ("submit", "status", "wait", "download", "list", "run"):  # NVFlare's own: nvflare job ...
        with pytest.raises(SystemExit):
            admin.main(["--kit", str(tmp_path), gone, "x"])


def test_without_custom_and_resume_folder_write_the_folder_to_submit(tmp_path):
    """``without-custom``: the job folder without its apps' code (the non-BYOC way); ``resume-folder``: the same
    job with ``resume`` on the server's training workflow and the sites' executor, nothing else changed."""
    from conftest import copy_job

    job = copy_job("fedavg_ich", tmp_path / "job", min_clients=3)
    assert list(job.rglob("custom/fedpartial"))
    bare = admin.without_custom(job, tmp_path / "bare")
    assert not list(bare.rglob("custom")) and (bare / "meta.json").is_file()
    assert (bare / "app/config/config_fed_server.json").read_text() == (
        job / "app/config/config_fed_server.json"
    ).read_text()
    with pytest.raises(FileExistsError):
        admin.without_custom(job, tmp_path / "bare")
    resumed = admin.resume_folder(job, tmp_path / "resumed", "job-a")
    for side in ("server", "client"):
        before = json.loads((job / f"app/config/config_fed_{side}.json").read_text())
        after = json.loads((resumed / f"app/config/config_fed_{side}.json").read_text())
        entries = admin.training_entries(after)
        assert [e["args"]["resume"] for e in entries] == ["job-a"]
        for e in entries:
            del e["args"]["resume"]
        assert after == before, side


def test_real_sites_never_fall_back_to_a_simulated_split(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_CONFIG_ENV, raising=False)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    ds = resolve_dataset("ich_phantom")
    assert site_config_required(ds, simulated=False) and not site_config_required(ds, simulated=True)
    with pytest.raises(
        SiteDataError,
        match=r"site 'hospital-4' has no data configured for dataset 'ich_phantom'"
        r": create .*hospital-4/local/fedpartial_data.json",
    ):
        resolve_site_data("hospital-4", ds, tmp_path / "hospital-4" / "local", simulated=False)
    monkeypatch.setenv(REQUIRE_ENV, "1")
    assert site_config_required(ds, simulated=True)
    monkeypatch.setenv(REQUIRE_ENV, "0")  # a POC demo on the phantom
    assert not site_config_required(ds, simulated=False)
    assert site_config_required({**ds, "require_site_config": True}, simulated=False)


def test_project_yml_roles():
    cfg = yaml.safe_load((REPO / "provisioning" / "project.yml").read_text())
    by_type = {}
    for p in cfg["participants"]:
        by_type.setdefault(p["type"], []).append(p)
    assert len(by_type["server"]) == 1 and len(by_type["client"]) >= 3
    roles = {p["name"]: p.get("role") for p in by_type["admin"]}
    assert "project_admin" in roles.values()  # may submit BYOC jobs
    orgs = {p["org"] for p in by_type["client"]}
    assert orgs == {p["org"] for p in by_type["admin"] if p.get("role") == "org_admin"}  # one org admin each


def test_customise_job_sets_min_clients(tmp_path):
    from fedpartial.tools.build_jobs import customise_job

    job = customise_job(REPO / "jobs" / "fedmlp_ich", tmp_path / "fedmlp_ich", num_rounds=2, min_clients=3)
    assert json.loads((job / "meta.json").read_text())["min_clients"] == 2  # 3 sites, one may be missing
    server = json.loads((job / "app/config/config_fed_server.json").read_text())
    assert server["min_clients"] == 3 and server["num_rounds"] == 2
    assert (job / "app/custom/fedpartial/tools/admin.py").is_file()


def test_allow_list_admits_the_jobs_classes(tmp_path):
    from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer

    from fedpartial.tools.allow_list import allow_jobs, component_paths

    kit = tmp_path / "hospital-1"
    (kit / "local").mkdir(parents=True)
    (kit / "local" / "resources.json.default").write_text(json.dumps({"format_version": 2, "components": []}))
    job = REPO / "jobs" / "fedmlp_ich"
    paths = component_paths(job)
    assert "fedpartial.fl.executor.PartialLabelExecutor" in paths and len(paths) > 10

    def refused():  # judged by NVFlare's own policy reader and matcher
        res = json.loads(
            (
                kit
                / "local"
                / next(n for n in ("resources.json", "resources.json.default") if (kit / "local" / n).is_file())
            ).read_text()
        )
        allow, _, _ = ComponentPathAuthorizer()._get_policy_from_resources(res)
        return sorted(p for p in paths if not any(ComponentPathAuthorizer._path_matches_prefix(p, a) for a in allow))

    assert "fedpartial.models.PartialLabelNet" in refused()
    added = allow_jobs(kit, [job])
    assert "fedpartial." in added and refused() == []
    assert json.loads((kit / "local" / "resources.json").read_text())["components"] == []  # rest kept
    assert allow_jobs(kit, [job]) == []  # idempotent


def test_site_check_names_the_hospitals_that_are_not_connected(tmp_path):
    """Before a job goes out the admin is told which of its sites are down and whether NVFlare will start it."""
    from conftest import copy_job
    from fedpartial.tools.admin import connected_sites, site_check

    job = copy_job("fedavg_ich", tmp_path / "job", min_clients=3)  # 3 sites, max_missing_sites 1
    names = ["h1", "h2", "h3"]
    assert site_check(job, names, names) == []
    lines = site_check(job, ["h1", "h2"], names)
    assert lines[0] == "warning: 2 of the job's 3 site(s) are connected (h1, h2); not connected: h3"
    assert "starts without them (max_missing_sites 1)" in lines[1]
    lines = site_check(job, ["h1"], None)  # names unknown (deploy_map @ALL): the count only
    assert lines[0] == "warning: 1 of the job's 3 site(s) are connected (h1)"
    assert "needs at least 2 site(s)" in lines[1] and "SUBMITTED" in lines[1]

    class Info:
        def __init__(self, name, t):
            self.name, self.last_connect_time = name, t

    sess = type(
        "S", (), {"get_connected_client_list": lambda self: [Info("h1", time.time()), Info("h3", time.time() - 600)]}
    )()
    assert connected_sites(sess) == ["h1"]  # h3: no heartbeat for 10 minutes, still listed by the server


def test_the_admin_command_and_the_results_reader_never_load_torch():
    """``fedpartial-admin`` (every command: submit, follow, results, check) and ``show_results`` read results and
    talk to the FLARE API only: a fresh process importing them has not loaded torch (a second or more per call)."""
    import subprocess
    import sys

    code = (
        "import sys, fedpartial.tools.admin, fedpartial.tools.show_results, fedpartial.fl.report; "
        "print(sorted(m for m in ('torch', 'monai', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_login_answered_without_the_servers_certificate_is_tried_again_then_named(tmp_path, monkeypatch, capsys):
    """NVFlare 2.9's login raises a TypeError when the server's challenge reply lacks its certificate (a loaded
    server): fedpartial-admin logs in again once; a second such answer is one line naming the kit's server, and any
    other TypeError is not swallowed."""
    from nvflare.fuel.flare_api import flare_api

    (tmp_path / "startup").mkdir()
    (tmp_path / "startup" / "fed_admin.json").write_text("{}")
    monkeypatch.setattr(admin.time, "sleep", lambda s: None)
    calls = []

    def flaky(user, kit, timeout):
        calls.append(user)
        if len(calls) == 1:
            raise TypeError("'None' is not an instance of 'bytes'")
        return "session"

    monkeypatch.setattr(flare_api, "new_secure_session", flaky)
    assert admin.open_session(tmp_path, "admin@x.org") == "session" and calls == ["admin@x.org"] * 2

    def broken(user, kit, timeout):
        calls.append(user)
        raise TypeError("'None' is not an instance of 'bytes'")

    calls.clear()
    monkeypatch.setattr(flare_api, "new_secure_session", broken)
    assert admin.main(["--kit", str(tmp_path), "check", "jobs/fedavg_ich"]) == 1  # its FLARE API errors' status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(calls) == admin.LOGIN_TRIES == 2 and len(err) == 1, err
    assert "answered the login without its certificate 2 times" in err[0] and "fed_admin.json" in err[0]

    def bug(user, kit, timeout):
        raise TypeError("unexpected keyword argument")

    monkeypatch.setattr(flare_api, "new_secure_session", bug)
    with pytest.raises(TypeError, match="unexpected keyword"):
        admin.open_session(tmp_path)
