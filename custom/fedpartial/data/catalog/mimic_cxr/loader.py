"""MIMIC-CXR-JPG 2.0.0 (PhysioNet; multi-label CheXpert-labeler labels per study, JPEGs per DICOM).

Published layout (facts from ``torchxrayvision/datasets.py`` ``MIMIC_Dataset`` (mlmed/torchxrayvision@f4087a0:
join of the label and metadata files on ``subject_id, study_id``, ``ViewPosition``, the image path
``files/p<first two digits of subject_id>/p<subject_id>/s<study_id>/<dicom_id>.jpg``), the PhysioNet page
https://physionet.org/content/mimic-cxr-jpg/2.0.0/ (file names, shipped gzipped) and public code reading them
(headers below; ``split`` values ``train`` / ``validate`` / ``test``; lateral views are ``LATERAL`` / ``LL``)):

- ``mimic-cxr-2.0.0-chexpert.csv(.gz)``: ``subject_id,study_id,Atelectasis,Cardiomegaly,Consolidation,Edema,
  Enlarged Cardiomediastinum,Fracture,Lung Lesion,Lung Opacity,No Finding,Pleural Effusion,Pleural Other,
  Pneumonia,Pneumothorax,Support Devices``; cells ``1.0`` / ``0.0`` / ``-1.0`` / blank as in CheXpert;
- ``mimic-cxr-2.0.0-metadata.csv(.gz)``: ``dicom_id,subject_id,study_id,PerformedProcedureStepDescription,
  ViewPosition,Rows,Columns,StudyDate,StudyTime,...``;
- ``mimic-cxr-2.0.0-split.csv(.gz)``: ``dicom_id,study_id,subject_id,split``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ...sources.base import (
    Dropped,
    SourceError,
    SourceTable,
    chexpert_values,
    find_file,
    pick_classes,
    read_csv,
    require_columns,
)
from . import COLUMNS as MIMIC_COLUMNS
from . import FINDINGS as MIMIC_FINDINGS

VIEWS = ("all", "frontal", "lateral", "PA", "AP")
SPLIT_NAMES = {"train": "train", "validate": "val", "test": "test"}


def _view_keep(view_position: pd.Series, view: str) -> np.ndarray:
    if view not in VIEWS:
        raise SourceError(f"view must be one of {VIEWS}, got {view!r}")
    v = view_position.str.strip().str.upper()
    if view == "all":
        return np.ones(len(v), bool)
    if view == "frontal":
        return v.isin(["PA", "AP"]).to_numpy()
    if view == "lateral":
        return v.isin(["LATERAL", "LL"]).to_numpy()
    return (v == view).to_numpy()


def _study_rows(labels: pd.DataFrame, lab_csv: Path) -> dict[str, int]:
    """``{"subject/study": row}`` of the label file, each study once (else an error at its line)."""
    key = labels["subject_id"].str.strip() + "/" + labels["study_id"].str.strip()
    dup = key.duplicated().to_numpy()
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise SourceError(f"study {key.iloc[i]} appears twice", lab_csv, i + 2)
    row_of = dict(zip(key, range(len(key))))
    return row_of


def _labelled_views(
    meta: pd.DataFrame, pos: pd.Series, view: str, meta_csv: Path
) -> tuple[pd.DataFrame, np.ndarray, list[Dropped]]:
    """The metadata rows of a labelled study and of the asked view, their label rows, and the others dropped."""
    dropped: list[Dropped] = []
    unlabelled = pos.isna().to_numpy()
    if unlabelled.any():
        dropped.append(
            Dropped(
                str(meta_csv),
                "belong to a study without a row in the label file",
                meta["dicom_id"][unlabelled].tolist(),
                meta["line"][unlabelled].tolist(),
            )
        )
    keep = ~unlabelled & _view_keep(meta["ViewPosition"], view)
    view_out = ~unlabelled & ~keep
    if view_out.any():
        dropped.append(
            Dropped(
                str(meta_csv),
                f"are not {view} views (view filter)",
                meta["dicom_id"][view_out].tolist(),
                meta["line"][view_out].tolist(),
            )
        )
    meta, pos = meta[keep], pos[keep].astype(int).to_numpy()
    return meta, pos, dropped


def _official_split(root: Path, frame: pd.DataFrame, name: str) -> Path:
    """Add column ``official_split`` (train / val / test) from the release's split file; returns the file."""
    split_csv = find_file(root, ["mimic-cxr-2.0.0-split.csv", "mimic-cxr-2.0.0-split.csv.gz"], name)
    split = read_csv(split_csv, "MIMIC-CXR split file")
    require_columns(split, ["dicom_id", "split"], split_csv)
    bad = ~split["split"].str.strip().isin(list(SPLIT_NAMES))
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise SourceError(f"split {split['split'].iloc[i]!r} is none of {list(SPLIT_NAMES)}", split_csv, i + 2)
    of = dict(zip(split["dicom_id"].str.strip(), split["split"].str.strip().map(SPLIT_NAMES)))
    frame["official_split"] = frame["image_id"].map(lambda d: of.get(d, ""))
    absent = frame["official_split"] == ""
    if absent.any():
        raise SourceError(
            f"image {frame['image_id'][absent].iloc[0]} (metadata line "
            f"{frame['line'][absent].iloc[0]}) has no row in the split file",
            split_csv,
        )
    return split_csv


