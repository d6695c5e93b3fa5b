"""Every job folder runs for 2 rounds through the real NVFlare simulator on tiny data, and the results JSON
holds per-round validation, test every round, the best round and the final evaluation of both models."""

from __future__ import annotations

import pytest

from conftest import REPO, copy_job, real_data, results_of, run_simulator, server_log

pytestmark = pytest.mark.integration

TINY = {
    "ich": {"dataset": {"image_size": 32, "prepare": {"source_args": {"n_images": 240, "size": 64, "seed": 0}}},
            "evaluation": {"test_every": 1}, "train": {"batch_size": 16}},
    "ham10000": {"dataset": {"image_size": 32, "prepare": {"val_frac": 0.03, "test_frac": 0.05, "site_sizes": 60}},
                 "evaluation": {"test_every": 1}, "train": {"batch_size": 16}},
}
JOBS = sorted(p.parent.name for p in (REPO / "jobs").glob("fedavg*/meta.json"))


@pytest.mark.parametrize("job", JOBS)
def test_job_runs_two_rounds(job, tmp_path, data_cache):
    kind = "ham10000" if job.endswith("ham10000") else "ich"
    if kind == "ham10000":
        real_data("ham10000")
    job_dir = copy_job(job, tmp_path / job, num_rounds=2, executor_args=TINY[kind])
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=5, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["method"] == job.rsplit("_", 1)[0] and res["num_rounds"] == 2
    for r in res["rounds"]:
        assert r["sites"] == [f"site-{i}" for i in range(1, 6)], r["sites"]  # every site contributed
        assert r["val"]["macro"]["auc"] is not None and r["test"] is not None
    assert res["best"] is not None and res["best"]["trained_rounds"] == 1
    for model in ("FL_global_model.pt", "best_FL_global_model.pt"):
        final = res["final"][model]
        assert final["sites"] == [f"site-{i}" for i in range(1, 6)]
        assert 0.0 <= final["test"]["macro"]["auc"] <= 1.0
        assert set(final["test"]["per_class"]) == set(res["rounds"][0]["val"]["per_class"])
    log = server_log(ws)
    assert "annotated positives per site and class" in log
    assert (ws / "server" / "simulate_job" / "tb_events").is_dir()
