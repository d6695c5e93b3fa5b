"""Every job folder runs for 2 rounds through the real NVFlare simulator on tiny data, and the results JSON
holds per-round validation, test every round, the best round and the final evaluation of both models."""

from __future__ import annotations

import json

import pytest

from conftest import (
    HAM_WITHOUT_TABLE,
    REPO,
    check_two_rounds,
    copy_job,
    one_round_first_stage,
    real_data,
    results_of,
    run_simulator,
    server_log,
)
from fedpartial.tools.build_jobs import training_jobs

pytestmark = pytest.mark.integration

TINY = {
    "ich": {
        "dataset": {"image_size": 32, "prepare": {"source_args": {"n_images": 240, "size": 64, "seed": 0}}},
        "evaluation": {"test_every": 1},
        "train": {"batch_size": 16},
    },
    "ham10000": {
        "dataset": {"image_size": 32, "prepare": {"val_frac": 0.03, "test_frac": 0.05, "site_sizes": 60}},
        "evaluation": {"test_every": 1},
        "train": {"batch_size": 16},
    },
}
TINY["cxr14"] = {"dataset": {"image_size": 32}, "evaluation": {"test_every": 1}, "train": {"batch_size": 16}}
for _args in TINY.values():  # sets of a few dozen images: per-class metrics from fewer than 5 positives are sent
    _args["min_count"] = 1  # here (a site keeps them by default, docs/privacy.md)
# The NVFlare glue (executor, aggregator, data check, selection, results, cross-site evaluation) is the same for
# every method, and every registered method's own round trip (trainer, rule, what travels, state) is checked for
# all methods at once in test_method_zoo.py. So the simulator runs here are chosen by code path, not by job:
# FedAvg on each data source (the phantom: test_recipes.py's exported-folder run of fedavg_ich; HAM10000 single-label:
# test_export.py's trained workspace; NIH CXR14: test_recipes.py's real-data run; each checked with
# conftest.check_two_rounds), PFL here (parts kept local: every site scores its own model); fedmlp_ich has its own run-and-resume test below, the paper configurations theirs too,
# FedLSM / FedIRM / surgical jobs theirs in test_fedlsm.py / test_fedirm.py / test_surgical.py, the comparison
# methods' jobs a 2-site run each (test_comparison_method_runs_two_rounds below). Every job also gets the
# configuration check below (what a site and the server check before training).
SIMULATED = ["pfl_ich"]  # fedavg_ich, fedavg_ham10000, fedavg_cxr14: see above
ALL_JOBS = sorted(p.name for p in training_jobs(REPO / "jobs"))  # the statistics jobs: tests/test_fedstats.py
CONFIG_ONLY = sorted(j for j in ALL_JOBS if j not in SIMULATED and not j.startswith("fedavg_full_"))
JOBS = SIMULATED


@pytest.mark.parametrize("job", sorted(CONFIG_ONLY))
def test_jobs_covered_by_other_runs_have_a_valid_configuration(job):
    """The checks a site and the server make before training: the method, its options on both sides (equal), the
    model and the dataset preset resolve."""
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.fl.spec import job_spec, spec_mismatch
    from fedpartial.methods import get_method
    from fedpartial.models import build_model

    load = lambda side: json.loads((REPO / "jobs" / job / f"app/config/config_fed_{side}.json").read_text())
    client, server = load("client"), load("server")
    args = client["executors"][0]["executor"]["args"]
    agg = next(c for c in server["components"] if c["id"] == "aggregator")["args"]
    assert client["method"] == server["method"]
    method = get_method(client["method"])
    method.split_options(args["method_args"], job)  # unknown or misspelled options raise
    assert (
        spec_mismatch(
            job_spec(server["method"], agg["method_args"], args["model"]),
            job_spec(client["method"], args["method_args"], args["model"]),
        )
        is None
    )
    ds = resolve_dataset(args["dataset"])
    build_model(args["model"], len(ds["classes"]))
    assert ds["task"] in method.trainer.tasks


