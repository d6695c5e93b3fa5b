"""Each new source trains one round through an existing job, prepared on first use from its published layout
(tiny copies built from the shared real images); a truncated image stops the job at the data check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from published_layouts import HAM, NIH, chexpert_release, isic2019_release, mimic_release, nih_release

from conftest import copy_job, results_of, run_simulator, server_log
from fedpartial.data.presets import PRESETS

pytestmark = [pytest.mark.integration, pytest.mark.realdata]


@pytest.fixture(autouse=True)
def _shared_data():
    for folder in (NIH, HAM):
        if not folder.is_dir():
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{folder} is absent but CI=true: the real-data tests must run in CI")
            pytest.skip(f"real data {folder} not available on this machine")


def _job(tmp_path: Path, base: str, dataset: dict) -> Path:
    """``jobs/<base>`` for one round with its dataset (and the server's class list) replaced."""
    job = copy_job(base, tmp_path / "job", num_rounds=1, executor_args={"evaluation": {"test_every": 1}})
    client = job / "app/config/config_fed_client.json"
    cfg = json.loads(client.read_text())
    cfg["executors"][0]["executor"]["args"]["dataset"] = dataset
    client.write_text(json.dumps(cfg, indent=1))
    server = job / "app/config/config_fed_server.json"
    cfg = json.loads(server.read_text())
    comps = {c["id"]: c for c in cfg["components"]}
    comps["model"]["args"]["num_classes"] = len(dataset["classes"])
    comps["data_summary"]["args"]["classes"] = dataset["classes"]
    server.write_text(json.dumps(cfg, indent=1))
    return job


def _run(tmp_path: Path, job: Path, n: int) -> tuple[dict | None, str]:
    ws = tmp_path / "ws"
    proc = run_simulator(job, ws, n=n, env={"FEDPARTIAL_CACHE": str(tmp_path / "cache")}, timeout=600)
    log = server_log(ws) + proc.stdout + proc.stderr
    path = ws / "server/simulate_job/results.json"
    return (results_of(ws) if path.is_file() else None), log


def _trained(results: dict | None, log: str, n: int) -> None:
    assert results is not None, log[-3000:]
    assert results["num_rounds"] == 1 and len(results["data"]["sites"]) == n, log[-3000:]
    assert results["rounds"][-1]["val"] is not None


def test_nih_and_chexpert_sites_train_one_round_each_in_its_own_vocabulary(tmp_path):
    nih = nih_release(tmp_path / "data" / "nih")
    chex = chexpert_release(tmp_path / "data")
    classes = ["Atelectasis", "Cardiomegaly", "Effusion", "Edema", "Consolidation", "Lung Opacity"]
    dataset = {
        "name": "nih_chexpert",
        "task": "multilabel",
        "classes": classes,
        "channels": 1,
        "image_size": 32,
        "ct_windows": None,
        "mean": None,
        "std": None,
        "prepare": {
            "sources": [
                {"source": "nih_cxr14", "root": str(nih), "num_sites": 1},
                {
                    "source": "chexpert",
                    "root": str(chex),
                    "num_sites": 1,
                    "source_args": {"view": "frontal", "uncertain": "ignore"},
                },
            ],
            "classes": classes,
            "protocol": "full",
            "seed": 0,
            "val_frac": 0.2,
            "test_frac": 0.2,
        },
    }
    results, log = _run(tmp_path, _job(tmp_path, "fedavg_cxr14", dataset), n=2)
    _trained(results, log, 2)
    sites = results["data"]["sites"]
    assert classes.index("Lung Opacity") not in sites["site-1"]["annotated"]  # NIH has no Lung Opacity
    assert classes.index("Lung Opacity") in sites["site-2"]["annotated"]
    assert classes.index("Effusion") in sites["site-2"]["annotated"]  # CheXpert's Pleural Effusion, mapped
    # the server's results component still says the job's nih_cxr14; results name the data actually used
    assert results["dataset"] == "nih_cxr14+chexpert" and results["job_dataset"] == "nih_cxr14"


def test_mimic_cxr_trains_one_round(tmp_path):
    root = mimic_release(tmp_path / "mimic")
    dataset = json.loads(json.dumps(PRESETS["mimic_cxr"]))
    dataset.update(image_size=32)
    dataset["prepare"].update(root=str(root), num_sites=2, source_args={"official_split": True, "view": "all"})
    results, log = _run(tmp_path, _job(tmp_path, "fedavg_cxr14", dataset), n=2)
    _trained(results, log, 2)
    assert results["dataset"] == "mimic_cxr"


def test_isic2019_centres_train_one_round(tmp_path):
    root = isic2019_release(tmp_path / "isic2019", per_centre=8, centres=["BCN", "MSK"])
    dataset = json.loads(json.dumps(PRESETS["isic2019"]))
    dataset.update(image_size=32)
    dataset["prepare"].update(root=str(root), val_frac=0.2, test_frac=0.2)  # two centres: two sites
    results, log = _run(tmp_path, _job(tmp_path, "fedavg_ham10000", dataset), n=2)
    _trained(results, log, 2)
    assert results["dataset"] == "isic2019"


def test_truncated_image_stops_every_site_at_the_data_check(tmp_path):
    """The data check decodes every image: a truncated JPEG stops the job before round 0, so no site writes
    round state while another site's data are unreadable."""
    root = nih_release(tmp_path / "nih", n=24)
    import pandas as pd
    from PIL import Image

    jpg = tmp_path / "site" / "img"
    jpg.mkdir(parents=True)
    names = pd.read_csv(NIH / "labels.csv").iloc[:6]["Image Index"]
    for n in names:
        Image.open(NIH / "images" / n).convert("L").save(jpg / n.replace(".png", ".jpg"), "JPEG")
    bad = jpg / names.iloc[3].replace(".png", ".jpg")
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    classes = PRESETS["nih_cxr14"]["classes"]
    rows = [
        f"img/{n.replace('.png', '.jpg')}," + ",".join("1" if j == i % 8 else "0" for j in range(8))
        for i, n in enumerate(names)
    ]
    (tmp_path / "site" / "train.csv").write_text("image," + ",".join(classes) + "\n" + "\n".join(rows) + "\n")
    cfg = tmp_path / "site" / "fedpartial_data.json"
    cfg.write_text(json.dumps({"datasets": {"nih_cxr14": {"data_root": ".", "train": "train.csv"}}}))
    job = copy_job("fedavg_cxr14", tmp_path / "job", num_rounds=1, executor_args={"dataset": {"image_size": 32}})
    ws = tmp_path / "ws"
    proc = run_simulator(
        job, ws, n=2, env={"FEDPARTIAL_SITE_CONFIG": str(cfg), "FEDPARTIAL_CACHE": str(tmp_path / "cache")}, timeout=300
    )
    log = server_log(ws) + proc.stdout + proc.stderr
    assert "data check failed" in log and "line 5" in log and bad.name in log and "truncated" in log
    assert "cannot be decoded" in log  # the full decode, not the header check, found it
    assert "aggregated" not in log
    assert not list(ws.glob("site-*/simulate_job/**/*round*")), "a site wrote round state"
    del root
