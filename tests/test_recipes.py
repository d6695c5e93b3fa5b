"""The NVFlare 2.9 front door: recipes (``fedpartial.recipes``), ``jobs/<name>/job.py``, the exported job folders,
the data anchor and per-site prepared data."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, check_two_rounds, real_data, results_of, run_recipe, run_simulator, server_log
from fedpartial.tools.build_jobs import check_job, export_job, job_recipe, job_sources, training_jobs

JOBS = [j.name for j in job_sources(REPO / "jobs")]
TRAINING_JOBS = [j.name for j in training_jobs(REPO / "jobs")]  # the statistics jobs have no rounds
load = lambda folder, f: json.loads((folder / f).read_text())


def _defaults(path: str) -> dict:
    """Constructor defaults of a component class, over its whole MRO (a subclass passing ``**kwargs`` on)."""
    module, _, name = path.rpartition(".")
    out: dict = {}
    for cls in reversed(getattr(importlib.import_module(module), name).__mro__):
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        for k, p in inspect.signature(init).parameters.items():
            if p.default is not inspect.Parameter.empty and k not in ("self", "args", "kwargs"):
                out[k] = p.default
    return out


def _entries(cfg: dict) -> dict:
    """``{id: (path, arguments with defaults filled and "{var}" references resolved)}`` of a config."""
    from fedpartial.recipes import _resolve, _server_params

    variables = _server_params(cfg)
    out = {}
    for key in ("components", "workflows"):
        for e in cfg.get(key, []):
            out[e["id"]] = (e["path"], {**_defaults(e["path"]), **_resolve(e.get("args", {}), variables)})
    for i, e in enumerate(cfg.get("executors", [])):
        ex = e["executor"]
        out[f"executor-{i}"] = (
            ex["path"],
            {**_defaults(ex["path"]), **_resolve(ex.get("args", {}), variables)},
            sorted(e["tasks"]),
        )
    for key in ("task_data_filters", "task_result_filters"):
        for g in cfg.get(key, []):
            for f in g["filters"]:
                out[f"{key}:{f['path']}"] = (
                    f["path"],
                    {**_defaults(f["path"]), **f.get("args", {})},
                    sorted(g["tasks"]),
                )
    return out


def _reload_and_export(folder, dest):
    """Load an exported job folder (each entry's object from its path and arguments, as NVFlare's config loader
    does) into a plain ``FedJob`` and export it again with NVFlare's own exporter (attribute values, defaults
    left out)."""
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType

    from fedpartial.recipes import _server_params, instantiate

    server, client = (
        load(folder, "app/config/config_fed_server.json"),
        load(folder, "app/config/config_fed_client.json"),
    )
    job = FedJob(name=folder.name, min_clients=load(folder, "meta.json")["min_clients"])
    job.set_app_packages(["fedpartial"])
    sv, cv = _server_params(server), _server_params(client)
    job.to_server(sv)
    objects = {}
    for e in server["components"] + server["workflows"]:
        objects[e["id"]] = instantiate(e, sv)
        job.to_server(objects[e["id"]], id=e["id"])
    job.to_clients(cv)
    for e in client["executors"]:
        job.to_clients(instantiate(e["executor"], cv), tasks=e["tasks"])
    for e in client["components"]:
        job.to_clients(instantiate(e, cv), id=e["id"])
    for cfg, to in ((server, job.to_server), (client, job.to_clients)):
        for key, ftype in (
            ("task_data_filters", FilterType.TASK_DATA),
            ("task_result_filters", FilterType.TASK_RESULT),
        ):
            for g in cfg[key]:
                for f in g["filters"]:
                    to(instantiate(f, sv if cfg is server else cv), filter_type=ftype, tasks=g["tasks"])
    job.export_job(str(dest))
    return dest / folder.name, objects


@pytest.mark.parametrize("job", TRAINING_JOBS)
def test_export_load_export_gives_the_same_job(job, tmp_path):
    """Export a job.py, load the folder, export again through NVFlare's exporter: the same components with the same
    arguments; the training workflow keeps the job's number of sites (``min_clients``), and only the loaded
    object waits for ``min_clients - max_missing`` answers (once, not twice)."""
    first = export_job(REPO / "jobs" / job, tmp_path / "a")
    again, objects = _reload_and_export(first, tmp_path / "b")
    for f in ("app/config/config_fed_server.json", "app/config/config_fed_client.json"):
        a, b = _entries(load(first, f)), _entries(load(again, f))
        assert a.keys() == b.keys(), f
        for k in a:
            assert a[k] == b[k], (f, k)
    server = load(first, "app/config/config_fed_server.json")
    sites, missing = server["min_clients"], server["max_missing_sites"]
    sag = objects["scatter_and_gather"]
    assert sag._min_clients == sites - missing and sag.max_missing == missing
    again_sag = next(
        w for w in load(again, "app/config/config_fed_server.json")["workflows"] if w["id"] == "scatter_and_gather"
    )
    assert again_sag["args"]["min_clients"] == sites  # the job's sites, not sites - max_missing
    # meta.json: the sites that must stay connected (NVFlare's deployment policy tolerates max_missing dead ones)
    assert load(first, "meta.json")["min_clients"] == load(again, "meta.json")["min_clients"] == sites - missing


def test_every_exported_folder_matches_its_job_py(tmp_path):
    """``fedpartial-build-jobs --check`` (make check-jobs): each jobs/<name> folder equals what its job.py exports
    now; an edited exported config, a changed job.py or a stale package copy is reported."""
    src = REPO / "custom" / "fedpartial"
    assert JOBS == sorted(p.parent.name for p in (REPO / "jobs").glob("*/job.py")) and "fedmlp_ich" in JOBS
    for job in JOBS:
        assert check_job(REPO / "jobs" / job, src) == [], f"{job}: run `make jobs`"
    jobs = tmp_path / "jobs"
    shutil.copytree(REPO / "jobs" / "fedavg_ich", jobs / "fedavg_ich", ignore=shutil.ignore_patterns("custom"))
    folder = jobs / "fedavg_ich"
    assert any("custom" in p for p in check_job(folder, src))  # no package copy yet
    export_job(folder)
    assert check_job(folder, src) == [] and (folder / "job.py").is_file() and (folder / "README.md").is_file()
    cfg = load(folder, "app/config/config_fed_server.json")
    cfg["num_rounds"] = 3
    (folder / "app/config/config_fed_server.json").write_text(json.dumps(cfg))
    assert any("config_fed_server.json differs" in p for p in check_job(folder, src))
    export_job(folder)
    text = (folder / "job.py").read_text()
    assert "**ich_phantom.SETTINGS," in text  # the job's table (table_settings) gives its rounds
    edited = text.replace("**ich_phantom.SETTINGS,", '**{**ich_phantom.SETTINGS, "num_rounds": 21},')
    (folder / "job.py").write_text(edited)
    assert any("config_fed_server.json differs" in p for p in check_job(folder, src))


def test_recipe_options_are_the_methods_checked_options():
    from fedpartial.options import OptionError
    from fedpartial.recipes import FedIRMRecipe, FedLSMRecipe, FedMLPRecipe, PartialLabelRecipe, SurgicalRecipe

    r = FedMLPRecipe(name="m", dataset="ich_phantom", num_sites=5, num_rounds=3, warmup_rounds=1, L=0.4)
    assert r.method == "fedmlp" and r.method_args == {"warmup_rounds": 1, "L": 0.4}
    ex = r.client_config["executors"][0]["executor"]["args"]
    agg = next(c for c in r.server_config["components"] if c["id"] == "aggregator")["args"]
    assert ex["method_args"] == agg["method_args"] == {"warmup_rounds": 1, "L": 0.4}
    with pytest.raises(OptionError, match="job 'm'.*'warmup_round'.*did you mean 'warmup_rounds'"):
        FedMLPRecipe(name="m", dataset="ich_phantom", num_sites=5, warmup_round=1)
    with pytest.raises(OptionError, match="job 'm'.*'L' must be"):
        FedMLPRecipe(name="m", dataset="ich_phantom", num_sites=5, L="high")
    with pytest.raises(OptionError, match="job 'm' 'train'.*'lr' must be"):
        FedMLPRecipe(name="m", dataset="ich_phantom", num_sites=5, train={"lr": "fast"})
    with pytest.raises(ValueError, match="num_rounds"):
        PartialLabelRecipe(name="m", method="fedavg", dataset="ich_phantom", num_sites=5, num_rounds=0)
    with pytest.raises(ValueError, match="unknown method 'fedavgg'"):
        PartialLabelRecipe(name="m", method="fedavgg", dataset="ich_phantom", num_sites=5)
    assert FedLSMRecipe(name="l", dataset="ham10000", num_sites=5).method == "fedlsm"
    assert FedIRMRecipe(name="i", dataset="ham10000", num_sites=10).method == "fedirm"
    assert SurgicalRecipe(name="s", dataset="ich_phantom", num_sites=5).method == "surgical"


def test_experiment_tracking_composes(tmp_path):
    """TensorBoard by default; ``tracking=None`` + NVFlare's ``add_experiment_tracking`` picks another tracker."""
    from nvflare.recipe.utils import add_experiment_tracking

    from fedpartial.recipes import PartialLabelRecipe

    kw = dict(name="t", method="fedavg", dataset="ich_phantom", num_sites=3, num_rounds=1)
    folder = PartialLabelRecipe(**kw).export(str(tmp_path / "tb"))
    receivers = [c for c in load(folder, "app/config/config_fed_server.json")["components"] if c["id"] == "receiver"]
    assert [c["path"].rsplit(".", 1)[-1] for c in receivers] == ["TBAnalyticsReceiver"]
    bare = PartialLabelRecipe(**kw, tracking=None)
    folder = bare.export(str(tmp_path / "none"))
    assert not [c for c in load(folder, "app/config/config_fed_server.json")["components"] if c["id"] == "receiver"]
    try:
        importlib.import_module("mlflow")
    except ImportError:
        pytest.skip("mlflow is not installed (pip install mlflow-skinny)")
    add_experiment_tracking(bare, "mlflow", {"tracking_uri": f"file://{tmp_path}/mlruns"})
    folder = bare.export(str(tmp_path / "mlflow"))
    comps = {c["id"]: c for c in load(folder, "app/config/config_fed_server.json")["components"]}
    assert comps["receiver"]["path"].endswith("MLflowReceiver")
    assert comps["receiver"]["args"]["tracking_uri"] == f"file://{tmp_path}/mlruns"


