"""CheXpert-v1.0 and CheXpert-v1.0-small (Stanford; multi-label, uncertainty labels).

Published layout (facts from ``torchxrayvision/datasets.py`` ``CheX_Dataset`` and its bundled copy of the small
release's ``train.csv`` (``torchxrayvision/data/chexpert_train.csv.gz``, mlmed/torchxrayvision@f4087a0)):

- ``<root>/train.csv`` and ``<root>/valid.csv``, ``<root>`` being the ``CheXpert-v1.0`` or ``CheXpert-v1.0-small``
  folder; header ``Path,Sex,Age,Frontal/Lateral,AP/PA,No Finding,Enlarged Cardiomediastinum,Cardiomegaly,
  Lung Opacity,Lung Lesion,Edema,Consolidation,Pneumonia,Atelectasis,Pneumothorax,Pleural Effusion,
  Pleural Other,Fracture,Support Devices``;
- ``Path`` = ``CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.jpg`` (the release folder's name
  first; torchxrayvision strips ``CheXpert-v1.0-small/`` / ``CheXpert-v1.0/`` to resolve it under the folder);
  the patient is the ``patient\\d+`` part;
- label cells ``1.0`` / ``0.0`` / ``-1.0`` (uncertain) / blank (not mentioned);
- ``Frontal/Lateral`` is ``Frontal`` or ``Lateral``; ``AP/PA`` is ``AP``, ``PA`` (also ``LL``, ``RL``) on frontal
  rows and blank on lateral ones.

``valid.csv`` is the release's own validation set (its test set is not public): ``official_split=True`` makes it
the test set and leaves ``train.csv`` to the train / val split.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ...sources.base import Dropped, SourceError, SourceTable, chexpert_values, pick_classes, read_csv, require_columns
from . import COLUMNS as CHEXPERT_COLUMNS
from . import FINDINGS as CHEXPERT_FINDINGS

VIEWS = ("all", "frontal", "lateral", "PA", "AP")
_PATIENT = re.compile(r"(patient\d+)")


def view_mask(frontal_lateral: pd.Series, ap_pa: pd.Series, view: str) -> np.ndarray:
    """Rows of the chosen view (``all``, ``frontal``, ``lateral``, ``PA``, ``AP``)."""
    if view not in VIEWS:
        raise SourceError(f"view must be one of {VIEWS}, got {view!r}")
    fl, ap = frontal_lateral.str.strip().str.lower(), ap_pa.str.strip().str.upper()
    if view == "all":
        return np.ones(len(fl), bool)
    if view in ("frontal", "lateral"):
        return (fl == view).to_numpy()
    return ((fl == "frontal") & (ap == view)).to_numpy()


def _relative(path: str, root: Path) -> str:
    """``CheXpert-v1.0-small/train/...`` -> ``train/...`` (relative to the release folder)."""
    parts = Path(path.strip()).parts
    if parts and (parts[0] == root.name or parts[0].startswith("CheXpert-v1.0")):
        parts = parts[1:]
    return Path(*parts).as_posix() if parts else ""


def _read(
    root: Path, name: str, classes: list[str], uncertain: str, blank: str, view: str, dropped: list[Dropped]
) -> pd.DataFrame:
    csv = root / name
    df = read_csv(csv, f"chexpert: label file {name}")
    require_columns(df, ["Path", "Frontal/Lateral", "AP/PA", *classes], csv)
    lines = np.arange(len(df)) + 2
    values = chexpert_values(df, classes, csv, uncertain, blank)
    if "No Finding" in df.columns and "No Finding" not in classes:
        healthy = (df["No Finding"].str.strip().isin(["1", "1.0"])).to_numpy()
        # "No Finding" = 1: every finding is absent (torchxrayvision's rule; Support Devices is not a finding)
        for j, c in enumerate(classes):
            if c != "Support Devices":
                values[healthy, j] = np.where(values[healthy, j] == 1, 1, 0)
    rel = df["Path"].map(lambda p: _relative(p, root))
    pid = df["Path"].str.extract(_PATIENT.pattern, expand=False).fillna("")
    bad = (pid == "").to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"Path {df['Path'].iloc[i]!r} has no patientNNNNN folder", csv, i + 2)
    frame = pd.DataFrame(
        {
            "image": rel,
            "patient_id": pid,
            "view": df["Frontal/Lateral"].str.strip(),
            "ap_pa": df["AP/PA"].str.strip(),
            "line": lines,
            "label_file": name,
        }
    )
    for j, c in enumerate(classes):
        frame[c] = values[:, j]
    keep = view_mask(df["Frontal/Lateral"], df["AP/PA"], view)
    if (~keep).any():
        dropped.append(
            Dropped(str(csv), f"are not {view} views (view filter)", rel[~keep].tolist(), lines[~keep].tolist())
        )
    frame = frame[keep]
    exists = frame["image"].map(lambda r: bool(r) and (root / r).is_file()).to_numpy(bool)
    if (~exists).any():
        miss = frame[~exists]
        dropped.append(
            Dropped(str(csv), "have no image file under the root", miss["image"].tolist(), miss["line"].tolist())
        )
    return frame[exists]


def load_chexpert(
    root: str | os.PathLike,
    csv: str = "train.csv",
    classes: Sequence[str] | None = None,
    uncertain: str = "ignore",
    blank: str = "zeros",
    view: str = "all",
    official_split: bool = False,
    name: str = "chexpert",
) -> SourceTable:
    """Load a CheXpert release folder as a multi-label source table.

    Args:
        root: the ``CheXpert-v1.0`` or ``CheXpert-v1.0-small`` folder.
        csv: the label file (``train.csv``; ``valid.csv`` for the radiologist-labelled validation set).
        classes: class subset of ``CHEXPERT_COLUMNS`` (default ``CHEXPERT_FINDINGS``), in release order.
        uncertain: policy for ``-1.0`` cells, one of ``UNCERTAIN_POLICIES`` (``ignore`` = not annotated).
        blank: policy for blank cells, one of ``BLANK_POLICIES`` (``zeros`` = negative).
        view: ``all``, ``frontal``, ``lateral``, ``PA`` or ``AP``.
        official_split: also read ``valid.csv`` as the test set (column ``official_split``).

    Returns:
        A ``multilabel`` :class:`SourceTable` (``patient_id`` = ``patientNNNNN``; rows without an image file or
        of another view are in ``dropped``).
    """
    root = Path(root)
    chosen = pick_classes(classes if classes is not None else CHEXPERT_FINDINGS, CHEXPERT_COLUMNS, name)
    dropped: list[Dropped] = []
    frame = _read(root, csv, chosen, uncertain, blank, view, dropped)
    files = [str(root / csv)]
    if official_split:
        frame["official_split"] = "train"
        test = _read(root, "valid.csv", chosen, uncertain, blank, view, dropped)
        test["official_split"] = "test"
        frame = pd.concat([frame, test], ignore_index=True)
        files.append(str(root / "valid.csv"))
    frame = frame.drop_duplicates("image").reset_index(drop=True)
    if frame.empty:
        raise SourceError(
            f"{name}: no image of {csv} (view {view}) was found under {root}",
            hint="--root must be the CheXpert-v1.0(-small) folder that holds train.csv and train/",
        )
    return SourceTable(
        name=name, task="multilabel", classes=chosen, root=root, frame=frame, dropped=dropped, files=files
    )
