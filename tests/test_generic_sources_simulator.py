"""Each generic source trains one round through an existing job, prepared on first use from tiny copies built from
the shared real images: a hospital's multi-label CSV export with blank (not annotated) and -1 cells, and a
folder of class sub-folders."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from test_generic_sources import CXR, HOSPITAL_ARGS, _shared_data, ham_folder, hospital_export  # noqa: F401
from test_sources_simulator import _job, _run, _trained

pytestmark = [pytest.mark.integration, pytest.mark.realdata]


def _dataset(name: str, task: str, classes: list[str], channels: int, prepare: dict) -> dict:
    return {
        "name": name,
        "task": task,
        "classes": classes,
        "channels": channels,
        "image_size": 32,
        "ct_windows": None,
        "mean": None,
        "std": None,
        "prepare": {"num_sites": 2, "protocol": "full", "seed": 0, "val_frac": 0.2, "test_frac": 0.2, **prepare},
    }


def test_hospital_csv_export_trains_one_round(tmp_path: Path):
    csv, cells = hospital_export(tmp_path / "data")
    dataset = _dataset(
        "hospital_cxr", "multilabel", CXR, 1, {"source": "csv", "root": str(csv), "source_args": HOSPITAL_ARGS}
    )  # root: the CSV itself
    results, log = _run(tmp_path, _job(tmp_path, "fedavg_cxr14", dataset), n=2)
    _trained(results, log, 2)
    assert results["dataset"] == "csv"
    # the sites trained on the export's labels: its blank and -1 cells not annotated, the others as written
    prepared = next((tmp_path / "cache").glob("**/dataset.json")).parent
    src = cells.set_index("file")
    blanks = 0
    for site in ("site-1", "site-2"):
        m = pd.read_csv(prepared / f"{site}.csv", dtype=str, keep_default_na=False)
        for c in CXR:
            exported = m["image"].map(lambda p: src.loc[p, c])
            assert ((m[c] == "") == exported.isin(["", "-1"])).all(), (site, c)
            blanks += int((m[c] == "").sum())
    assert blanks > 10


def test_class_folders_train_one_round(tmp_path: Path):
    root, ham = ham_folder(tmp_path / "derm")
    classes = sorted(ham["dx"].str.upper().unique())
    dataset = _dataset(
        "derm_folders",
        "multiclass",
        classes,
        3,
        {"source": "folder", "root": str(root), "source_args": {"patient_pattern": r"^(HAM_\d+)_"}},
    )
    results, log = _run(tmp_path, _job(tmp_path, "fedavg_ham10000", dataset), n=2)
    _trained(results, log, 2)
    assert results["dataset"] == "folder"