# ------------------------------------------------------------------------------------------ simulator runs

TINY_ICH = {"image_size": 32, "prepare": {"source_args": {"n_images": 240, "size": 64, "seed": 0}}}
FAST = {
    "evaluation": {"test_every": 1},
    "train": {"optimizer": "adam", "lr": 0.001, "batch_size": 16, "local_epochs": 1},
}


def _round_metrics(res: dict) -> list:
    return [
        (r["round"], sorted(r["sites"]), r["val"]["macro"], r["test"]["macro"] if r["test"] else None)
        for r in res["rounds"]
    ] + [res["final"]["FL_global_model.pt"]["test"]["macro"]]


@pytest.mark.integration
def test_recipe_and_exported_folder_give_the_same_results(tmp_path, data_cache):
    """jobs/fedavg_ich through its recipe (``python job.py``'s SimEnv, from the checkout, no data variable) and
    the folder it exports through ``nvflare simulator``: the same results for the same seed; and everything a
    2-round run must leave (conftest.check_two_rounds: the phantom source's FedAvg simulator run)."""
    overrides = {  # 2 sites: every site is a process, twice
        "num_rounds": 2,
        "num_sites": 2,
        "dataset": {"preset": "ich_phantom", **TINY_ICH, "prepare": {**TINY_ICH["prepare"], "num_sites": 2, "k": 2}},
        **FAST,
    }
    env = {"FEDPARTIAL_CACHE": str(data_cache)}
    proc = run_recipe("fedavg_ich", tmp_path / "ws_recipe", overrides, env=env)
    ws = tmp_path / "ws_recipe" / "fedavg_ich"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    assert "is deprecated" not in proc.stdout + proc.stderr
    folder = export_job(REPO / "jobs" / "fedavg_ich", tmp_path / "exported", **overrides)
    sim = tmp_path / "ws_sim"
    proc = run_simulator(folder, sim, n=2, env=env, cli=True)  # the README's classic command
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(sim)[-3000:]
    a, b = results_of(ws), check_two_rounds(sim, "fedavg")
    assert a["method"] == "fedavg" and len(a["rounds"]) == 2
    assert _round_metrics(a) == _round_metrics(b)
    assert {s: i["n_train"] for s, i in a["data"]["sites"].items()} == {
        s: i["n_train"] for s, i in b["data"]["sites"].items()
    }


