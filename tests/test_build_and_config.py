"""The build step, the job folders and the site-data resolution."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from fedpartial.data.presets import resolve_dataset
from fedpartial.data.site_config import SITE_CONFIG_ENV, SiteDataError, resolve_site_data
from fedpartial.methods import available_methods
from fedpartial.tools.build_jobs import build_job, differences, is_training_job, job_dirs


def test_built_copies_match_custom(tmp_path):
    """Every job's app/custom equals custom/ after the build (the README's setup runs it)."""
    src = REPO / "custom" / "fedpartial"
    for job in job_dirs(REPO / "jobs"):
        assert build_job(job, src, check=True) == [], f"{job.name}: run `make jobs`"


def test_check_detects_a_stale_copy(tmp_path):
    src = REPO / "custom" / "fedpartial"
    job = tmp_path / "job"
    (job / "app" / "config").mkdir(parents=True)
    (job / "meta.json").write_text(json.dumps({"deploy_map": {"app": ["@ALL"]}}))
    assert build_job(job, src, check=True)  # nothing built yet
    build_job(job, src)
    assert build_job(job, src, check=True) == []
    (job / "app/custom/fedpartial/models.py").write_text("# edited by hand\n")
    assert any("models.py differs" in d for d in differences(src, job / "app/custom/fedpartial"))


@pytest.mark.parametrize("job", [p.name for p in job_dirs(REPO / "jobs") if is_training_job(p)])
def test_job_configs_are_consistent(job):
    folder = REPO / "jobs" / job
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["deploy_map"] == {"app": ["@ALL"]}
    server = json.loads((folder / "app/config/config_fed_server.json").read_text())
    client = json.loads((folder / "app/config/config_fed_client.json").read_text())
    assert server["method"] == client["method"] and server["method"] in available_methods()
    args = client["executors"][0]["executor"]["args"]
    ds = resolve_dataset(args["dataset"])
    comps = {c["id"]: c for c in server["components"]}
    assert comps["model"]["args"]["num_classes"] == len(ds["classes"])
    assert comps["data_summary"]["args"]["classes"] == ds["classes"]
    assert comps["model"]["args"]["in_channels"] == args["model"]["in_channels"] == ds["channels"]


def test_missing_site_config_names_the_site(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_CONFIG_ENV, raising=False)
    ds = resolve_dataset({"preset": "rsna_ich", "require_site_config": True})
    with pytest.raises(SiteDataError, match="site 'hospital-7'.*rsna_ich.*fedpartial_data.json"):
        resolve_site_data("hospital-7", ds, tmp_path / "local")


def test_site_config_file_resolves_relative_paths(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_CONFIG_ENV, raising=False)
    local = tmp_path / "local"
    local.mkdir()
    (local / "fedpartial_data.json").write_text(
        json.dumps(
            {"datasets": {"rsna_ich": {"data_root": "../data", "train": "m/train.csv", "test": "/abs/test.csv"}}}
        )
    )
    sd = resolve_site_data("hospital-1", resolve_dataset("rsna_ich"), local)
    assert sd.data_root == (tmp_path / "data").resolve() and sd.train == (local / "m/train.csv").resolve()
    assert sd.val is None and str(sd.test) == "/abs/test.csv"
    monkeypatch.setenv(SITE_CONFIG_ENV, str(tmp_path / "nope.json"))
    with pytest.raises(SiteDataError, match="hospital-1.*does not exist"):
        resolve_site_data("hospital-1", resolve_dataset("rsna_ich"), local)


@pytest.mark.parametrize("job", ["fedmlp_ich_paper", "fedmlp_cxr14_paper"])
def test_paper_configuration_has_the_papers_settings(job):
    """FedMLP Sec. 3.1.3: an encoder from ImageNet (the paper's ResNet-18; here the ImageNet start shipped,
    EfficientNet-Lite0), Adam lr 3e-5 with L2 regularisation, batch 32, one local epoch, 500 rounds, t1 = 50 warm-up
    rounds, L = 0.3, R = 0.7, T0 = 0.5 %, T1 = 1 %; 5 ICH / 8 CXR14 sites, one class each."""
    folder = REPO / "jobs" / job
    server = json.loads((folder / "app/config/config_fed_server.json").read_text())
    args = json.loads((folder / "app/config/config_fed_client.json").read_text())["executors"][0]["executor"]["args"]
    assert server["num_rounds"] == 500
    assert (args["model"]["arch"], args["model"]["pretrained"]) == ("efficientnet_lite0", "imagenet")
    model = next(c for c in server["components"] if c["id"] == "model")["args"]
    assert model["pretrained"] == "imagenet"  # the server builds the initial global model from ImageNet
    assert args["dataset"]["mean"] == ([0.449] if "cxr14" in job else [0.485, 0.456, 0.406])  # the start's
    t = args["train"]
    assert (t["optimizer"], t["lr"], t["batch_size"], t["local_epochs"]) == ("adam", 3e-5, 32, 1) and t[
        "weight_decay"
    ] > 0
    assert args["method_args"] == {
        "warmup_rounds": 50,
        "L": 0.3,
        "R": 0.7,
        "T0": 0.005,
        "T1": 0.01,
        "parity": "paper",
        "cr_warmup": False,
    }  # the paper: stage 1 is L_WPC only
    ds = resolve_dataset(args["dataset"])
    sites = 5 if "ich" in job else 8
    assert ds["image_size"] == 224 and ds["prepare"]["num_sites"] == sites == len(ds["classes"])
    assert ds["prepare"]["k"] == sites - 1 and server["min_clients"] == sites
    # meta.json: the sites that must stay connected (one may be missing)
    assert json.loads((folder / "meta.json").read_text())["min_clients"] == sites - server["max_missing_sites"]


def test_the_repository_stays_light_to_clone():
    """Tracked files under 8 MB in all; benchmark summaries without their runs, which travel compressed beside them
    (``X.runs.json.gz``, each under 400 KB)."""
    import shutil
    import subprocess

    from conftest import REPO

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    paths = [REPO / f for f in files.decode().split("\0") if f]
    total = sum(p.stat().st_size for p in paths if p.is_file())
    assert total < 8_000_000, f"tracked files take {total / 1e6:.1f} MB"
    heavy = [
        p.name
        for p in paths
        if p.suffix == ".json"
        and "benchmarks/results" in str(p)
        and p.is_file()
        and '"runs":' in p.read_text()[:200_000]
    ]
    assert not heavy, f"benchmark files that hold their runs (keep them in X.runs.json.gz): {heavy}"
    big_runs = [p.name for p in paths if p.name.endswith(".runs.json.gz") and p.stat().st_size > 400_000]
    assert not big_runs, f"runs files over 400 KB (run the table with --compact): {big_runs}"


def test_the_readme_stays_an_entry_point():
    """README.md is the front door (what the project is, the two commands, the demo, the layout, where to go next):
    at most 250 lines; measurements of the suite and the machines live in benchmarks/README.md, and every relative
    link of the README points at a file of the checkout."""
    import re

    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (REPO / target).exists(), target
