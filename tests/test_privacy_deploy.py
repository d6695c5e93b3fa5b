"""A provisioned localhost federation where one hospital runs its strict privacy policy.

``nvflare provision`` with provisioning/project.yml, its ``PrivacyPolicyBuilder`` told that hospital-3 is strict
(every scope of its ``local/privacy.json`` maps to ``strict``); a tiny ``fedmlp_ich`` that names the ``standard``
scope in its ``meta.json`` is submitted by the project admin. hospital-3's prototypes and counts arrive noised
(its counts differ from its data, every count is 0 or at least 20) and it sends no score histograms, the other
hospitals' counts are exact (only thresholded at 5); the ledger in ``results.json`` records it, and the job
completes.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest
import yaml
from test_deploy_poc import FINISHED_OK, HOSPITALS, Deployment

from conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.deployment]

STRICT_SITE = "hospital-3"


@pytest.fixture(scope="module")
def strict_deployment(tmp_path_factory, monkeypatch_module):
    import test_deploy_poc

    real = test_deploy_poc._project_yml

    def with_strict_site(dest):
        path = real(dest)
        cfg = yaml.safe_load(path.read_text())
        builder = next(b for b in cfg["builders"] if b["path"].endswith("PrivacyPolicyBuilder"))
        builder["args"]["strict_sites"] = [STRICT_SITE]
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    monkeypatch_module.setattr(test_deploy_poc, "_project_yml", with_strict_site)
    t0 = time.time()
    dep = Deployment(tmp_path_factory.mktemp("deploy_privacy"))
    try:
        dep.provision()
        dep.prepare_hospital_data()
        for participant in ["localhost", *HOSPITALS]:
            dep.start(participant)
        dep.all_connected()  # the job below goes to the hospitals connected when it is submitted
        yield dep
    finally:
        left = dep.stop()
        print(f"privacy deployment fixture: {time.time() - t0:.0f} s in all")
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _true_counts(dep, site: str) -> np.ndarray:
    """(C, 2) annotated negatives / positives of the site's training manifest (what FedMLP's counts hold)."""
    i = HOSPITALS.index(site) + 1
    df = pd.read_csv(dep.root / "data" / f"site-{i}.csv")
    df = df[df["split"] == "train"] if "split" in df else df
    classes = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
    lab = df[classes].to_numpy(dtype=float)
    return np.stack([np.nansum(lab == 0, 0), np.nansum(lab == 1, 0)], 1)


def test_strict_hospital_sends_noised_thresholded_statistics_and_the_job_completes(strict_deployment):
    from fedpartial.fl.privacy import set_privacy_scope

    dep = strict_deployment
    pol = {s: json.loads((dep.kits / s / "local" / "privacy.json").read_text()) for s in HOSPITALS}
    assert pol["hospital-1"]["scopes"][0]["properties"]["min_count"] == 5  # the sample policy
    assert all(s["properties"]["min_count"] == 20 for s in pol[STRICT_SITE]["scopes"])  # strict, whatever the name

    from fedpartial.tools.build_jobs import customise_job

    (dep.root / "jobs").mkdir(exist_ok=True)  # 3 hospitals, 2 rounds, 32 px, prototypes from round 0 on
    job = customise_job(
        REPO / "jobs" / "fedmlp_ich",
        dep.root / "jobs" / "fedmlp_ich",
        num_rounds=2,
        min_clients=3,
        executor_args={"dataset": {"image_size": 32}, "method_args": {"warmup_rounds": 1}},
    )
    set_privacy_scope(job, "standard")
    out = dep.root / "results"
    proc, job_id = dep.submit(job)  # nvflare job submit / monitor / download, fedpartial-admin results
    assert proc.returncode == 0 and job_id, proc.stdout + proc.stderr
    rc, log = dep.follow(job_id, out, timeout=240)
    assert rc == 0 and FINISHED_OK in log, log[-4000:]

    res = json.loads(next(out.rglob("results.json")).read_text())
    from fedpartial.tools.show_results import privacy_table

    print(privacy_table(res))
    for r in res["rounds"]:
        print(r["round"], {s: r["site_stats"][s]["fedmlp_proto_counts"] for s in HOSPITALS})
    assert res["num_rounds"] == 2 and all(sorted(r["sites"]) == HOSPITALS for r in res["rounds"])
    for r in res["rounds"]:
        led = r["privacy"]
        strict, plain = led[STRICT_SITE], led["hospital-1"]
        assert strict["scope"] == "standard" and strict["min_count"] == 20 and strict["budget"]["epsilon"] == 4.0
        assert {e["name"] for e in strict["released"]} == {"fedmlp_p0", "fedmlp_p1", "fedmlp_proto_counts"}
        assert all(e["noise_multiplier"] > 0 and e["noise_std"] > 0 for e in strict["released"])
        assert plain["min_count"] == 5 and all(e["noise_std"] == 0 for e in plain["released"])
        # what arrived at the server: noised, and thresholded at the strict minimum after the noise
        sent = np.asarray(r["site_stats"][STRICT_SITE]["fedmlp_proto_counts"])
        true = _true_counts(dep, STRICT_SITE)
        assert ((sent == 0) | (sent >= 20)).all() and not np.array_equal(sent, true), (sent, true)
        exact = np.asarray(r["site_stats"]["hospital-1"]["fedmlp_proto_counts"])
        t1 = _true_counts(dep, "hospital-1")
        assert np.array_equal(exact, np.where(t1 < 5, 0, t1)), (exact, t1)  # exact, below 5 not sent
        assert strict["cumulative_epsilon"] > 0
    # cumulative epsilon grows and stays within the budget; the others have no formal guarantee
    eps = [r["privacy"][STRICT_SITE]["cumulative_epsilon"] for r in res["rounds"]]
    assert eps[0] < eps[1] <= 4.0 + 1e-6
    assert res["privacy"][STRICT_SITE]["epsilon"] == pytest.approx(eps[1])
    assert res["privacy"]["hospital-1"]["epsilon"] is None