# fedavg_ham10000's recipe runs from the checkout too, in tests/test_export.py (its single-label bundle is trained
# by run_recipe, without FEDPARTIAL_DATA_DIR, and checked there as a two-round run); this run is also the NIH
# ChestX-ray14 job's simulator check (it left test_jobs_simulator.py's two-round list, its assertions below)
REAL_JOBS = {"fedavg_cxr14": "nih_cxr14_1000"}


@pytest.mark.integration
@pytest.mark.realdata
@pytest.mark.parametrize("job", sorted(REAL_JOBS))
def test_real_data_job_finds_its_data_from_the_checkout(job, tmp_path, data_cache):
    """A HAM10000 / CXR14 job's recipe, run from the checkout as its README says (no ``FEDPARTIAL_DATA_DIR``): its
    relative root ``../shared/data/...`` resolves against the checkout, not the simulated site's workspace; one
    round on a small share of the images."""
    real_data(REAL_JOBS[job])
    recipe = job_recipe(REPO / "jobs" / job)
    prepare = {"site_sizes": 40} if "ham" in job else {"site_sizes": 30, "num_sites": 3, "k": 2}  # 3 of NIH's 8 sites
    dataset = {**recipe.dataset, "image_size": 32, "prepare": {**recipe.dataset.get("prepare", {}), **prepare}}
    overrides = {"num_rounds": 1, "dataset": dataset, **FAST}
    sites = prepare.get("num_sites")
    proc = run_recipe(job, tmp_path / "ws", overrides, sites=sites, env={"FEDPARTIAL_CACHE": str(data_cache)})
    ws = tmp_path / "ws" / job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert len(res["rounds"]) == 1 and all(i["n_train"] > 0 for i in res["data"]["sites"].values())
    sites = sorted(res["data"]["sites"])
    for r in res["rounds"]:  # every site trained and was averaged; the shared sets scored once, by the first site
        assert sorted(r["sites"]) == sites and r["rejected"] == {} and r["missing"] == []
        assert r["val"]["macro"]["auc"] is not None and r["evaluated_by"]["val"] == ["site-1"]
    final = res["final"]["FL_global_model.pt"]
    assert final["sites"] == ["site-1"] and 0.0 <= final["test"]["macro"]["auc"] <= 1.0