def load_mimic_cxr(
    root: str | os.PathLike,
    classes: Sequence[str] | None = None,
    uncertain: str = "ignore",
    blank: str = "zeros",
    view: str = "all",
    official_split: bool = False,
    name: str = "mimic_cxr",
) -> SourceTable:
    """Load a MIMIC-CXR-JPG 2.0.0 folder (the one holding ``files/`` and the ``mimic-cxr-2.0.0-*.csv(.gz)``).

    Args:
        classes: subset of ``MIMIC_COLUMNS`` (default ``MIMIC_FINDINGS``).
        uncertain, blank: label policies (see :mod:`.base`).
        view: ``all``, ``frontal`` (PA or AP), ``lateral`` (LATERAL or LL), ``PA`` or ``AP``.
        official_split: read ``mimic-cxr-2.0.0-split.csv`` into column ``official_split`` (train / val / test).

    Returns:
        A ``multilabel`` :class:`SourceTable`, one row per image (the study's labels), ``patient_id`` =
        ``subject_id``.
    """
    root = Path(root)
    chosen = pick_classes(classes if classes is not None else MIMIC_FINDINGS, MIMIC_COLUMNS, name)
    lab_csv = find_file(root, ["mimic-cxr-2.0.0-chexpert.csv", "mimic-cxr-2.0.0-chexpert.csv.gz"], name)
    meta_csv = find_file(root, ["mimic-cxr-2.0.0-metadata.csv", "mimic-cxr-2.0.0-metadata.csv.gz"], name)
    labels = read_csv(lab_csv, "MIMIC-CXR label file")
    meta = read_csv(meta_csv, "MIMIC-CXR metadata file")
    require_columns(labels, ["subject_id", "study_id", *chosen], lab_csv)
    require_columns(meta, ["dicom_id", "subject_id", "study_id", "ViewPosition"], meta_csv)
    values = chexpert_values(labels, chosen, lab_csv, uncertain, blank)
    if "No Finding" in labels.columns and "No Finding" not in chosen:
        healthy = labels["No Finding"].str.strip().isin(["1", "1.0"]).to_numpy()
        for j, c in enumerate(chosen):  # torchxrayvision: "No Finding" = 1 zeroes every finding
            values[healthy, j] = np.where(values[healthy, j] == 1, 1, 0)
    row_of = _study_rows(labels, lab_csv)
    meta = meta.assign(line=np.arange(len(meta)) + 2)
    mkey = meta["subject_id"].str.strip() + "/" + meta["study_id"].str.strip()
    pos = mkey.map(row_of)
    meta, pos, dropped = _labelled_views(meta, pos, view, meta_csv)
    subj, study = meta["subject_id"].str.strip(), meta["study_id"].str.strip()
    image = "files/p" + subj.str[:2] + "/p" + subj + "/s" + study + "/" + meta["dicom_id"].str.strip() + ".jpg"
    frame = pd.DataFrame(
        {
            "image": image.to_numpy(),
            "patient_id": subj.to_numpy(),
            "image_id": meta["dicom_id"].str.strip().to_numpy(),
            "view": meta["ViewPosition"].str.strip().to_numpy(),
            "line": meta["line"].to_numpy(),
            "label_file": meta_csv.name,
        }
    )
    for j, c in enumerate(chosen):
        frame[c] = values[pos, j]
    files = [str(meta_csv), str(lab_csv)]
    if official_split:
        files.append(str(_official_split(root, frame, name)))
    exists = frame["image"].map(lambda r: (root / r).is_file()).to_numpy(bool)
    if (~exists).any():
        dropped.append(
            Dropped(
                str(meta_csv),
                "have no image file under the root",
                frame["image"][~exists].tolist(),
                frame["line"][~exists].tolist(),
            )
        )
    frame = frame[exists].reset_index(drop=True)
    if frame.empty:
        raise SourceError(
            f"{name}: no image of {meta_csv} (view {view}) was found under {root}",
            hint="--root must be the mimic-cxr-jpg/2.0.0 folder that holds files/",
        )
    return SourceTable(
        name=name, task="multilabel", classes=chosen, root=root, frame=frame, dropped=dropped, files=files
    )