@pytest.mark.parametrize("job", sorted(p.parent.name for p in (REPO / "jobs").glob("fedavg_full_*/meta.json")))
def test_upper_bound_jobs_are_fedavg_pl_on_full_labels(job):
    base = job.replace("fedavg_full_", "fedavg_pl_")
    load = lambda j, side: json.loads((REPO / "jobs" / j / f"app/config/config_fed_{side}.json").read_text())
    client, ref = load(job, "client"), load(base, "client")
    assert client["method"] == load(job, "server")["method"] == "fedavg_pl"
    args, ref_args = client["executors"][0]["executor"]["args"], ref["executors"][0]["executor"]["args"]
    assert args["dataset"]["prepare"]["protocol"] == "full"
    own = ("dataset", "run_name")  # the run name is the job's folder name (its checkpoints)
    assert {k: v for k, v in args.items() if k not in own} == {k: v for k, v in ref_args.items() if k not in own}


PAPER_JOBS = sorted(p.parent.name for p in (REPO / "jobs").glob("*_paper/meta.json"))


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
    from fedpartial.data.presets import deep_merge

    n = 3  # sites (of the job's 5): the fewest on which missing 3 leaves each of the ICH jobs' 5 classes annotated
    args = deep_merge(TINY[kind], {"dataset": {"prepare": {"k": 3}}})
    job_dir = copy_job(job, tmp_path / job, num_rounds=2, executor_args=args, sites=n)
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = check_two_rounds(ws, job.rsplit("_", 1)[0])
    assert sorted(res["data"]["sites"]) == [f"site-{i}" for i in range(1, n + 1)]
    if job == "pfl_ich":
        _a_sites_own_model_is_the_one_it_scored(ws, res, tmp_path, data_cache)


def _a_sites_own_model_is_the_one_it_scored(ws, res, tmp_path, data_cache):
    """``--site``: the global model with the site's own classifier (PFL keeps it local) is the model that site
    evaluated: its layers, and its test score on the shared test set, are those of the run; the bundle says so."""
    import torch

    from fedpartial.data.prepare import ensure_prepared, load_prepared
    from fedpartial.data.site_config import simulated_spec
    from fedpartial.tools import export as E
    from fedpartial.tools import predict as P

    glob, own = P.load_model(ws, "last"), P.load_model(ws, "last", site="site-2")
    local = torch.load(ws / "site-2/simulate_job/fedpartial_state/last_local_model.pt", weights_only=True)
    other = torch.load(ws / "site-3/simulate_job/fedpartial_state/last_local_model.pt", weights_only=True)
    groups = glob.net.parameter_groups()
    g, o = glob.net.state_dict(), own.net.state_dict()
    assert res["local_parts"] == ["norm", "classifier"]  # the job's PFL: its classifier and, FedBN-like, its norms
    for k in groups["norm"] + groups["classifier"]:
        assert torch.equal(o[k], local[k].to(o[k].dtype)), k
    assert not all(torch.equal(o[k], other[k].to(o[k].dtype)) for k in groups["classifier"])
    for k in groups["encoder"] + groups["head"]:
        assert torch.equal(o[k], g[k]), k
    assert own.site == "site-2" and "site-2's own model" in own.note and "norm and classifier" in own.note
    by_file = P.load_model(ws, "last", site=str(ws / "site-2/simulate_job/fedpartial_state/last_local_model.pt"))
    assert by_file.site == "site-2" and all(torch.equal(by_file.net.state_dict()[k], o[k]) for k in o)  # a real
    # site's form: <site workspace>/<job id>/fedpartial_state/last_local_model.pt names the site by its workspace
    prepared = load_prepared(ensure_prepared(simulated_spec(glob.dataset), data_cache))
    scored = res["final"][P.LAST_MODEL]["per_site"]
    out = tmp_path / "site2.json"
    assert (
        P.evaluate_main(
            [
                str(ws),
                "--model",
                "last",
                "--site",
                "site-2",
                "--manifest",
                str(prepared.test),
                "--data-root",
                str(prepared.data_root),
                "--json",
                str(out),
                "--no-figures",
            ]
        )
        == 0
    )
    mine = json.loads(out.read_text())
    assert mine["n"] == scored["site-2"]["test"]["n"]
    assert mine["macro"]["auc"] == pytest.approx(scored["site-2"]["test"]["macro"]["auc"], abs=1e-6)
    assert scored["site-2"]["test"]["macro"]["auc"] != scored["site-3"]["test"]["macro"]["auc"]
    assert E.main([str(ws), "-o", str(tmp_path / "B"), "--model", "last", "--site", "site-2", "--no-torchscript"]) == 0
    meta = json.loads((tmp_path / "B/configs/metadata.json").read_text())
    assert meta["training"]["site"] == "site-2" and "site-2's own model" in meta["name"]
    assert meta["eval_metrics"]["macro"]["auc"] == scored["site-2"]["test"]["macro"]["auc"]
    thr = res["final"][P.LAST_MODEL]["thresholds"]["sites"]["site-2"]["thresholds"]  # chosen on its own scores
    assert meta["thresholds"]["chosen_on"] == "site-2's own validation scores"
    assert meta["thresholds"]["values"] == [0.5 if thr[c] is None else thr[c] for c in glob.classes]
    saved = torch.load(tmp_path / "B/models/model.pt", weights_only=True)
    assert all(torch.equal(saved[k], o[k]) for k in o)
    assert "Model: site-2's own model" in (tmp_path / "B/docs/README.md").read_text()
    assert not (tmp_path / "B/docs/roc.png").exists()  # the pooled curves of every site's model are not its card's
    assert E.main([str(ws), "-o", str(tmp_path / "C"), "--site", "site-9"]) == 2
    junk = tmp_path / "junk" / "last_local_model.pt"
    junk.parent.mkdir()
    junk.write_bytes(b"PK\x03\x04 not a model")
    assert E.main([str(ws), "-o", str(tmp_path / "C"), "--site", str(junk)]) == 2  # one line, no traceback
    import os

    here = os.getcwd()
    os.chdir(ws / "site-2")  # at a real site, inside its workspace: a relative path names the site all the same
    try:
        assert P.load_model(ws, "last", site="simulate_job/fedpartial_state/last_local_model.pt").site == "site-2"
    finally:
        os.chdir(here)