def test_a_missing_data_root_names_what_to_set(tmp_path, monkeypatch):
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.site_config import DATA_DIR_ENV, SiteDataError, data_anchor, resolve_site_data

    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # the working folder plays no part
    assert data_anchor() == (REPO, "the checkout")
    ds = resolve_dataset({"preset": "ham10000", "prepare": {"root": "no/such/folder"}})
    with pytest.raises(
        SiteDataError,
        match=rf"site 'site-2'.*'no/such/folder' -> {REPO}/no/such/folder does not "
        rf"exist \(relative to {REPO} \(the checkout\)\); set \${DATA_DIR_ENV}",
    ):
        resolve_site_data("site-2", ds, tmp_path / "local")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(SiteDataError, match=rf"-> {tmp_path}/no/such/folder .*\${DATA_DIR_ENV}\)"):
        resolve_site_data("site-2", ds, tmp_path / "local")
    ds = resolve_dataset({"preset": "ich_phantom", "prepared": "nowhere"})
    with pytest.raises(SiteDataError, match="prepared 'nowhere'"):
        resolve_site_data("site-1", ds, tmp_path / "local")


def test_identical_training_manifests_are_found():
    from fedpartial.fl.data_check import same_training_rows

    sites = {
        "site-1": {"train_set": "a", "n_train": 5},
        "site-2": {"train_set": "b", "n_train": 4},
        "site-3": {"train_set": "a", "n_train": 5},
        "site-4": {"train_set": "c", "n_train": 0},
        "site-5": {"train_set": "c", "n_train": 0},
    }
    assert same_training_rows(sites) == [["site-1", "site-3"]]
    assert same_training_rows({k: v for k, v in sites.items() if k != "site-3"}) == []


