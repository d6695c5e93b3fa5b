"""A hostile site in the simulator, hostile in its statistics only: the job completes without it.

The fault comes from a test-only executor written into the COPIED job's ``app/custom`` (as in
test_reliability_simulator.py): ``site-2`` trains honestly, then replaces the statistics it sends. FedLSM
(``fedlsm_isic``): class counts ``q`` of 1e30 in round 0 (the probe that took AWPA's classifier over), NaN in round
1. FedMLP (``fedmlp_ich``, 1-round warm-up, prototypes from round 0): NaN prototypes in round 0 (they reached every
site as the global prototypes), no ``annotated`` vector in round 1 (the rule failed the round). Each round must
refuse site-2 with the reason in results.json, aggregate the two others with no rule error, and the job must end
(3 sites: the jobs' own 5 change nothing here, and every site is a process).
"""

from __future__ import annotations

import json

import pytest
from test_jobs_simulator import TINY

from conftest import HAM_WITHOUT_TABLE, copy_job, real_data, results_of, run_simulator, server_log
from fedpartial.data.presets import deep_merge

pytestmark = pytest.mark.integration

HOSTILE = '''
"""TEST ONLY: site-2 replaces the statistics it sends (written by tests/test_stat_checks_simulator.py)."""
import numpy as np
from nvflare.apis.dxo import from_shareable
from nvflare.app_common.app_constant import AppConstants

from fedpartial.fl.executor import PartialLabelExecutor

BY_ROUND = {
    "fedlsm": [{"fedlsm_q": "huge"}, {"fedlsm_q": "nan"}],
    "fedmlp": [{"fedmlp_p0": "nan", "fedmlp_p1": "nan"}, {"annotated": "drop"}],
}


class HostileStatistics(PartialLabelExecutor):
    def _train(self, shareable, fl_ctx, abort_signal):
        reply = super()._train(shareable, fl_ctx, abort_signal)
        if self._site_name(fl_ctx) != "site-2":
            return reply
        rnd = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        dxo = from_shareable(reply)
        for key, how in BY_ROUND[self.method][rnd].items():
            if how == "drop":
                dxo.meta.pop(key, None)
                continue
            assert key in dxo.meta, (key, sorted(dxo.meta))
            v = np.asarray(dxo.meta[key], dtype=np.float64)
            dxo.meta[key] = np.full_like(v, 1e30 if how == "huge" else np.nan)
        return dxo.to_shareable()
'''

MISSING_3 = {"ham10000": HAM_WITHOUT_TABLE, "ich": {"k": 3}}  # each of the 3 sites missing 3 classes
CASES = {
    "fedlsm_isic": (
        {
            **deep_merge(TINY["ham10000"], {"dataset": {"prepare": MISSING_3["ham10000"]}}),
            "train": {"batch_size": 16, "local_steps": 2},
        },
        ["fedlsm_q", "fedlsm_q"],
        ["above", "non-finite"],
    ),
    "fedmlp_ich": (
        {
            **deep_merge(TINY["ich"], {"dataset": {"prepare": MISSING_3["ich"]}}),
            "train": {"batch_size": 16, "local_steps": 2},
            "method_args": {"warmup_rounds": 1, "L": 0.5, "R": 0.5, "T0": 0.2, "T1": 0.2},
        },
        ["fedmlp_p0", "annotated"],
        ["non-finite", "is missing"],
    ),
}


@pytest.mark.parametrize("job", sorted(CASES))
def test_a_site_with_hostile_statistics_is_refused_every_round_and_the_job_completes(job, tmp_path, data_cache):
    if job == "fedlsm_isic":
        real_data("ham10000")
    args, keys, words = CASES[job]
    job_dir = copy_job(job, tmp_path / job, num_rounds=2, executor_args=args, sites=3)
    (job_dir / "app/custom/fedpartial_hostile.py").write_text(HOSTILE)
    client = job_dir / "app/config/config_fed_client.json"
    cfg = json.loads(client.read_text())
    cfg["executors"][0]["executor"]["path"] = "fedpartial_hostile.HostileStatistics"
    client.write_text(json.dumps(cfg))
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=3, env={"FEDPARTIAL_CACHE": str(data_cache)})
    log = server_log(ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    res = results_of(ws)
    assert len(res["rounds"]) == 2
    for r, key, word in zip(res["rounds"], keys, words):
        assert list(r["rejected"]) == ["site-2"], (r["round"], r["rejected"])
        why = r["rejected"]["site-2"]
        assert f"statistic '{key}'" in why and word in why, why
        assert r["rule_error"] is None and r["missing"] == [], r
    assert log.count("aggregated 2 site(s) ['site-1', 'site-3']") == 2, log[-3000:]
    assert "stopping" not in log
    assert res["final"]  # the final evaluation of the global model ran
