"""Fault injection in the simulator: one site poisons its updates, another fails every round.

The faults come from a test-only executor written into the COPIED job's ``app/custom`` (nothing of it ships in
the package): ``site-2`` sends a 1e30 update in round 0, a 100x-scaled change in round 1 and sign-flipped
(reversed: ``2 x global - local``, the same size as its real change) weights in round 2; ``site-5``'s training
raises in every round. The job (5 sites, ``max_missing_sites`` 1)
must finish with the three honest sites, refuse every poisoned update before it touches the model, record the
failing site as missing in every round, and end with a finite global model of the initial model's scale.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import REPO, results_of, run_simulator, server_log
from fedpartial.tools.build_jobs import customise_job

pytestmark = pytest.mark.integration

TINY_HAM = {
    "dataset": {"image_size": 32, "prepare": {"val_frac": 0.03, "test_frac": 0.05}},
    "evaluation": {"test_every": 1},
    "train": {"batch_size": 16},
}
TINY_ICH = {
    "dataset": {"image_size": 32, "prepare": {"source_args": {"n_images": 240, "size": 64, "seed": 0}}},
    "evaluation": {"test_every": 1},
    "train": {"batch_size": 16},
}

FAULTS = '''
"""TEST ONLY: an executor that injects faults at chosen sites (written by tests/test_reliability_simulator.py)."""
import numpy as np
from nvflare.apis.dxo import from_shareable
from nvflare.app_common.app_constant import AppConstants

from fedpartial.fl.executor import PartialLabelExecutor


class FaultyExecutor(PartialLabelExecutor):
    def __init__(self, poison_site="site-2", fail_site="site-5", **kwargs):
        super().__init__(**kwargs)
        self.poison_site, self.fail_site = poison_site, fail_site

    def _train(self, shareable, fl_ctx, abort_signal):
        site = self._site_name(fl_ctx)
        if site == self.fail_site:
            raise RuntimeError("injected training failure")
        received = {k: np.asarray(v) for k, v in from_shareable(shareable).data.items()}
        reply = super()._train(shareable, fl_ctx, abort_signal)
        if site != self.poison_site:
            return reply
        rnd = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        dxo = from_shareable(reply)
        out = {}
        for k, w in dxo.data.items():
            w = np.asarray(w)
            if not np.issubdtype(w.dtype, np.floating):
                out[k] = w
            elif rnd == 0:
                out[k] = np.full_like(w, 1e30)
            elif rnd == 1:
                out[k] = (received[k] + 100.0 * (w - received[k])).astype(w.dtype)
            else:
                out[k] = (2 * received[k] - w).astype(w.dtype)
        dxo.data = out
        return dxo.to_shareable()
'''


def _norm(state: dict) -> float:
    return float(
        np.sqrt(
            sum(
                float((np.asarray(v, dtype=np.float64) ** 2).sum())
                for v in state.values()
                if np.issubdtype(np.asarray(v).dtype, np.floating)
            )
        )
    )


def test_poisoned_and_failing_sites(tmp_path, data_cache):
    job = customise_job(REPO / "jobs" / "fedavg_ich", tmp_path / "job", num_rounds=3, executor_args=TINY_ICH)
    (job / "app/custom/fedpartial_faults.py").write_text(FAULTS)
    client = job / "app/config/config_fed_client.json"
    cfg = json.loads(client.read_text())
    cfg["executors"][0]["executor"]["path"] = "fedpartial_faults.FaultyExecutor"
    client.write_text(json.dumps(cfg))
    server = json.loads((job / "app/config/config_fed_server.json").read_text())
    assert server["max_missing_sites"] == 1  # the shipped setting: one site may be missing

    ws = tmp_path / "ws"
    proc = run_simulator(job, ws, n=5, env={"FEDPARTIAL_CACHE": str(data_cache)}, timeout=900)
    log = server_log(ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    res = results_of(ws)
    assert res["num_rounds"] == 3 and len(res["rounds"]) == 3
    for r in res["rounds"]:
        assert r["missing"] == ["site-5"], r  # its training raised: recorded, the round went on
        assert list(r["rejected"]) == ["site-2"], r  # 1e30, 100x, reversed
        assert set(r["sites"]) >= {"site-1", "site-3", "site-4"}
    assert (
        "non-finite" in res["rounds"][0]["rejected"]["site-2"] or "changed by" in res["rounds"][0]["rejected"]["site-2"]
    )
    assert "changed by" in res["rounds"][1]["rejected"]["site-2"]
    assert "points against the model's last step" in res["rounds"][2]["rejected"]["site-2"]

    final = torch.load(ws / "server/simulate_job/app_server/FL_global_model.pt", map_location="cpu", weights_only=True)[
        "model"
    ]
    final = {k: v.numpy() for k, v in final.items()}
    from fedpartial.models import build_model

    init_args = {k: v for k, v in server["components"][0]["args"].items() if k != "num_classes"}
    init = {k: v.numpy() for k, v in build_model(init_args, 5).state_dict().items()}
    assert all(np.all(np.isfinite(v)) for v in final.values() if np.issubdtype(v.dtype, np.floating))
    assert 0.5 * _norm(init) < _norm(final) < 2.0 * _norm(init), (_norm(init), _norm(final))
    last = res["rounds"][-1]["val"]["macro"]["auc"]
    assert last is not None and 0.0 <= last <= 1.0


def test_two_labelled_sites_of_very_different_size_are_both_averaged(tmp_path, data_cache):
    """The labelled-only lower bound (``fedavg_labelled_isic``) with two labelled sites of 16 and 400 images and one
    unlabelled site that sits out: every round has two contributors whose changes differ by more than 25 x in
    some tensors (the bound against the round's median change refused the larger site in rounds 1 and 2 of this
    very run). Each update is now judged against the global model alone: nothing is refused."""
    from conftest import copy_job, real_data
    from fedpartial.data.presets import deep_merge

    args = deep_merge(
        TINY_HAM,
        {
            "train": {"local_steps": None, "local_epochs": 1},
            "dataset": {
                "prepare": {"num_sites": 3, "m": 2, "site_sizes": [16, 400, 40], "root": str(real_data("ham10000"))}
            },
        },
    )
    job = copy_job("fedavg_labelled_isic", tmp_path / "job", num_rounds=3, executor_args=args, min_clients=3)
    ws = tmp_path / "ws"
    proc = run_simulator(job, ws, n=3, env={"FEDPARTIAL_CACHE": str(data_cache)})
    log = server_log(ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    res = results_of(ws)
    assert res["data"]["sites"]["site-1"]["n_train"] == 16 and res["data"]["sites"]["site-2"]["n_train"] == 400
    for r in res["rounds"]:
        assert r["rejected"] == {} and r["missing"] == [], r
        assert "site-1" in r["sites"] and "site-2" in r["sites"]
    assert "aggregated 2 site(s) ['site-1', 'site-2']" in log  # two contributors each round
    assert "cosine of each change with the last global step: site-1" in log  # checked
