"""fedpartial-export: a MONAI bundle of a run's global model. The bundle's inference (``python -m monai.bundle
run``) runs in a process where ``import fedpartial`` fails and gives ``fedpartial-predict``'s probabilities;
its preprocessing equals training's evaluation pipeline tensor for tensor; the metadata carries MONAI's keys, the
thresholds and the provenance; the model card its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from test_predict import _run_folder
from test_transforms import write_dicom

from conftest import HAM_WITHOUT_TABLE, check_two_rounds, real_data, results_of, run_recipe, server_log
from fedpartial.data.catalog.ham10000 import CLASSES as ISIC_CLASSES
from fedpartial.data.catalog.ich import CLASSES as ICH_CLASSES
from fedpartial.data.sitedata import SiteDatasets
from fedpartial.tools import export as E
from fedpartial.tools import predict as P

# A process where ``import fedpartial`` fails (a meta-path finder refuses it, also through the editable install),
# which says so and then runs MONAI's bundle command line with the given arguments.
BLOCKED_RUNNER = """
import importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fedpartial" or name.startswith("fedpartial."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
try:
    import fedpartial
except ModuleNotFoundError as e:
    print(f"import fedpartial: {type(e).__name__}", flush=True)
else:
    raise SystemExit("fedpartial is importable")
sys.argv = ["monai.bundle", *sys.argv[1:]]
runpy.run_module("monai.bundle", run_name="__main__", alter_sys=True)
"""


def run_bundle(bundle: Path, images: Path, out: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m monai.bundle run --config_file B/configs/inference.json --dataset_dir D --output_dir O`` in an
    isolated interpreter (``-I``: no PYTHONPATH, no user site) where ``import fedpartial`` fails."""
    cmd = [
        sys.executable,
        "-I",
        "-c",
        BLOCKED_RUNNER,
        "run",
        "--config_file",
        str(bundle / "configs" / "inference.json"),
        "--dataset_dir",
        str(images),
        "--output_dir",
        str(out),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(cwd))


def write_images(folder: Path) -> Path:
    """PNG (8-bit gray, RGB, RGBA, 16-bit), JPG and a CT DICOM, nested; a text file that is no image."""
    (folder / "sub").mkdir(parents=True)
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8)).save(folder / "a.png")
    Image.fromarray(rng.integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(folder / "b.png")
    Image.fromarray(rng.integers(0, 255, (36, 36, 4), dtype=np.uint8), "RGBA").save(folder / "c.png")
    Image.fromarray(rng.integers(0, 65535, (24, 24), dtype=np.uint16)).save(folder / "sub" / "d.png")
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / "e.jpg")
    ct = rng.normal(40, 120, (48, 48)) + 1024  # stored values; intercept -1024: brain-window HU and beyond
    write_dicom(folder / "sub" / "f.dcm", np.clip(ct, 0, 4000).astype(np.uint16))
    (folder / "notes.txt").write_text("not an image")
    return folder


def relative(paths, root: Path) -> list[str]:
    return [str(Path(p).resolve().relative_to(root.resolve())) for p in paths]


# ------------------------------------------------------------------------------- unit: no training needed


@pytest.fixture
def random_run(tmp_path):
    """A run folder with the fedavg_ich job's configuration (16 px, CT windows) and two random global models."""
    nets = _run_folder(tmp_path / "run" / "app_server", image_size=16)
    return tmp_path / "run", nets