@pytest.mark.integration
def test_prepared_folder_gives_each_site_its_own_data(tmp_path, data_cache):
    """``job.py --data PREPARED_DIR``: each simulated site trains on its own ``site-<i>.csv`` (per-site sizes in
    the results are the manifests' sizes, which differ), and the data check warns when two sites' manifests are
    the same rows (site-3's is a copy of site-2's, in the same run)."""
    import pandas as pd

    from fedpartial.data.prepare import prepare

    out = tmp_path / "prepared"
    prepare(
        "ich_phantom",
        None,
        out,
        3,
        "missing_k",
        k=1,
        seed=0,
        site_sizes=[20, 30, 40],
        source_args={"n_images": 240, "size": 64, "seed": 0},
    )
    shutil.copy(out / "site-2.csv", out / "site-3.csv")  # site-3 configured with site-2's data by mistake
    rows = {f"site-{i}": len(pd.read_csv(out / f"site-{i}.csv")) for i in (1, 2, 3)}
    assert rows["site-1"] != rows["site-2"]
    # this run also tracks to a local MLflow store where MLflow is installed (requirements.txt)
    mlruns = tmp_path / "mlruns"
    tracking = (
        {"tracking": "mlflow", "tracking_config": {"tracking_uri": mlruns.as_uri()}}
        if importlib.util.find_spec("mlflow")
        else {}
    )
    proc = run_recipe(
        "fedavg_ich",
        tmp_path / "ws",
        {
            "num_rounds": 1,
            "prepared": str(out),
            "dataset": {"preset": "ich_phantom", "image_size": 32},
            **FAST,
            **tracking,
        },
        sites=3,
        env={"FEDPARTIAL_CACHE": str(data_cache), "MLFLOW_ALLOW_FILE_STORE": "true"},
    )
    ws = tmp_path / "ws" / "fedavg_ich"
    log = server_log(ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    res = results_of(ws)
    assert {s: i["n_train"] for s, i in res["data"]["sites"].items()} == rows
    if tracking:  # the sites' metrics reached the server's MLflow store: one run per site, metrics written (a file
        # store cannot hold both "val/auc" and "val/auc/<class>", so some of a site's values may be refused)
        runs = {
            m.read_text().split("run_name: ")[1].split("-")[:2][1]: m.parent
            for m in mlruns.glob("*/*/meta.yaml")
            if "run_name: site-" in m.read_text()
        }
        assert sorted(runs) == ["1", "2", "3"], sorted(str(p.relative_to(mlruns)) for p in mlruns.rglob("*"))[:20]
        assert any(p.is_file() for run in runs.values() for p in (run / "metrics").rglob("*"))
    # the data check names the two sites with the same rows, and only them
    assert "sites ['site-2', 'site-3'] train on identical manifests" in log, proc.stdout[-2000:] + log[-3000:]
    assert log.count("train on identical manifests") == 1


# ------------------------------------------------------------------------------------------ job.py options


def _job_main_runs(monkeypatch, argv: list[str]) -> list[dict]:
    """Run ``jobs/fedavg_ich/job.py``'s command line with the simulator launcher replaced by a recorder of the
    command ``SupervisedSimEnv.deploy`` runs (the job folder it exported, the workspace, the sites, threads and
    GPUs), one dict per run."""
    from fedpartial.fl import simulator
    from fedpartial.recipes import job_main
    from fedpartial.tools.build_jobs import load_job_module

    calls: list[dict] = []

    def supervise(cmd, env=None, **kwargs):
        assert cmd[1:3] == ["-m", "fedpartial.fl.simulator"] and (Path(cmd[3]) / "meta.json").is_file()
        opts = dict(zip(cmd[4::2], cmd[5::2]))
        calls.append(
            {
                "name": Path(cmd[3]).name,
                "workspace": opts["-w"],
                "n_clients": len(opts["-c"].split(",")),
                "threads": int(opts["-t"]),
                "gpu": opts.get("-gpu"),
                "parent": int(opts["--parent"]),
            }
        )
        return 0

    monkeypatch.setattr(simulator, "supervise", supervise)
    job_main(load_job_module(REPO / "jobs" / "fedavg_ich").recipe, argv)
    return calls


def test_job_py_gpu_reaches_the_simulator(monkeypatch, tmp_path, capsys):
    """``job.py --gpu 0,1`` is NVFlare's ``SimEnv(gpu_config="0,1")`` (the simulator's ``-gpu``), and the sites'
    GPUs are printed as the simulator deals them; without ``--gpu`` none is passed; a malformed value stops."""
    [run] = _job_main_runs(monkeypatch, ["--gpu", "0,1", "--sites", "3", "--workspace", str(tmp_path)])
    assert run["gpu"] == "0,1" and run["n_clients"] == 3 and run["name"] == "fedavg_ich"
    assert run["workspace"] == str(tmp_path / "fedavg_ich")
    out = capsys.readouterr().out
    assert "GPU 0: site-1, site-3" in out and "GPU 1: site-2" in out
    [run] = _job_main_runs(monkeypatch, ["--workspace", str(tmp_path)])
    assert run["gpu"] is None and run["n_clients"] == run["threads"] == 5
    with pytest.raises(SystemExit):
        _job_main_runs(monkeypatch, ["--gpu", "0,1,2,3,4,5", "--workspace", str(tmp_path)])
    assert "6 GPU groups for 5 sites" in capsys.readouterr().err


def test_gpu_sites_deal_the_sites_as_the_simulator_does():
    from fedpartial.recipes import gpu_sites

    assert gpu_sites("0,1", 5) == {"0": ["site-1", "site-3", "site-5"], "1": ["site-2", "site-4"]}
    assert gpu_sites("0,0", 3) == {"0": ["site-1", "site-3"], "0 (slot 2)": ["site-2"]}
    assert gpu_sites("[0,1],[2]", 3) == {"0,1": ["site-1", "site-3"], "2": ["site-2"]}
    assert gpu_sites("1", 2) == {"1": ["site-1", "site-2"]}
    for bad in ("a,b", "0,,1", "[0"):
        with pytest.raises(ValueError, match=f"--gpu '{re.escape(bad)}'"):
            gpu_sites(bad, 3)


def test_job_py_sites_sets_the_split_and_the_connected_minimum(monkeypatch, tmp_path):
    """``job.py --sites 3``: three simulated sites, the split dealt over three, and (exported with
    ``--export``, as the POC walk-through does) ``meta.json``'s ``min_clients`` is 3 - max_missing."""
    [run] = _job_main_runs(monkeypatch, ["--sites", "3", "--workspace", str(tmp_path)])
    assert run["n_clients"] == run["threads"] == 3
    # NVFlare takes --export / --export-dir out of sys.argv when nvflare.recipe.spec is imported: set what it read
    monkeypatch.setattr("nvflare.recipe.spec._RECIPE_EXPORT", True)
    monkeypatch.setattr("nvflare.recipe.spec._RECIPE_EXPORT_DIR", str(tmp_path / "out"))
    with pytest.raises(SystemExit) as done:
        _job_main_runs(monkeypatch, ["--sites", "3"])
    assert done.value.code == 0
    folder = tmp_path / "out" / "fedavg_ich"
    server = load(folder, "app/config/config_fed_server.json")
    client = load(folder, "app/config/config_fed_client.json")
    assert server["min_clients"] == 3 and server["max_missing_sites"] == 1
    assert load(folder, "meta.json")["min_clients"] == 2
    assert client["executors"][0]["executor"]["args"]["dataset"]["prepare"]["num_sites"] == 3


def test_new_job_scaffolds_a_job_py_that_exports_the_same_job(tmp_path):
    """``new_job`` writes a ``job.py`` (a ``partial`` of the recipe) and exports that; the export equals the
    recipe's own, and the scaffold takes overrides like every shipped job."""
    from fedpartial.tools.build_jobs import JOB_FILES
    from fedpartial.tools.new_job import write_job

    kw = dict(
        method="fedmlp",
        dataset={"preset": "nih_cxr14", "prepare": {"num_sites": 8, "k": 7}},
        num_sites=8,
        num_rounds=3,
        method_args={"warmup_rounds": 1},
        train={"optimizer": "adam", "lr": 0.01, "batch_size": 8, "local_epochs": 1},
    )
    plain = write_job(tmp_path / "a" / "j", **kw)
    scaffold = write_job(tmp_path / "b" / "j", **kw, job_py=True)
    text = (scaffold / "job.py").read_text()
    assert "partial(\n    FedMLPRecipe," in text and "warmup_rounds=1" in text and "method_args" not in text
    for f in JOB_FILES:
        assert load(plain, f) == load(scaffold, f), f
    assert job_recipe(scaffold, num_rounds=5).num_rounds == 5
    short = write_job(
        tmp_path / "c" / "j", method="fedavg_pl", dataset={"preset": "ich_phantom"}, num_sites=3, job_py=True
    )
    ruff = [str(Path(sys.executable).parent / "ruff"), "format", "--config", str(REPO / "pyproject.toml"), "--diff"]
    for job_py in (scaffold / "job.py", short / "job.py"):  # written as the formatter writes it (the linted jobs/)
        out = subprocess.run([*ruff, str(job_py)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    assert "\n" not in (short / "job.py").read_text().split("recipe = ")[1].split("\n\n")[0]  # one line: it fits


def test_the_recipe_side_imports_nothing_from_tools():
    """One place builds the job layout: the recipes, the layout and the tables' settings import nothing from
    ``fedpartial.tools`` (the tools import them)."""
    import ast

    pkg = REPO / "custom" / "fedpartial"
    files = [pkg / "recipes.py", pkg / "job_layout.py", *sorted((pkg / "table_settings").glob("*.py"))]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert "tools" not in target.split("."), f"{f.name} imports {target}"
            elif isinstance(node, ast.Import):
                assert not any("fedpartial.tools" in a.name for a in node.names), f.name


def test_the_exporter_overrides_are_nvflare_s_current_methods(monkeypatch):
    """fedpartial.fl.job_export overrides private methods of NVFlare's FedJobConfig (no public hook): they exist
    with the parameters it expects, and a rename or a changed signature fails the check by name."""
    from nvflare.job_config.fed_job_config import FedJobConfig

    from fedpartial.fl import job_export

    job_export.check_nvflare()
    monkeypatch.delattr(FedJobConfig, "_process_filters")
    with pytest.raises(RuntimeError, match="FedJobConfig._process_filters is gone"):
        job_export.check_nvflare()
    monkeypatch.undo()
    monkeypatch.setattr(FedJobConfig, "_get_args", lambda self, component: None)
    with pytest.raises(RuntimeError, match=r"FedJobConfig._get_args takes \['self', 'component'\]"):
        job_export.check_nvflare()


def test_the_dataset_section_is_checked_like_every_section(monkeypatch, tmp_path, capsys):
    """``job.py --set dataset.image_sise=32`` stops before the simulator with one line naming ``image_size`` (it was
    silently ignored); a misspelt ``prepare`` key, a wrong type and an impossible value too; the same check is the
    site's (an exported job's executor) and predict's, through ``resolve_dataset``."""
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.fl.executor import PartialLabelExecutor
    from fedpartial.options import OptionError

    for setting, pattern in (
        (
            "dataset.image_sise=32",
            r"job 'fedavg_ich' 'dataset': unknown option 'image_sise'; did you mean 'image_size'",
        ),
        ("dataset.prepare.sede=3", r"'dataset.prepare': unknown option 'sede'; did you mean 'seed'"),
        ("dataset.prepare.val_frac=big", r"'dataset.prepare': option 'val_frac' must be float, got 'big'"),
        ("dataset.channels=2", r"'dataset': option 'channels' must be one of 1, 3, got 2"),
        ("dataset.image_size=0", r"'image_size' must be at least 8 pixels, got 0"),
        ("dataset.cache=dsk", r"option 'cache' must be one of 'store', 'disk', 'memory', 'none', got 'dsk'"),
        ("dataset.std=[0.2,0.3]", r"option 'std' needs one value per channel \(3\)"),
    ):
        with pytest.raises(SystemExit) as stop:
            _job_main_runs(monkeypatch, ["--set", setting, "--workspace", str(tmp_path)])
        assert stop.value.code == 2, setting
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(err) == 1 and re.search(pattern, err[0]), (setting, err)
    assert not (tmp_path / "fedavg_ich").exists()  # nothing started
    from dataclasses import fields

    from fedpartial.data.settings import DatasetOptions

    doc = (REPO / "docs" / "datasets.md").read_text()  # docs/datasets.md names every key of the section
    listed = doc.split("`DatasetOptions` (", 1)[1].split(")", 1)[0]
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(f.name for f in fields(DatasetOptions))
    from fedpartial.data.decode import RESIZE_FILTERS
    from fedpartial.data.settings import RESIZE_MODES

    assert set(RESIZE_MODES) == set(RESIZE_FILTERS)  # the resize modes the section takes are the decoder's filters
    assert resolve_dataset({"preset": "ich_phantom", "image_size": 32})["image_size"] == 32  # a good one passes
    with pytest.raises(OptionError, match=r"site 'site-1' 'dataset': unknown option 'image_sise'"):
        PartialLabelExecutor(dataset={"preset": "ich_phantom", "image_sise": 32}, method="fedavg")._resolve_data(
            _FakeCtx(), "site-1"
        )


class _FakeCtx:
    """The one call ``_resolve_data`` makes of its FL context before it reads the dataset section."""

    def get_prop(self, key, default=None):
        return {"__job_meta__": {"name": "j"}}.get(key, default)

    def get_job_id(self):
        return "j"