def _set_server_workflow_args(job_dir, **args) -> None:
    path = job_dir / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(path.read_text())
    next(w for w in cfg["workflows"] if w["path"].endswith("ScatterAndGather"))["args"].update(args)
    path.write_text(json.dumps(cfg, indent=2))


def test_fedmlp_prototypes_travel_pseudo_labels_persist_and_the_job_resumes(tmp_path, data_cache, monkeypatch):
    """jobs/fedmlp_ich with a 1-round warm-up, run for 2 of its 3 rounds, then resumed from the checkpoints as
    after a server restart (``fedpartial-admin resume-folder``): the resumed job continues at round 2 with the
    server's rule state and method metadata and each site's saved state; prototypes go site -> server -> sites,
    pseudo labels are created in stage 2 and kept as site state; results.json holds all three rounds."""
    import torch

    from fedpartial.data.presets import deep_merge
    from fedpartial.fl.checkpoint import CHECKPOINT_FILE, site_state_file
    from fedpartial.tools.admin import resume_folder

    ckpt = tmp_path / "checkpoints"
    n = 2  # sites, each missing 2 of the 5 classes (the job's 5 sites change nothing tested here)
    args = {
        **deep_merge(TINY["ich"], {"dataset": {"prepare": {"k": 2}}}),
        "checkpoint_dir": str(ckpt),
        "method_args": {"warmup_rounds": 1, "L": 0.5, "R": 0.5, "T0": 0.2, "T1": 0.2},
    }
    job_dir = copy_job("fedmlp_ich", tmp_path / "fedmlp_ich", num_rounds=2, executor_args=args, sites=n)
    _set_server_workflow_args(job_dir, checkpoint_dir=str(ckpt))
    first = tmp_path / "ws1"
    proc = run_simulator(job_dir, first, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(first)[-3000:]
    saved = torch.load(ckpt / "fedmlp_ich" / "simulate_job" / "server" / CHECKPOINT_FILE, weights_only=True)
    assert saved["round"] == 1 and saved["method"] == "fedmlp" and saved["meta"]["fedmlp_global_p0"] is not None
    # the prototypes are stored once: with the model; no rule failure, no site refused for breaking the rule
    assert {k: v for k, v in saved["components"]["aggregator"].items() if k != "step"} == {
        "rule": {},
        "failures": 0,
        "refused": {},
    }
    assert (ckpt / "fedmlp_ich" / "simulate_job" / "server" / CHECKPOINT_FILE).stat().st_mode & 0o077 == 0  # private
    for i in range(1, n + 1):
        kept = sorted(f.name for f in (ckpt / "fedmlp_ich" / "simulate_job" / f"site-{i}").iterdir())
        assert kept == [site_state_file(0), site_state_file(1)]  # the last two rounds
        assert (
            torch.load(ckpt / "fedmlp_ich" / "simulate_job" / f"site-{i}" / site_state_file(1), weights_only=True)[
                "round"
            ]
            == 1
        )

    resumed = resume_folder(job_dir, tmp_path / "fedmlp_ich_resume")
    _set_server_workflow_args(resumed, num_rounds=3)
    ws = tmp_path / "ws2"
    proc = run_simulator(resumed, ws, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    assert "resuming from the checkpoint of round 1" in server_log(ws)
    for i in range(1, n + 1):
        log = (ws / f"site-{i}" / "log.txt").read_text()
        assert "resume: adopted this site's state saved after round 1" in log, log[-2000:]
        assert "round 1: loss" not in log and "round 2: loss" in log  # only the remaining round trained here
    res = results_of(ws)
    assert res["method"] == "fedmlp" and res["num_rounds"] == 3 and res["final"]["FL_global_model.pt"]["test"]
    assert res["setting"] == "missing 2 classes"
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2]
    r0, r1, r2 = res["rounds"]
    # site -> server: local prototypes and learning degrees from the end of the warm-up (round 0) on
    for r in (r0, r1, r2):
        for site, keys in r["site_meta"].items():
            assert {"fedmlp_p0", "fedmlp_p1", "fedmlp_proto_counts", "fedmlp_degree"} <= set(keys), (r["round"], site)
    # server -> sites: global prototypes and degrees go out with every aggregated model
    for r in (r0, r1, r2):
        assert {"fedmlp_global_p0", "fedmlp_global_p1", "fedmlp_global_degree"} <= set(r["server_meta"]), r["round"]
        # the small values are recorded too (prototypes, too large, by key only)
        assert len(r["server_stats"]["fedmlp_global_degree"]) == 5 and "fedmlp_global_p0" not in r["server_stats"]
        assert all(len(st["fedmlp_degree"]) == 5 for st in r["site_stats"].values()), r["round"]
    # ... and the sites used them in stage 2 (the key is only reported when global prototypes arrived)
    for r in (r1, r2):
        assert all("fedmlp_received_prototypes" in keys for keys in r["site_meta"].values()), r["round"]
    table = (ws / "server" / "simulate_job" / "results.md").read_text()
    assert "| Method | missing 2 classes: BACC | missing 2 classes: AUC | missing 2 classes: mAP |" in table
    assert "fedmlp (last round)" in table and "epidural" in table
    tagged = 0
    for i in range(1, n + 1):
        state = torch.load(ws / f"site-{i}/simulate_job/fedpartial_state/trainer_state.pt", weights_only=False)
        tags = torch.as_tensor(state["fedmlp_pseudo_labels"])
        assert tags.shape[1] == 5
        tagged += int((tags >= 0).sum())
    assert tagged > 0, "no pseudo label was created in stage 2"
    # the simulation-only audit reads the same tags against the phantom's true labels (fedpartial.tools.tag_audit)
    from fedpartial.tools.tag_audit import audit

    monkeypatch.setenv("FEDPARTIAL_CACHE", str(data_cache))
    rows = audit(ws)["pooled"]
    assert sum(r["pos_tags"] + r["neg_tags"] for r in rows) == tagged
    assert sum(r["entries"] for r in rows) == 2 * sum(s["n_train"] for s in res["data"]["sites"].values())
    assert all(0 <= r["pos_correct"] <= r["pos_tags"] and 0 <= r["neg_correct"] <= r["neg_tags"] for r in rows)


# The paper configurations need the full datasets (RSNA ICH, NIH CXR14 at 224 px); here they run 2 rounds with
# their own model / optimiser / method settings on the data available (phantom, the 1,000-image CXR subset).
PAPER_DATA = {
    "fedmlp_ich_paper": {
        "dataset": {
            "preset": "ich_phantom",
            "image_size": 32,
            "cache": "memory",
            "prepare": {"root": None, "source_args": {"n_images": 240, "size": 64, "seed": 0}},
        }
    },
    "fedmlp_cxr14_paper": {
        "dataset": {
            "image_size": 32,
            "cache": "memory",
            "prepare": {"root": "../shared/data/nih_cxr14_1000", "site_sizes": None, "test_frac": 0.2},
        }
    },
}


@pytest.mark.parametrize(
    "job", ["fedmlp_ich_paper"]
)  # fedmlp_cxr14_paper: the same code, its settings in test_build_and_config
def test_paper_job_runs_with_its_settings(job, tmp_path, data_cache):
    """The paper configuration (ResNet-18, Adam 3e-5, batch 32, L/R/T0/T1 of the paper) runs through stage 2."""
    if "cxr14" in job:
        real_data("nih_cxr14_1000")
    from fedpartial.data.presets import deep_merge

    n = 2  # sites (the job's 5 split into 2, each missing 1 class: a ResNet-18 per site is the test's CPU time)
    data = deep_merge(PAPER_DATA[job], {"dataset": {"prepare": {"k": n - 1}}})
    args = {
        **data,
        "evaluation": {"test_every": 1},
        "train": {"local_steps": 2, "num_workers": 0},
        "method_args": {"warmup_rounds": 1},
    }
    job_dir = copy_job(job, tmp_path / job, num_rounds=2, executor_args=args, sites=n)
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["method"] == "fedmlp" and res["setting"] == "missing 1 class"
    assert all("fedmlp_received_prototypes" in k for k in res["rounds"][1]["site_meta"].values())


# The papers' comparison methods. What a 2-round simulator run of each one checked (both rounds take both sites'
# updates, no rule error, the second stage runs on what the rule sent after the first) is checked for EVERY
# registered method in process by test_method_zoo.py (its ``_Glue``: each site's update through the site's
# MinCountFilter and NVFlare's wire format into the job's PartialLabelAggregator, every site accepted, no rule
# error, the aggregate equal to the rule's), and every job's configuration by the check above. The NVFlare glue
# is the same for every method, so the simulator runs only the comparison methods whose state crosses NVFlare's
# processes and checkpoints in a way no other simulator test covers: FedAvgM (a server rule with state: its
# momentum goes through the server checkpoint every round) and MOON (a site trainer with state: its previous
# local model goes through the site's state folder), each with 2 sites and a 1-round first stage.
SIMULATED_COMPARISON = ("fedavgm_ich:fedavgm", "moon_ich:moon")


def _comparison_jobs() -> list[str]:
    """``"job:method"`` of every registered comparison method (the registry's list: a new method adds itself)."""
    from fedpartial.methods import comparison_jobs, load_all

    load_all()
    return comparison_jobs()


def test_the_simulated_comparison_methods_are_registered():
    assert set(SIMULATED_COMPARISON) <= set(_comparison_jobs())


COMPARISON_JOBS = list(SIMULATED_COMPARISON)
TWO_SITES = {  # the data of the comparison runs, on 2 sites
    "ich": {"dataset": {"prepare": {"k": 2, "source_args": {"n_images": 120, "size": 32, "seed": 0}}}},
    "ham10000": {"dataset": {"prepare": {**HAM_WITHOUT_TABLE, "site_sizes": 40}}},
}


@pytest.mark.parametrize("job", COMPARISON_JOBS)
def test_comparison_method_runs_two_rounds(job, tmp_path, data_cache):
    from fedpartial.data.presets import deep_merge
    from fedpartial.methods import get_method

    job, _, method_name = job.partition(":")  # "job:method" runs the job with another method
    kind, needs = _kind(job)
    if needs:
        real_data(needs)
    client = json.loads((REPO / "jobs" / job / "app/config/config_fed_client.json").read_text())
    method_name = method_name or client["method"]
    method = get_method(method_name)
    args = deep_merge(deep_merge(TINY[kind], TWO_SITES[kind]), {"evaluation": {"test_every": 0}})
    if method_name != client["method"]:
        args["method"] = method_name
    args["method_args"] = one_round_first_stage(method)  # merged over the job's own method_args, both sides
    job_dir = copy_job(job, tmp_path / job, num_rounds=2, executor_args=args, sites=2)
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=2, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["method"] == method_name and res["num_rounds"] == 2
    for r in res["rounds"]:
        assert sorted(r["sites"]) == ["site-1", "site-2"], r["sites"]
        assert r["rejected"] == {} and r["missing"] == [] and r["rule_error"] is None
        assert r["val"]["macro"]["auc"] is not None
    assert 0.0 <= res["final"]["FL_global_model.pt"]["test"]["macro"]["auc"] <= 1.0