def test_bundle_preprocessing_equals_the_predict_pipeline(random_run, tmp_path):
    """The bundle's preprocessing (parsed from its inference.json by MONAI) gives the tensors of the pipeline
    ``fedpartial-predict`` runs (training's evaluation transforms, each file decoded on access) for every image
    kind, and the TorchScript model the model's logits on them."""
    from monai.bundle import ConfigParser, ConfigWorkflow

    run, nets = random_run
    bundle = E.export_bundle(run, tmp_path / "bundle")
    images = write_images(tmp_path / "imgs")
    sys.path.insert(0, str(bundle))  # MONAI's run does the same (the bundle root on sys.path)
    try:
        parser = ConfigParser()
        parser.read_config(bundle / "configs" / "inference.json")
        parser["dataset_dir"] = str(images)
        datalist = parser.get_parsed_content("datalist")
        pre = parser.get_parsed_content("preprocessing")
        ts = parser.get_parsed_content("network")
        # an inference workflow in MONAI's sense (what MONAI Label / Deploy look up): its required properties
        workflow = ConfigWorkflow(
            config_file=str(bundle / "configs" / "inference.json"),
            workflow_type="infer",
            logging_file=False,
            dataset_dir=str(images),
        )
        workflow.initialize()
        assert workflow.check_properties() in (None, [])
    finally:
        sys.path.remove(str(bundle))
        for name in [m for m in sys.modules if m == "scripts" or m.startswith("scripts.")]:
            del sys.modules[name]
    model = P.load_model(run)
    manifest = P.image_manifest(images, model.classes, model.task)
    assert datalist == manifest.paths and len(datalist) == 6  # the same files in the same order
    train = SiteDatasets({"x": manifest}, {**model.dataset, "cache": "none"}).dataset("x", {"image": "eval"})
    for i, path in enumerate(datalist):
        ours = pre({"image": path})["image"]
        theirs = train[i]["image"]
        assert ours.shape == theirs.shape == (3, 16, 16)
        torch.testing.assert_close(torch.as_tensor(ours), theirs, atol=1e-6, rtol=0)
        with torch.no_grad():
            torch.testing.assert_close(ts(theirs[None]), nets[P.BEST_MODEL](theirs[None]), atol=1e-5, rtol=0)


