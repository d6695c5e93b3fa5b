"""Checkpoints for resuming a job after a server restart (fedpartial.fl.checkpoint); the end-to-end resume of a
FedMLP job through the simulator is in test_jobs_simulator.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import REPO
from fedpartial.fl.checkpoint import (
    CHECKPOINT_FILE,
    check_resume,
    config_fingerprint,
    from_safe,
    read_file,
    resume_source,
    run_folder,
    server_checkpoint,
    write_private,
)


def _ckpt(round_num=1, total=3, method="fedmlp", shape=(2, 3), job_id="job-a", fingerprint="f00d"):
    weights = {"w": np.ones(shape, np.float32), "bn.num_batches_tracked": np.int64(4)}
    meta = {"fedmlp_global_degree": [0.5, 0.25], "sat_out": []}
    comps = {"aggregator": {"rule": {"p0": np.zeros((2, 4))}, "last_meta": meta}}
    return weights, server_checkpoint(
        round_num, total, method, weights, meta, comps, dict(weights), 0, job_id, fingerprint
    )


def test_checkpoint_round_trip_is_private_and_loads_weights_only(tmp_path):
    weights, ckpt = _ckpt()
    path = tmp_path / "run" / "server" / CHECKPOINT_FILE
    write_private(ckpt, path)
    assert path.stat().st_mode & 0o077 == 0 and not list(path.parent.glob(".*tmp"))
    back = read_file(path)  # torch.load(weights_only=True) inside: numpy became tensors
    assert torch.equal(back["weights"]["w"], torch.ones(2, 3)) and int(back["weights"]["bn.num_batches_tracked"]) == 4
    assert torch.equal(back["components"]["aggregator"]["rule"]["p0"], torch.zeros(2, 4, dtype=torch.float64))
    assert from_safe(back["meta"]) == {"fedmlp_global_degree": [0.5, 0.25], "sat_out": []}
    assert check_resume(back, path.parent, "fedmlp", 3, weights, "job-a", "f00d") is None
    assert back["job_id"] == "job-a" and back["fingerprint"] == "f00d"


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(method="fedavg"), "method 'fedmlp', the job runs 'fedavg'"),
        (dict(total=1), "has only 1 round(s)"),
        (dict(shape=(3, 3)), "tensor shapes differ"),
        (dict(job_id="job-b"), "belongs to job 'job-a', not to job 'job-b': refusing to continue a run from another"),
        (
            dict(fingerprint="beef"),
            "job job-a ran another configuration (fingerprint f00d, the submitted job folder's is beef)",
        ),
    ],
)
def test_a_checkpoint_that_cannot_continue_the_job_is_refused(tmp_path, change, expected):
    weights, _ = _ckpt()
    _, ckpt = _ckpt(**{k: v for k, v in change.items() if k == "shape"})
    method, total = change.get("method", "fedmlp"), change.get("total", 3)
    job_id, fingerprint = change.get("job_id", "job-a"), change.get("fingerprint", "f00d")
    why = check_resume(read_back(tmp_path, ckpt), tmp_path, method, total, weights, job_id, fingerprint)
    assert why is not None and expected in why


def read_back(tmp_path, ckpt):
    write_private(ckpt, tmp_path / CHECKPOINT_FILE)
    return read_file(tmp_path / CHECKPOINT_FILE)


def test_missing_and_corrupt_checkpoints_are_named(tmp_path):
    weights, _ = _ckpt()
    assert "no checkpoint of job job-a in" in check_resume(None, tmp_path, "fedmlp", 3, weights, "job-a")
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="checkpoint .*checkpoint.pt is unreadable"):
        read_file(tmp_path / CHECKPOINT_FILE)


def test_run_folder_layout_and_names():
    """Each job id has its own folder: two runs of one job folder (concurrent or not) never share a file."""
    assert (
        str(run_folder("", "/ws/site-1", "fedmlp_ich", "7f3a", "site-1"))
        == "/ws/site-1/fedpartial_checkpoints/fedmlp_ich/7f3a/site-1"
    )
    assert str(run_folder("/ckpt", "/ws", "fedmlp_ich", "7f3a", "server")) == "/ckpt/fedmlp_ich/7f3a/server"
    assert run_folder("/ckpt", "/ws", "fedmlp_ich", "7f3a", "server") != run_folder(
        "/ckpt", "/ws", "fedmlp_ich", "9c1b", "server"
    )
    for bad in (("../etc", "7f3a"), ("fedmlp_ich", "../x"), ("fedmlp_ich", "")):
        with pytest.raises(ValueError, match="invalid run, job or participant name"):
            run_folder("", "/ws", *bad, "server")


def test_resume_source():
    assert resume_source("7f3a", "9c1b") == "7f3a"  # continue job 7f3a's run
    assert resume_source(True, "simulate_job") == "simulate_job" and resume_source("true", "x") == "x"
    assert resume_source(False, "x") is None and resume_source("", "x") is None and resume_source("false", "x") is None


def test_config_fingerprint_ignores_resume_and_rounds_only(tmp_path):
    from fedpartial.tools.admin import resume_folder

    cfg = REPO / "jobs/fedavg_ich/app/config"
    resumed = resume_folder(REPO / "jobs" / "fedavg_ich", tmp_path / "r", "7f3a")
    assert config_fingerprint(resumed / "app/config") == config_fingerprint(cfg)
    other = tmp_path / "other"
    other.mkdir()
    for f in cfg.glob("config_fed_*.json"):
        c = json.loads(f.read_text())
        c["num_rounds"] = 99
        (other / f.name).write_text(json.dumps(c))
    assert config_fingerprint(other) == config_fingerprint(cfg)  # more rounds: the same run, continued
    client = json.loads((other / "config_fed_client.json").read_text())
    client["executors"][0]["executor"]["args"]["seed"] = 1
    (other / "config_fed_client.json").write_text(json.dumps(client))
    assert config_fingerprint(other) != config_fingerprint(cfg)
    assert config_fingerprint(tmp_path / "nothing") == "none"


def test_resume_folder_turns_resume_on_both_sides_and_nothing_else(tmp_path):
    from fedpartial.tools.admin import resume_folder

    out = resume_folder(REPO / "jobs" / "fedavg_ich", tmp_path / "fedavg_ich", "7f3a")
    for side, key in (("server", "workflows"), ("client", "executors")):
        before = json.loads((REPO / "jobs/fedavg_ich/app/config" / f"config_fed_{side}.json").read_text())
        after = json.loads((out / "app/config" / f"config_fed_{side}.json").read_text())
        entries = [e if side == "server" else e["executor"] for e in after[key]]
        resumed = [e for e in entries if e["args"].pop("resume", False) == "7f3a"]
        assert len(resumed) == 1 and resumed[0]["args"]["run_name"] == "fedavg_ich"
        assert after == before  # only the flag was added
    with pytest.raises(FileExistsError):
        resume_folder(REPO / "jobs" / "fedavg_ich", out)
