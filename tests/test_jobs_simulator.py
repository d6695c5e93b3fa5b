"""Every job folder runs for 2 rounds through the real NVFlare simulator on tiny data, and the results JSON
holds per-round validation, test every round, the best round and the final evaluation of both models."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, copy_job, real_data, results_of, run_simulator, server_log

pytestmark = pytest.mark.integration

TINY = {
    "ich": {"dataset": {"image_size": 32, "prepare": {"source_args": {"n_images": 240, "size": 64, "seed": 0}}},
            "evaluation": {"test_every": 1}, "train": {"batch_size": 16}},
    "ham10000": {"dataset": {"image_size": 32, "prepare": {"val_frac": 0.03, "test_frac": 0.05, "site_sizes": 60}},
                 "evaluation": {"test_every": 1}, "train": {"batch_size": 16}},
}
TINY["cxr14"] = {"dataset": {"image_size": 32}, "evaluation": {"test_every": 1}, "train": {"batch_size": 16}}
# fedmlp_ich has its own 3-round test below; the FedLSM jobs have theirs in test_fedlsm.py
JOBS = sorted(p.parent.name for p in (REPO / "jobs").glob("*/meta.json")
              if p.parent.name != "fedmlp_ich" and not p.parent.name.startswith("fedlsm_"))


def _kind(job: str) -> tuple[str, str | None]:
    """(tiny-config key, real dataset folder needed)"""
    if job.endswith("ham10000"):
        return "ham10000", "ham10000"
    if job.endswith("cxr14"):
        return "cxr14", "nih_cxr14_1000"
    return "ich", None


@pytest.mark.parametrize("job", JOBS)
def test_job_runs_two_rounds(job, tmp_path, data_cache):
    kind, needs = _kind(job)
    if needs:
        real_data(needs)
    job_dir = copy_job(job, tmp_path / job, num_rounds=2, executor_args=TINY[kind])
    n = json.loads((job_dir / "meta.json").read_text())["min_clients"]
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["method"] == job.rsplit("_", 1)[0] and res["num_rounds"] == 2
    for r in res["rounds"]:
        assert sorted(r["sites"]) == sorted(f"site-{i}" for i in range(1, n + 1)), r["sites"]  # all contributed
        assert r["val"]["macro"]["auc"] is not None and r["test"] is not None
    assert res["best"] is not None and res["best"]["trained_rounds"] == 1
    for model in ("FL_global_model.pt", "best_FL_global_model.pt"):
        final = res["final"][model]
        assert len(final["sites"]) == n
        assert 0.0 <= final["test"]["macro"]["auc"] <= 1.0
        assert set(final["test"]["per_class"]) == set(res["rounds"][0]["val"]["per_class"])
    log = server_log(ws)
    assert "annotated positives per site and class" in log
    assert (ws / "server" / "simulate_job" / "tb_events").is_dir()


def test_fedmlp_prototypes_travel_and_pseudo_labels_persist(tmp_path, data_cache):
    """3 rounds of jobs/fedmlp_ich with a 1-round warm-up: prototypes go site -> server -> sites, pseudo labels
    are created in stage 2 and saved as site state, and the results JSON is written."""
    import torch

    args = {**TINY["ich"], "method_args": {"warmup_rounds": 1, "L": 0.5, "R": 0.5, "T0": 0.2, "T1": 0.2}}
    job_dir = copy_job("fedmlp_ich", tmp_path / "fedmlp_ich", num_rounds=3, executor_args=args)
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=5, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["method"] == "fedmlp" and res["num_rounds"] == 3 and res["final"]["FL_global_model.pt"]["test"]
    tagged = 0
    for i in range(1, 6):
        state = torch.load(ws / f"site-{i}/simulate_job/fedpartial_state/trainer_state.pt", weights_only=False)
        tags = torch.as_tensor(state["fedmlp_tags"])
        assert tags.shape[1] == 5
        tagged += int((tags >= 0).sum())
    assert tagged > 0, "no pseudo label was created in stage 2"
