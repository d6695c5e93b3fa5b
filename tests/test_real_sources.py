"""The real data in ../shared/data (HAM10000 subset, NIH ChestX-ray14 1,000-image sample).

Skipped with a reason when the folder is absent, except under CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from fedpartial.data import prepare as prep
from fedpartial.data.catalog.ham10000 import CLASSES as HAM_CLASSES
from fedpartial.data.catalog.nih_cxr14 import CLASSES as NIH_CLASSES
from fedpartial.data.manifest import read_manifest
from fedpartial.data.protocols import FEDLSM_ISIC_TABLE, assign
from fedpartial.data.sources import load_source
from fedpartial.data.sources.base import most_frequent_classes

pytestmark = pytest.mark.realdata

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
HAM = DATA / "ham10000"
NIH = DATA / "nih_cxr14_1000"

HAM_COUNTS = {"NV": 4323, "BKL": 583, "MEL": 491, "BCC": 264, "AKIEC": 183, "VASC": 80, "DF": 60}
NIH_COUNTS = {
    "Atelectasis": 95,
    "Cardiomegaly": 83,
    "Effusion": 170,
    "Infiltration": 162,
    "Mass": 35,
    "Nodule": 39,
    "Pneumonia": 11,
    "Pneumothorax": 40,
    "Consolidation": 42,
    "Edema": 31,
    "Emphysema": 37,
    "Fibrosis": 32,
    "Pleural_Thickening": 29,
    "Hernia": 9,
}


def _need(folder: Path, marker: str) -> Path:
    """The folder, or skip (fail under CI) when its data are absent."""
    if not (folder / marker).is_file():
        reason = f"real data not found: {folder / marker} (expected the shared data next to the project)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return folder


@pytest.fixture(scope="module")
def ham_root() -> Path:
    return _need(HAM, "HAM10000_metadata.csv")


@pytest.fixture(scope="module")
def nih_root() -> Path:
    return _need(NIH, "labels.csv")


def _patients(out: Path, names: list[str]) -> dict[str, set[str]]:
    return {n: set(pd.read_csv(out / f"{n}.csv", dtype=str, keep_default_na=False)["patient_id"]) for n in names}


def _assert_clean(parts: dict[str, set[str]]) -> None:
    names = list(parts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not parts[a] & parts[b], f"patients shared by {a} and {b}"


def test_ham10000_loads(ham_root):
    t = load_source("ham10000", ham_root)
    assert t.task == "multiclass" and t.classes == HAM_CLASSES
    assert len(t.frame) == 5984
    assert t.frame[HAM_CLASSES].sum().to_dict() == HAM_COUNTS
    assert (t.frame[HAM_CLASSES].sum(axis=1) == 1).all()
    assert t.frame["patient_id"].str.startswith("HAM_").all()
    assert t.frame["image"].str.match(r"^images/ISIC_\d+\.jpg$").all()


def test_nih_loads(nih_root):
    t = load_source("nih_cxr14", nih_root)
    assert t.task == "multilabel" and t.classes == NIH_CLASSES
    assert len(t.frame) == 1000
    assert t.frame["patient_id"].nunique() == 264
    assert t.frame[NIH_CLASSES].sum().to_dict() == NIH_COUNTS
    assert (t.frame[NIH_CLASSES].sum(axis=1) == 0).sum() == 499
    assert (t.frame[NIH_CLASSES].sum(axis=1) >= 2).sum() == 213
    assert most_frequent_classes(t, 8) == [
        "Atelectasis",
        "Cardiomegaly",
        "Effusion",
        "Infiltration",
        "Nodule",
        "Pneumothorax",
        "Consolidation",
        "Emphysema",
    ]


def test_ham10000_fedlsm_table(ham_root, tmp_path):
    out = prep.prepare("ham10000", ham_root, tmp_path / "ham", 5, "table", seed=0, table="fedlsm_isic")
    ds = prep.load_prepared(out)
    assert ds.data_root == ham_root.resolve()
    assert {s: set(c) for s, c in ds.site_classes.items()} == {s: set(c) for s, c in FEDLSM_ISIC_TABLE.items()}
    assert sum(ds.info["sizes"].values()) == 5984
    assert abs(ds.info["sizes"]["test"] - 0.2 * 5984) < 5 and abs(ds.info["sizes"]["val"] - 0.1 * 5984) < 5
    for site, classes in ds.site_classes.items():
        m = read_manifest(ds.sites[site], ds.classes, ds.data_root, site=site, task="multiclass")
        assert m.annotated_classes() == classes
    _assert_clean(_patients(out, [*ds.sites, "val", "test"]))


def test_nih_missing_k_top8(nih_root, tmp_path):
    out = prep.prepare("nih_cxr14", nih_root, tmp_path / "nih", 4, "missing_k", seed=0, top_k_classes=8, k=4)
    ds = prep.load_prepared(out)
    assert len(ds.classes) == 8 and "Hernia" not in ds.classes
    expected = assign("missing_k", ds.classes, 4, 0, k=4)
    assert [ds.site_classes[f"site-{i + 1}"] for i in range(4)] == [[ds.classes[j] for j in s] for s in expected]
    assert all(len(c) == 4 for c in ds.site_classes.values())
    assert sum(ds.info["sizes"].values()) == 1000
    parts = _patients(out, [*ds.sites, "val", "test"])
    _assert_clean(parts)
    assert len(set().union(*parts.values())) == 264