def test_metadata_has_monai_keys_thresholds_and_the_pipeline(random_run, tmp_path):
    from monai.bundle.properties import MetaProperties

    run, _ = random_run
    thresholds = {
        "models": {
            P.BEST_MODEL: {
                "criterion": "youden",
                "thresholds": dict(zip(ICH_CLASSES, [0.3, None, 0.7, 0.5, 0.9])),
                "n_val": dict.fromkeys(ICH_CLASSES, 10),
            }
        }
    }
    (run / "app_server" / "thresholds.json").write_text(json.dumps(thresholds))
    bundle = E.export_bundle(run, tmp_path / "b")
    for f in E.BUNDLE_FILES:
        assert (bundle / f).is_file(), f
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    required = [p for p, spec in MetaProperties.items() if spec.get("required")]
    assert required and all(k in meta for k in required), [k for k in required if k not in meta]
    for key in (
        "version",
        "monai_version",
        "pytorch_version",
        "numpy_version",
        "optional_packages_version",
        "task",
        "description",
        "authors",
        "copyright",
        "network_data_format",
    ):  # the specification's list
        assert key in meta
    spec_keys = {
        "type",
        "format",
        "modality",
        "num_channels",
        "spatial_shape",
        "dtype",
        "value_range",
        "is_patch_data",
        "channel_def",
    }
    image, pred = meta["network_data_format"]["inputs"]["image"], meta["network_data_format"]["outputs"]["pred"]
    assert spec_keys <= set(image) and spec_keys <= set(pred)
    assert image["num_channels"] == 3 and image["spatial_shape"] == [16, 16] and image["modality"] == "CT"
    assert list(pred["channel_def"].values()) == ICH_CLASSES
    assert meta["thresholds"]["values"] == [0.3, 0.5, 0.7, 0.5, 0.9]  # 0.5 where none was chosen
    assert meta["preprocessing"]["ct_windows"] == [[40.0, 80.0], [80.0, 200.0], [600.0, 2800.0]]
    infer = json.loads((bundle / "configs" / "inference.json").read_text())
    assert infer["thresholds"] == meta["thresholds"]["values"] and infer["classes"] == ICH_CLASSES
    # the bundle's runtime imports nothing of this package; the state dict loads into the architecture
    code = (bundle / "scripts" / "image_io.py").read_text()
    imports = [line.split()[1] for line in code.splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert imports and not any(m.split(".")[0] == "fedpartial" for m in imports) and "def decode_resized" in code
    state = torch.load(bundle / "models" / "model.pt", weights_only=True)
    assert set(state) == set(P.load_model(run).net.state_dict())
    assert "# fedavg_ich" in (bundle / "docs" / "README.md").read_text()


def test_the_bundle_decoder_is_the_decode_module_copied_whole(random_run, tmp_path):
    """The bundle's scripts/image_io.py starts with fedpartial/data/decode.py byte for byte (training's decoding,
    standalone), and that module, imported from the bundle folder by its path, gives the store's pixels."""
    import importlib.util

    from fedpartial.data import decode
    from fedpartial.data.store import Preprocessing, decode_resized

    run, _ = random_run
    bundle = E.export_bundle(run, tmp_path / "bundle")
    source = Path(decode.__file__).read_text()
    assert "import fedpartial" not in source and "from fedpartial" not in source and "from ." not in source
    code = (bundle / "scripts" / "image_io.py").read_text()
    assert code.startswith(source) and code == E.runtime_source() and E.decoder_source() == source
    images = write_images(tmp_path / "imgs")
    spec = importlib.util.spec_from_file_location("bundle_image_io", bundle / "scripts" / "image_io.py")
    module = sys.modules["bundle_image_io"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["bundle_image_io"]
    assert module.decode_resized is not decode_resized and module.decode_resized.__module__ == "bundle_image_io"
    paths = sorted(p for p in images.rglob("*") if p.is_file() and p.suffix != ".txt")
    assert len(paths) == 6
    windows = ((40.0, 80.0), (80.0, 200.0), (600.0, 2800.0))
    for path in paths:
        for channels in (1, 3):
            ours = Preprocessing(16, channels, windows, "area")
            theirs = module.Preprocessing(16, channels, windows, "area")
            c = module.stored_channels(module.native_channels(str(path), theirs), theirs)
            np.testing.assert_array_equal(module.decode_resized(path, theirs, c), decode_resized(path, ours, c))


def test_decisions_columns():
    from fedpartial.tools.bundle_runtime import decisions

    probs = np.array([[0.2, 0.8, 0.5], [0.6, 0.1, 0.3]])
    cols, rows = decisions(probs, ["a", "b", "c"], "multilabel", [0.5, 0.9, 0.5])
    assert cols == ["pred_a", "pred_b", "pred_c"] and rows == [[0, 0, 1], [1, 0, 0]]
    cols, rows = decisions(probs, ["a", "b", "c"], "multiclass", None)
    assert cols == ["prediction"] and rows == [["b"], ["a"]]


def test_export_errors_and_onnx(random_run, tmp_path, capsys):
    run, nets = random_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert E.main([str(run), "-o", str(tmp_path / "full")]) == 2
    assert "exists and is not empty (pass --force" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert E.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "b")]) == 2
    assert "fedpartial-export: error:" in capsys.readouterr().err
    try:
        import onnx  # noqa: F401
    except ImportError:
        assert E.main([str(run), "-o", str(tmp_path / "b2"), "--onnx"]) == 2
        assert "--onnx needs the onnx package" in capsys.readouterr().err
    else:  # the ONNX model computes the model's logits (onnx's reference evaluator), batch size free
        from onnx.reference import ReferenceEvaluator

        assert E.main([str(run), "-o", str(tmp_path / "b2"), "--onnx"]) == 0
        x = torch.rand(3, 3, 16, 16)
        out = ReferenceEvaluator(str(tmp_path / "b2" / "models" / "model.onnx")).run(None, {"image": x.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(out, nets[P.BEST_MODEL](x).numpy(), atol=1e-5)


def test_force_replaces_only_the_files_the_export_wrote(random_run, tmp_path, capsys):
    """The bundle lists its own files (``.fedpartial-export.json``: relative paths and sha256); ``--force``
    replaces those and keeps everything else (a user's notes in ``models/``, a page in ``docs/``, the inference's
    ``eval/`` predictions), saying what it kept; a file of the bundle that was edited since is refused."""
    run, _ = random_run
    bundle = tmp_path / "bundle"
    assert E.main([str(run), "-o", str(bundle)]) == 0
    listed = json.loads((bundle / E.BUNDLE_MANIFEST).read_text())["files"]
    assert set(E.BUNDLE_FILES) <= set(listed) and all(len(h) == 64 for h in listed.values())
    assert sorted(listed) == sorted(
        str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file() and p.name != E.BUNDLE_MANIFEST
    )
    mine = {"models/notes.txt": "which run this was", "docs/mine.md": "# our review", "eval/predictions.csv": "x\n"}
    for rel, text in mine.items():
        (bundle / rel).parent.mkdir(exist_ok=True)
        (bundle / rel).write_text(text)
    (bundle / "scripts" / "__pycache__").mkdir()  # what running the bundle leaves: the tool's own
    (bundle / "scripts" / "__pycache__" / "image_io.cpython-311.pyc").write_bytes(b"stale")
    old_model = (bundle / "models" / "model.pt").stat().st_ino
    capsys.readouterr()
    assert E.main([str(run), "-o", str(bundle), "--force"]) == 0
    err = capsys.readouterr().err
    assert "kept 3 file(s) that are not the bundle's: docs/mine.md, eval/predictions.csv, models/notes.txt" in err
    assert {rel: (bundle / rel).read_text() for rel in mine} == mine
    assert (bundle / "models" / "model.pt").stat().st_ino != old_model
    assert not (bundle / "scripts" / "__pycache__").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")]
    # a file of the bundle edited since the export: refused, nothing changed
    card = bundle / "docs" / "README.md"
    card.write_text(card.read_text() + "\nreviewed by the radiology board\n")
    before = {str(p): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    assert E.main([str(run), "-o", str(bundle), "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fedpartial-export: error: -o {bundle}: docs/README.md changed since the export"), err
    assert {str(p): p.read_bytes() for p in bundle.rglob("*") if p.is_file()} == before
    # a bundle written before the file list: its files by name, the rest kept
    card.unlink()
    (bundle / E.BUNDLE_MANIFEST).unlink()
    assert E.main([str(run), "-o", str(bundle), "--force"]) == 0
    assert "kept 3 file(s)" in capsys.readouterr().err
    assert {rel: (bundle / rel).read_text() for rel in mine} == mine and card.is_file()


# ------------------------------------------------------------------- integration: a trained run, MONAI's run

TINY = {
    "ich": {
        "dataset": {
            "preset": "ich_phantom",
            "image_size": 32,
            "prepare": {"num_sites": 2, "k": 2, "source_args": {"n_images": 240, "size": 64, "seed": 0}},
        },
        "warmup_rounds": 1,
    },
    "ham10000": {
        "dataset": {
            "preset": "ham10000",
            "image_size": 32,
            "prepare": {
                "val_frac": 0.03,
                "test_frac": 0.05,
                "site_sizes": 60,
                "num_sites": 2,  # of its table's 5
                **HAM_WITHOUT_TABLE,
            },
        }
    },
}
FAST = {"num_rounds": 2, "evaluation": {"test_every": 1}, "train": {"batch_size": 16}}


def _trained(job: str, kind: str, root: Path, cache: Path) -> Path:
    """``python jobs/<job>/job.py --rounds 2``'s recipe (SimEnv) on tiny data; returns the workspace."""
    proc = run_recipe(job, root, {**FAST, **TINY[kind]}, sites=2, env={"FEDPARTIAL_CACHE": str(cache)})
    ws = root / job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    return ws


@pytest.fixture(scope="module")
def ich_ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_ich")
    return _trained("fedmlp_ich", "ich", root, root / "cache")


@pytest.fixture(scope="module")
def ham_ws(tmp_path_factory):
    real_data("ham10000")
    root = tmp_path_factory.mktemp("export_ham")
    ws = _trained("fedavg_ham10000", "ham10000", root, root / "cache")
    # run as its README says, from the checkout without FEDPARTIAL_DATA_DIR: the relative root ../shared/data/...
    # resolved against the checkout (what test_recipes.py checks for the ChestX-ray14 job)
    assert all(i["n_train"] > 0 for i in results_of(ws)["data"]["sites"].values())
    return ws


def _bundle_matches_predict(ws: Path, tmp_path: Path, multilabel: bool) -> tuple[dict, pd.DataFrame]:
    assert E.main([str(ws), "-o", str(tmp_path / "B")]) == 0
    bundle = tmp_path / "B"
    images = write_images(tmp_path / "images")
    run = tmp_path / "elsewhere"
    run.mkdir()
    proc = run_bundle(bundle, images, tmp_path / "O", cwd=run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "import fedpartial: ModuleNotFoundError" in proc.stdout  # the bundle ran without the package
    ours = pd.read_csv(tmp_path / "O" / "predictions.csv")
    args = [str(ws), "--images", str(images), "-o", str(tmp_path / "p.csv")]
    assert P.main(args + (["--thresholds", "validation"] if multilabel else [])) == 0
    theirs = pd.read_csv(tmp_path / "p.csv")
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    classes = list(meta["network_data_format"]["outputs"]["pred"]["channel_def"].values())
    probs = [f"prob_{c}" for c in classes]
    assert list(ours.columns[: 1 + len(classes)]) == list(theirs.columns[: 1 + len(classes)]) == ["image", *probs]
    assert relative(ours["image"], images) == relative(theirs["image"], images)
    assert any(p.endswith(".dcm") for p in ours["image"]) and any(p.endswith(".png") for p in ours["image"])
    np.testing.assert_allclose(ours[probs].to_numpy(), theirs[probs].to_numpy(), atol=1e-5, rtol=0)
    return meta, ours


@pytest.mark.integration
def test_multilabel_bundle_runs_without_the_package_and_equals_predict(ich_ws, tmp_path):
    meta, ours = _bundle_matches_predict(ich_ws, tmp_path, multilabel=True)
    theirs = pd.read_csv(tmp_path / "p.csv")
    preds = [f"pred_{c}" for c in ICH_CLASSES]
    assert list(ours.columns) == list(theirs.columns)  # predict --thresholds validation: the same decisions
    assert (ours[preds].to_numpy() == theirs[preds].to_numpy()).all()
    thr = json.loads(next(ich_ws.rglob("thresholds.json")).read_text())["models"][P.BEST_MODEL]["thresholds"]
    assert meta["thresholds"]["values"] == [0.5 if thr[c] is None else thr[c] for c in ICH_CLASSES]
    res = json.loads(next(ich_ws.rglob("results.json")).read_text())
    train = meta["training"]
    assert train["job"] == "fedmlp_ich" and train["method"] == "fedmlp" and train["rounds"] == 2
    assert train["model_file"] == P.BEST_MODEL and train["data_fingerprint"].startswith("sha256:")
    assert {s: i["annotated_classes"] for s, i in train["sites"].items()} == {
        s: [ICH_CLASSES[k] for k in i["annotated"]] for s, i in res["data"]["sites"].items()
    }
    assert set(train["privacy"]) == set(res.get("privacy") or {})
    card = (tmp_path / "B" / "docs" / "README.md").read_text()
    for section in ("## Input", "## Output and thresholds", "## Training", "## Metrics", "## Known limits"):
        assert section in card
    macro = res["final"][P.BEST_MODEL]["test"]["macro"]["auc"]
    n = res["final"][P.BEST_MODEL]["test"]["n"]
    assert f"| **macro** | {n} images | {100 * macro:.1f}" in card
    for png in ("auc_ci.png", "site_auc.png"):
        assert f"]({png})" in card and (tmp_path / "B" / "docs" / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.integration
@pytest.mark.realdata
def test_single_label_bundle_runs_without_the_package_and_equals_predict(ham_ws, tmp_path):
    """The bundle of the HAM10000 FedAvg run; the trained workspace itself is HAM10000's simulator check
    (single-label, real images): everything a 2-round run must leave (conftest.check_two_rounds). One test, so
    that the workspace is trained once (a module fixture is built again in each test worker that uses it)."""
    res = check_two_rounds(ham_ws, "fedavg")
    assert res["final"]["FL_global_model.pt"]["test"]["task"] == "multiclass" and len(res["data"]["sites"]) > 1
    meta, ours = _bundle_matches_predict(ham_ws, tmp_path, multilabel=False)
    probs = ours[[f"prob_{c}" for c in ISIC_CLASSES]].to_numpy()
    assert list(ours["prediction"]) == [ISIC_CLASSES[i] for i in probs.argmax(axis=1)]
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)  # softmax
    assert meta["thresholds"] == {} and meta["task_type"] == "multiclass"
    # the job starts from ImageNet (EfficientNet-Lite0): the start's normalisation travelled, not HAM10000's own
    assert (
        meta["preprocessing"]["mean"] == [0.485, 0.456, 0.406]
        and meta["training"]["architecture"] == "efficientnet_lite0"
    )


def test_the_card_gives_counts_intervals_and_warnings_a_clinician_needs():
    """Per class the test positives / negatives and 95 % intervals of sensitivity (Wilson: 8 of 8 found is
    [67.6, 100]), specificity and F1; warnings for 2 rounds, a small test set, a class with few positives and
    predictions piled on one class; the privacy line in words."""
    from fedpartial.tools.model_card import metrics_table, privacy_lines, warnings_for

    per_class = {
        "MEL": {"auc": 0.9, "sensitivity": 1.0, "specificity": 0.5, "f1": 0.4},
        "NV": {"auc": 0.8, "sensitivity": 0.5, "specificity": 1.0, "f1": 0.66},
    }
    test = {
        "task": "multiclass",
        "n": 40,
        "per_class": per_class,
        "macro": {"auc": 0.85, "sensitivity": 0.75, "specificity": 0.75, "f1": 0.53},
        "counts": {"MEL": {"pos": 8, "neg": 32, "pred": 24}, "NV": {"pos": 32, "neg": 8, "pred": 16}},
    }
    table = "\n".join(metrics_table(test))
    assert "| MEL | 8 / 32 | 90.0 | 100.0 [67.6, 100.0] | 50.0 [33.6, 66.4] |" in table
    assert "| **macro** | 40 images | 85.0 |" in table
    meta = {"training": {"rounds": 2}}
    warns = "\n".join(warnings_for(meta, {"test": test}))
    assert "Trained for 2 round(s) only" in warns and "Small test set: 40 images" in warns
    assert "Fewer than 30 positive test images: MEL (8)" in warns
    assert "Predictions concentrate on MEL: 60 % of the test images are predicted MEL, 20 % are MEL" not in warns
    test["counts"]["MEL"]["pred"] = 36
    assert "Predictions concentrate on MEL: 90 % of the test images are predicted MEL, 20 % are MEL" in "\n".join(
        warnings_for(meta, {"test": test})
    )
    line = privacy_lines({"hospital-1": {"releases": 4, "scope": None, "min_count": 5, "epsilon": None}})[0]
    assert line == (
        "- hospital-1: 4 release(s) of per-class statistics; no privacy scope (the job's defaults); counts "
        "below 5 withheld; no formal differential-privacy guarantee (statistics left without noise)."
    )
