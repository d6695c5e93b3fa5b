"""A site with a bad manifest stops the job before any training, with an error naming the site, file and line;
a class no site annotates stops it too. Every job here runs on one simulated site: each fault is the site's own
(or the federation's, which one site is), and every site is a process."""

from __future__ import annotations

import json

import pytest

from conftest import copy_job, run_simulator, server_log

pytestmark = pytest.mark.integration

CLASSES = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]


def _site_config(tmp_path, rows: list[str]) -> str:
    (tmp_path / "img").mkdir(exist_ok=True)
    from PIL import Image

    for i in range(3):
        Image.new("RGB", (16, 16), color=(i * 40, 0, 0)).save(tmp_path / "img" / f"{i}.png")
    manifest = tmp_path / "train.csv"
    manifest.write_text("image," + ",".join(CLASSES) + "\n" + "\n".join(rows) + "\n")
    cfg = tmp_path / "fedpartial_data.json"
    cfg.write_text(json.dumps({"datasets": {"ich_phantom": {"data_root": ".", "train": "train.csv"}}}))
    return str(cfg)


def _run(tmp_path, rows):
    job = copy_job(
        "fedavg_ich",
        tmp_path / "job",
        num_rounds=1,
        executor_args={"dataset": {"image_size": 16}, "evaluation": {"test_every": 1}},
        sites=1,
    )
    ws = tmp_path / "ws"
    proc = run_simulator(job, ws, n=1, env={"FEDPARTIAL_SITE_CONFIG": _site_config(tmp_path, rows)}, timeout=300)
    return proc, server_log(ws) + proc.stdout + proc.stderr, ws


def test_bad_value_names_site_file_line(tmp_path):
    proc, log, ws = _run(tmp_path, ["img/0.png,1,0,0,0,0", "img/1.png,1,0,yes,0,0", "img/2.png,0,0,0,0,1"])
    assert "data check failed" in log
    assert "site 'site-1'" in log
    assert "train.csv" in log and "line 3" in log and "'yes'" in log
    assert "aggregated" not in log  # no round was ever aggregated
    assert not (ws / "server/simulate_job/app_server/FL_global_model.pt").exists() or "round 0" not in log


def test_missing_image_names_the_file(tmp_path):
    proc, log, _ = _run(tmp_path, ["img/0.png,1,0,0,0,0", "img/missing.png,1,1,1,1,1"])
    assert "image not found" in log and "missing.png" in log and "line 3" in log


def test_class_nobody_annotates_stops_the_job(tmp_path):
    proc, log, _ = _run(tmp_path, ["img/0.png,1,0,0,0,", "img/1.png,0,1,0,1,", "img/2.png,0,0,1,0,"])
    assert "annotated by no site" in log and "subdural" in log
    assert "aggregated" not in log


def test_client_server_method_mismatch_stops_the_job(tmp_path):
    """Issue: a client running fedmlp against a server running fedavg completed with rc 0 and results that said
    fedavg. The server sends its spec with the data check; the site that differs stops the job."""
    job = copy_job("fedavg_ich", tmp_path / "job", num_rounds=1, executor_args={"dataset": {"image_size": 16}}, sites=1)
    client = job / "app/config/config_fed_client.json"
    cfg = json.loads(client.read_text())
    cfg["method"] = "fedmlp"  # edited on one side only
    client.write_text(json.dumps(cfg))
    ws = tmp_path / "ws"
    rows = ["img/0.png,1,0,0,0,0", "img/1.png,0,1,0,1,1", "img/2.png,0,0,1,0,0"]
    proc = run_simulator(job, ws, n=1, env={"FEDPARTIAL_SITE_CONFIG": _site_config(tmp_path, rows)}, timeout=300)
    log = server_log(ws) + proc.stdout + proc.stderr
    assert "data check failed" in log
    assert "differs from the server's: the server runs method 'fedavg', this site 'fedmlp'" in log
    assert "aggregated" not in log
    assert (
        not (ws / "server/simulate_job/results.json").is_file()
        or '"num_rounds": 0' in (ws / "server/simulate_job/results.json").read_text()
    )
