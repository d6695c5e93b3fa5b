"""fedpartial-predict / fedpartial-evaluate on a tiny model saved the way NVFlare's PTFileModelPersistor saves it,
in a simulator workspace layout and in a downloaded job-result layout."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from test_transforms import write_dicom

from conftest import REPO
from fedpartial.data.catalog.ich import CLASSES as ICH_CLASSES
from fedpartial.data.manifest import read_manifest, write_manifest
from fedpartial.data.presets import resolve_dataset
from fedpartial.data.sitedata import SiteDatasets
from fedpartial.evaluation import predict
from fedpartial.metrics import compute_metrics
from fedpartial.models import PartialLabelNet
from fedpartial.tools import predict as P

JOB_CONFIG = REPO / "jobs" / "fedavg_ich" / "app" / "config"


def _run_folder(app_server, image_size: int = 16, seed: int = 0):
    """An ``app_server`` folder: the job's configs (at ``image_size``) + last and best global models."""
    cfg = app_server / "config"
    cfg.mkdir(parents=True)
    shutil.copy(JOB_CONFIG / P.SERVER_CONFIG, cfg)
    client = json.loads((JOB_CONFIG / P.CLIENT_CONFIG).read_text())
    client["executors"][0]["executor"]["args"]["dataset"]["image_size"] = image_size
    (cfg / P.CLIENT_CONFIG).write_text(json.dumps(client))
    nets = {}
    for i, name in enumerate((P.LAST_MODEL, P.BEST_MODEL)):
        torch.manual_seed(seed + i)
        net = PartialLabelNet("small_cnn", num_classes=5, in_channels=3)
        torch.save(
            {"model": net.state_dict(), "train_conf": {"train": {"model": "PartialLabelNet"}}}, app_server / name
        )
        nets[name] = net.eval()
    return nets


