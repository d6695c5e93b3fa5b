"""NIH ChestX-ray14 (multi-label, 14 findings).

Two label layouts are read:

- the official ``Data_Entry_2017.csv`` (``Image Index``, ``Finding Labels`` = ``|``-separated names or
  ``No Finding``, ``Patient ID``, ``View Position``, ...);
- a ``labels.csv`` with ``Image Index``, ``Patient ID`` and one 0/1 column per finding (the layout of the
  1,000-image sample in ``shared/data/nih_cxr14_1000``).

The official release spreads the images over ``images_001/images/...`` ... ``images_012/images/...``: the
images are found recursively once (file name -> relative path). Rows without an image are dropped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from .base import SourceTable
from .ham10000 import index_images

NIH_CLASSES: list[str] = [
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia", "Pneumothorax",
    "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
]
"""The 14 findings in NIH's order."""

NO_FINDING = "No Finding"
LABEL_FILES = ("labels.csv", "Data_Entry_2017.csv", "Data_Entry_2017_v2020.csv")
VIEWS = ("all", "PA", "AP")


def _find_labels_csv(root: Path, labels_csv: str | None) -> Path:
    """The given label CSV, else the first of ``LABEL_FILES`` present in ``root``."""
    if labels_csv is not None:
        path = root / labels_csv
        if not path.is_file():
            raise FileNotFoundError(f"nih_cxr14: label CSV not found: {path}")
        return path
    for name in LABEL_FILES:
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(f"nih_cxr14: none of {list(LABEL_FILES)} found in {root}")


def _labels_from_findings(findings: pd.Series, csv: Path) -> np.ndarray:
    """``(N, 14)`` int matrix from ``Finding Labels`` strings."""
    pos = {c: j for j, c in enumerate(NIH_CLASSES)}
    out = np.zeros((len(findings), len(NIH_CLASSES)), np.int64)
    for i, text in enumerate(findings):
        for name in (s.strip() for s in str(text).split("|")):
            if name in ("", NO_FINDING):
                continue
            if name not in pos:
                raise ValueError(f"nih_cxr14: {csv} line {i + 2}: unknown finding {name!r}")
            out[i, pos[name]] = 1
    return out


def _labels_from_columns(df: pd.DataFrame, csv: Path) -> np.ndarray:
    """``(N, 14)`` int matrix from 0/1 class columns."""
    missing = [c for c in NIH_CLASSES if c not in df.columns]
    if missing:
        raise ValueError(f"nih_cxr14: {csv} has neither 'Finding Labels' nor the class columns {missing}")
    values = df[NIH_CLASSES].apply(pd.to_numeric, errors="coerce").to_numpy(float)
    bad = ~np.isin(values, (0.0, 1.0))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"nih_cxr14: {csv} line {i + 2}: column {NIH_CLASSES[j]!r} is not 0/1")
    return values.astype(np.int64)


def _check_classes(classes: Sequence[str] | None, available: Sequence[str]) -> list[str]:
    """Validate a class subset; returned in the source's order."""
    if classes is None:
        return list(available)
    unknown = [c for c in classes if c not in available]
    if unknown:
        raise ValueError(f"unknown class(es) {unknown}; available: {list(available)}")
    if not classes:
        raise ValueError("empty class subset")
    return [c for c in available if c in set(classes)]


def load_nih_cxr14(root: str | os.PathLike, labels_csv: str | None = None, image_dir: str = "images",
                   classes: Sequence[str] | None = None, view: str = "all") -> SourceTable:
    """Load ChestX-ray14 as a multi-label source table.

    Args:
        root: dataset folder.
        labels_csv: label CSV relative to ``root``; default: the first of ``labels.csv``,
            ``Data_Entry_2017.csv``, ``Data_Entry_2017_v2020.csv`` found.
        image_dir: folder under ``root`` searched recursively for PNGs; when absent, ``root`` itself is searched
            (the official ``images_001/images/...`` layout).
        classes: optional subset of ``NIH_CLASSES`` (kept in NIH order); the other columns are dropped.
        view: ``"all"``, ``"PA"`` or ``"AP"``; filtering needs a ``View Position`` column.

    Returns:
        A ``multilabel`` :class:`SourceTable` (``patient_id`` = ``Patient ID``; extra column ``view`` when
        known).
    """
    if view not in VIEWS:
        raise ValueError(f"nih_cxr14: view must be one of {VIEWS}, got {view!r}")
    root = Path(root)
    csv = _find_labels_csv(root, labels_csv)
    df = pd.read_csv(csv, dtype=str, keep_default_na=False)
    df.columns = [str(c).strip() for c in df.columns]
    for col in ("Image Index", "Patient ID"):
        if col not in df.columns:
            raise ValueError(f"nih_cxr14: {csv} lacks column {col!r}")
    if "Finding Labels" in df.columns:
        labels = _labels_from_findings(df["Finding Labels"], csv)
    else:
        labels = _labels_from_columns(df, csv)
    keep = np.ones(len(df), bool)
    has_view = "View Position" in df.columns
    if view != "all":
        if not has_view:
            raise ValueError(f"nih_cxr14: view={view!r} needs a 'View Position' column, which {csv} lacks")
        keep &= (df["View Position"].str.strip().str.upper() == view).to_numpy()
    index = index_images(root, image_dir, suffixes=(".png",))
    names = df["Image Index"].str.strip()
    images = names.map(lambda n: index.get(n, ""))
    keep &= (images != "").to_numpy()
    chosen = _check_classes(classes, NIH_CLASSES)
    frame = pd.DataFrame({"image": images, "patient_id": df["Patient ID"].str.strip()})
    if has_view:
        frame["view"] = df["View Position"].str.strip()
    for j, c in enumerate(NIH_CLASSES):
        if c in chosen:
            frame[c] = labels[:, j]
    frame = frame[keep].drop_duplicates("image").reset_index(drop=True)
    if frame.empty:
        raise FileNotFoundError(f"nih_cxr14: no image of {csv} (view {view}) was found under {root}")
    return SourceTable(name="nih_cxr14", task="multilabel", classes=chosen, root=root, frame=frame)


def most_frequent_classes(table: SourceTable, k: int) -> list[str]:
    """The ``k`` classes with the most positives (FedMLP: "the eight categories with the highest incidence").

    Ties are broken by the table's class order; the result is returned in the table's class order (so column
    order stays stable).
    """
    if not 1 <= k <= len(table.classes):
        raise ValueError(f"k must be in 1..{len(table.classes)}, got {k}")
    counts = table.frame[table.classes].sum(axis=0).to_numpy()
    order = sorted(range(len(table.classes)), key=lambda j: (-counts[j], j))
    chosen = set(order[:k])
    return [c for j, c in enumerate(table.classes) if j in chosen]