@pytest.fixture
def images(tmp_path):
    """3 PNG (gray, RGB, 16-bit), a JPG and a CT DICOM under one folder (nested), and a labelled manifest."""
    d = tmp_path / "imgs"
    (d / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8)).save(d / "a.png")
    Image.fromarray(rng.integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(d / "b.png")
    Image.fromarray(rng.integers(0, 65535, (24, 24), dtype=np.uint16)).save(d / "sub" / "c.png")
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(d / "d.jpg")
    write_dicom(d / "sub" / "e.dcm", rng.integers(900, 1200, (48, 48)).astype(np.uint16))
    (d / "notes.txt").write_text("not an image")
    rel = ["a.png", "b.png", "sub/c.png", "d.jpg", "sub/e.dcm"]
    labels = np.array([[1, 0, 0, 0, 1], [0, 1, 0, 0, 0], [0, 0, 1, 0, 1], [0, 0, 0, 1, 0], [1, 1, 0, 0, 0]])
    mask = np.ones_like(labels, bool)
    mask[0, 2] = False  # partially labelled row
    write_manifest(d / "labelled.csv", rel, labels, mask, ICH_CLASSES, splits=["test"] * 4 + ["val"])
    return d, d / "labelled.csv"


@pytest.fixture
def sim_ws(tmp_path):
    ws = tmp_path / "sim_ws"
    nets = _run_folder(ws / "server" / "simulate_job" / "app_server")
    (ws / "site-1" / "simulate_job").mkdir(parents=True)  # site folders carry no global model
    return ws, nets


@pytest.fixture
def downloaded(tmp_path):
    dl = tmp_path / "results"
    nets = _run_folder(dl / "0f3c9a2e-job" / "workspace" / "app_server", seed=10)
    (dl / "0f3c9a2e-job" / "job" / "fedavg_ich" / "app").mkdir(parents=True)  # the submitted job, no model
    return dl, nets


def _expected(net, manifest_paths, image_size=16):
    """Probabilities computed independently from the job's dataset config as training's evaluation computes them:
    the images built into an image store (decoded once, resized, uint8), read back, normalised. fedpartial-predict
    and an exported bundle decode each file the same way without keeping a store, so they must agree."""
    import tempfile

    client = json.loads((JOB_CONFIG / P.CLIENT_CONFIG).read_text())
    ds = resolve_dataset({**client["executors"][0]["executor"]["args"]["dataset"], "image_size": image_size})
    m = read_manifest(manifest_paths, ds["classes"], task=ds["task"])
    with tempfile.TemporaryDirectory() as stores:
        sites = SiteDatasets({"x": m}, {**ds, "cache": "store", "cache_dir": stores})
        assert sites.uses_store and sites.store("x").folder.is_relative_to(stores)
        return predict(net, sites.eval_loader("x"), ds["task"])["probs"]


def test_finds_models_in_both_layouts(sim_ws, downloaded):
    ws, _ = sim_ws
    dl, _ = downloaded
    assert P.find_model(ws) == ws / "server/simulate_job/app_server" / P.BEST_MODEL
    assert P.find_model(ws, "last") == ws / "server/simulate_job/app_server" / P.LAST_MODEL
    assert P.find_model(dl) == dl / "0f3c9a2e-job/workspace/app_server" / P.BEST_MODEL
    model_file = dl / "0f3c9a2e-job/workspace/app_server" / P.LAST_MODEL
    assert P.find_model(model_file) == model_file
    loaded = P.load_model(model_file)  # a bare model file finds the configs next to it
    assert loaded.classes == ICH_CLASSES and loaded.dataset["image_size"] == 16


@pytest.mark.parametrize("layout", ["sim_ws", "downloaded"])
def test_predict_folder_writes_probabilities(layout, images, tmp_path, request):
    run, nets = request.getfixturevalue(layout)
    folder, labelled = images
    out = tmp_path / "pred.csv"
    assert P.main([str(run), "--images", str(folder), "-o", str(out)]) == 0
    df = pd.read_csv(out)
    assert list(df.columns) == ["image"] + [f"prob_{c}" for c in ICH_CLASSES]
    assert [p.split("imgs/")[1] for p in df["image"]] == ["a.png", "b.png", "d.jpg", "sub/c.png", "sub/e.dcm"]
    # the best model, through the training evaluation pipeline at the job's image size
    expected = _expected(nets[P.BEST_MODEL], labelled)
    order = [0, 1, 3, 2, 4]  # manifest rows a, b, c, d, e -> sorted folder order a, b, d, c, e
    np.testing.assert_allclose(df.filter(like="prob_").to_numpy(), expected[order], atol=1e-5)

    assert P.main([str(run), "--images", str(folder), "-o", str(out), "--model", "last"]) == 0
    last = pd.read_csv(out).filter(like="prob_").to_numpy()
    np.testing.assert_allclose(last, _expected(nets[P.LAST_MODEL], labelled)[order], atol=1e-5)


def test_predict_uses_the_runs_image_pipeline(tmp_path, images):
    folder, labelled = images
    _run_folder(tmp_path / "r16" / "app_server", image_size=16)
    _run_folder(tmp_path / "r32" / "app_server", image_size=32)
    p16 = P.predict_manifest(P.load_model(tmp_path / "r16"), P.image_manifest(folder, ICH_CLASSES))
    p32 = P.predict_manifest(P.load_model(tmp_path / "r32"), P.image_manifest(folder, ICH_CLASSES))
    assert not np.allclose(p16.filter(like="prob_"), p32.filter(like="prob_"))  # same weights, other resize


def test_predict_manifest_split_and_data_root(sim_ws, images, tmp_path):
    ws, nets = sim_ws
    folder, labelled = images
    moved = tmp_path / "elsewhere.csv"
    shutil.copy(labelled, moved)
    (tmp_path / "elsewhere").mkdir()
    out = tmp_path / "p.csv"
    assert (
        P.main([str(ws), "--manifest", str(moved), "--data-root", str(folder), "--split", "test", "-o", str(out)]) == 0
    )
    df = pd.read_csv(out)
    assert len(df) == 4 and df["image"].iloc[0].endswith("imgs/a.png")


def test_evaluate_scores_with_project_metrics(sim_ws, images, tmp_path, capsys):
    ws, nets = sim_ws
    folder, labelled = images
    out = tmp_path / "scores.json"
    assert P.evaluate_main([str(ws), "--manifest", str(labelled), "--data-root", str(folder), "--json", str(out)]) == 0
    assert "best_FL_global_model.pt on" in capsys.readouterr().out
    res = json.loads(out.read_text())
    m = read_manifest(labelled, ICH_CLASSES, data_root=folder)
    want = compute_metrics("multilabel", m.labels, _expected(nets[P.BEST_MODEL], labelled), ICH_CLASSES, mask=m.mask)
    assert res["n"] == 5
    for c in ICH_CLASSES:
        a, b = res["per_class"][c]["auc"], want["per_class"][c]["auc"]
        assert (a is None and b is None) or a == pytest.approx(b)


def test_clear_errors(tmp_path, sim_ws, images, capsys):
    ws, _ = sim_ws
    folder, labelled = images
    with pytest.raises(FileNotFoundError, match="no best_FL_global_model.pt or FL_global_model.pt"):
        P.load_model(tmp_path / "imgs")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert P.main([str(ws), "--images", str(empty), "-o", str(tmp_path / "x.csv")]) == 2
    assert "fedpartial-predict: error: no image (.png, .jpg" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("image,epidural\na.png,maybe\n")
    assert P.main([str(ws), "--manifest", str(bad), "--data-root", str(folder), "-o", str(tmp_path / "x.csv")]) == 2
    assert re.search(r"error: file '.*bad.csv', line 2: .*'maybe'", capsys.readouterr().err)
    assert P.evaluate_main([str(ws), "--manifest", str(labelled), "--data-root", str(tmp_path)]) == 2
    assert re.search(r"labelled.csv', line 2: image not found", capsys.readouterr().err)
    assert P.main([str(ws), "--images", str(folder), "--site", "site-1", "-o", str(tmp_path / "x.csv")]) == 2
    assert "--site site-1: method 'fedavg' keeps no layers local" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
    lone = tmp_path / "lone" / P.LAST_MODEL
    lone.parent.mkdir()
    shutil.copy(ws / "server/simulate_job/app_server" / P.LAST_MODEL, lone)
    with pytest.raises(FileNotFoundError, match="--job-config"):
        P.load_model(lone)
    assert P.load_model(lone, config_dir=ws / "server/simulate_job/app_server/config").path == lone


# ------------------------------------------------------------------ damaged model files, two runs, outputs


def _flip_tensor_byte(model_file):
    """One byte flipped in the middle of the largest tensor inside the torch.save archive (its pickle untouched:
    torch loads the file without a complaint)."""
    import zipfile

    with zipfile.ZipFile(model_file) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(model_file.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.file_size // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    torch.load(model_file, weights_only=True)  # the fault: torch's loader does not see it


def _no_image_read(monkeypatch):
    """Every image read recorded (the decoder and the header check, where predict and the bundle call them)."""
    from fedpartial.data import store
    from fedpartial.tools import bundle_runtime

    reads = []
    for module in (store, bundle_runtime):
        for name in ("decode_resized", "open_image", "native_channels"):
            real = getattr(module, name, None)
            if real is not None:
                monkeypatch.setattr(module, name, lambda *a, _r=real, **k: reads.append(a[0]) or _r(*a, **k))
    return reads


def test_a_flipped_byte_in_the_model_is_one_line_before_any_image_is_read(
    sim_ws, images, tmp_path, capsys, monkeypatch
):
    from fedpartial.tools import export as E

    ws, _ = sim_ws
    folder, labelled = images
    model = ws / "server/simulate_job/app_server" / P.BEST_MODEL
    _flip_tensor_byte(model)
    reads = _no_image_read(monkeypatch)
    out = tmp_path / "p.csv"
    runs = [
        (P.main, [str(ws), "--images", str(folder), "-o", str(out)], "fedpartial-predict"),
        (P.evaluate_main, [str(ws), "--manifest", str(labelled), "--no-figures"], "fedpartial-evaluate"),
        (E.main, [str(ws), "-o", str(tmp_path / "bundle")], "fedpartial-export"),
    ]
    for main, argv, prog in runs:
        assert main(argv) == 2, prog
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"{prog}: error: model file {model} is damaged"), err
        assert "checksum" in err[0]
    assert reads == [] and not out.exists() and not (tmp_path / "bundle").exists()
    # the last model of the same run is intact: taken when asked for
    assert P.main([str(ws), "--images", str(folder), "-o", str(out), "--model", "last"]) == 0
    assert len(reads) >= 5  # the recorder sees reads where there are some


def test_a_folder_holding_two_runs_is_refused_naming_them(tmp_path, images, capsys):
    from fedpartial.tools import export as E

    folder, _ = images
    both = tmp_path / "runs"
    _run_folder(both / "job_a" / "app_server", seed=0)
    _run_folder(both / "job_b" / "app_server", seed=5)
    out = tmp_path / "p.csv"
    assert P.main([str(both), "--images", str(folder), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{both} holds 2 runs" in err[0], err
    assert "job_a/app_server" in err[0] and "job_b/app_server" in err[0] and "pass one of them as RUN" in err[0]
    assert not out.exists()
    assert E.main([str(both), "-o", str(tmp_path / "bundle")]) == 2
    assert "holds 2 runs" in capsys.readouterr().err
    assert P.main([str(both / "job_b"), "--images", str(folder), "-o", str(out)]) == 0  # one chosen
    with pytest.raises(ValueError, match="holds 2 runs"):
        P.find_model(both, "last")


@pytest.mark.parametrize(
    "target", ["model", "model_symlink", "model_dot", "other_model", "image", "manifest", "config"]
)
def test_predict_never_writes_over_an_input(sim_ws, images, tmp_path, monkeypatch, capsys, target):
    ws, _ = sim_ws
    folder, labelled = images
    app = ws / "server/simulate_job/app_server"
    monkeypatch.chdir(app)
    out = {
        "model": app / P.BEST_MODEL,
        "model_symlink": tmp_path / "link.pt",
        "model_dot": f"./{P.BEST_MODEL}",
        "other_model": app / P.LAST_MODEL,  # the run's other model file: not read, still the run's
        "image": folder / "sub" / "c.png",
        "manifest": labelled,
        "config": app / "config" / P.CLIENT_CONFIG,
    }[target]
    if target == "model_symlink":
        out.symlink_to(app / P.BEST_MODEL)
    victim = (app / P.BEST_MODEL) if target.startswith("model") else Path(out)
    before = victim.read_bytes()
    source = (
        ["--manifest", str(labelled), "--data-root", str(folder)] if target == "manifest" else ["--images", str(folder)]
    )
    assert P.main([str(ws), *source, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fedpartial-predict: error: -o {out} is "), err
    assert "Traceback" not in "\n".join(err) and victim.read_bytes() == before


def test_evaluate_never_writes_its_json_over_the_manifest(sim_ws, images, capsys):
    ws, _ = sim_ws
    folder, labelled = images
    before = labelled.read_bytes()
    assert P.evaluate_main([str(ws), "--manifest", str(labelled), "--json", str(labelled), "--no-figures"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fedpartial-evaluate: error: --json {labelled} is the manifest"), err
    assert labelled.read_bytes() == before


def test_predict_leaves_out_an_unreadable_image_as_the_bundle_does(sim_ws, images, tmp_path, capsys):
    """An image that cannot be decoded: a line naming it, its row with empty cells and the reason in a last
    ``error`` column (the reason the bundle's decoder gives for the same file); the others are predicted as
    without it. Exit status 2 only when no image could be read."""
    from fedpartial.tools.bundle_runtime import LoadImageAnyd

    ws, _ = sim_ws
    folder, _ = images
    broken = folder / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 40)
    out = tmp_path / "p.csv"
    assert P.main([str(ws), "--images", str(folder), "-o", str(out), "--thresholds", "0.5"]) == 0
    err = capsys.readouterr().err
    assert f"left out {broken}: cannot read it (" in err
    df = pd.read_csv(out, keep_default_na=False)
    assert list(df.columns)[-1] == "error" and len(df) == 6
    bad = df[df["image"] == str(broken)]
    model = P.load_model(ws)
    pre = model.dataset
    theirs = LoadImageAnyd("image", pre["channels"], pre["image_size"], pre.get("ct_windows"))({"image": str(broken)})
    assert bad["error"].item() == theirs["error"] != ""
    assert (bad.drop(columns=["image", "error"]) == "").all().all()
    good = df[df["image"] != str(broken)]
    assert (good["error"] == "").all()
    os_paths = [p for p in good["image"]]
    expected = P.predict_manifest(model, P.image_manifest(folder, model.classes)).set_index("image")
    np.testing.assert_allclose(
        good.set_index("image").filter(like="prob_").astype(float).to_numpy(),
        expected.loc[os_paths].filter(like="prob_").to_numpy(),
        atol=1e-6,
    )
    only = tmp_path / "only_broken"
    only.mkdir()
    shutil.copy(broken, only / "x.png")
    assert P.main([str(ws), "--images", str(only), "-o", str(tmp_path / "q.csv")]) == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == "fedpartial-predict: error: none of the 1 images could be read"
    )
