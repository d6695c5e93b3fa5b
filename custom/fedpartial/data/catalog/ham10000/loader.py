"""HAM10000 / ISIC 2018 Task 3 dermoscopy (single-label, 7 classes).

Two layouts are read:

- the HAM10000 release: ``HAM10000_metadata.csv`` (``lesion_id, image_id, dx, ...``) and the images as
  ``<image_dir>/<image_id>.jpg`` (:func:`load_ham10000`); the patient id is the ``lesion_id`` so that images of
  one lesion never straddle two splits;
- the ISIC 2018 Task 3 ground truth: ``image,MEL,NV,BCC,AKIEC,BKL,DF,VASC`` one-hot rows
  (:func:`load_isic2018`); the patient id is the lesion id from the optional lesion-groupings CSV, else the image
  id.

Images are looked up recursively under ``image_dir`` (the official HAM10000 archive ships two folders,
``HAM10000_images_part_1`` / ``_part_2``); rows whose image does not exist are left out and reported
(``SourceTable.dropped``: count, names and CSV lines).

The ISIC 2018 Task 3 release (file names from the ISIC challenge's download links, e.g.
``https://isic-challenge-data.s3.amazonaws.com/2018/ISIC2018_Task3_Training_LesionGroupings.csv``, and public code
reading them): ``ISIC2018_Task3_Training_Input/*.jpg``,
``ISIC2018_Task3_Training_GroundTruth/ISIC2018_Task3_Training_GroundTruth.csv`` and
``ISIC2018_Task3_Training_LesionGroupings.csv`` (``image,lesion_id,diagnosis_confirm_type``). ``--source
ham10000`` on such a folder reads it. Without the lesion groupings one lesion's images could land in train and
test: the loader refuses unless ``lesion_groupings="none"`` says so explicitly (then it warns).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from ...sources.base import RELEASE_IMAGE_SUFFIXES as IMAGE_SUFFIXES
from ...sources.base import Dropped, SourceError, SourceTable, drop_missing, index_images
from ...sources.base import read_csv as _read_published
from . import CLASSES as HAM_CLASSES
from . import DX_TO_CLASS


def _lookup(ids: pd.Series, index: dict[str, str]) -> pd.Series:
    """Relative image path per image id (``<id>.jpg``, ``.jpeg`` or ``.png``), '' where absent."""

    def one(image_id: str) -> str:
        for suffix in IMAGE_SUFFIXES:
            rel = index.get(image_id + suffix)
            if rel:
                return rel
        return ""

    return ids.map(one)


def _one_hot(names: pd.Series, classes: list[str]) -> pd.DataFrame:
    """One int 0/1 column per class."""
    return pd.DataFrame({c: (names == c).astype(np.int64).to_numpy() for c in classes}, index=names.index)


def _finish(name: str, root: Path, frame: pd.DataFrame, csv: Path, files: list[str]) -> SourceTable:
    """Leave out (and report) rows without an image, dedupe, reset the index and wrap."""
    dropped: list[Dropped] = []
    frame = drop_missing(frame, csv, dropped).drop_duplicates("image").reset_index(drop=True)
    if frame.empty:
        raise SourceError(
            f"{name}: no image of the CSV was found under {root}",
            csv,
            hint="--root must be the folder that holds the CSV and the image folder(s)",
        )
    return SourceTable(
        name=name, task="multiclass", classes=list(HAM_CLASSES), root=root, frame=frame, dropped=dropped, files=files
    )


def _read_csv(root: Path, name: str, what: str) -> tuple[Path, pd.DataFrame]:
    """``root / name`` read as strings (BOM-tolerant) with stripped column names; SourceError naming ``what``."""
    csv = Path(name) if Path(name).is_absolute() else root / name
    return csv, _read_published(csv, what)


ISIC2018_GT = "ISIC2018_Task3_Training_GroundTruth.csv"
ISIC2018_GT_PATHS = (f"ISIC2018_Task3_Training_GroundTruth/{ISIC2018_GT}", ISIC2018_GT)
ISIC2018_GROUPS = "ISIC2018_Task3_Training_LesionGroupings.csv"


def is_isic2018_layout(root: Path) -> bool:
    """The folder holds the ISIC 2018 Task 3 ground truth (and no HAM10000 metadata)."""
    return not (root / "HAM10000_metadata.csv").is_file() and any((root / p).is_file() for p in ISIC2018_GT_PATHS)


def load_ham10000(
    root: str | os.PathLike,
    metadata: str = "HAM10000_metadata.csv",
    image_dir: str = "images",
    lesion_groupings: str | None = None,
) -> SourceTable:
    """Load HAM10000 as a single-label source table.

    Args:
        root: dataset folder.
        metadata: the metadata CSV (relative to ``root`` or absolute). When it has the ISIC 2018 ground-truth
            layout (``image`` + one-hot class columns) it is read by :func:`load_isic2018` instead.
        image_dir: image folder under ``root`` (searched recursively).
        lesion_groupings: for an ISIC 2018 Task 3 folder (see :func:`load_isic2018`).

    Returns:
        A ``multiclass`` :class:`SourceTable` with classes ``HAM_CLASSES``, ``patient_id`` = ``lesion_id`` and
        extra columns ``image_id`` and ``dx``; only rows whose image exists.
    """
    root = Path(root)
    if metadata == "HAM10000_metadata.csv" and is_isic2018_layout(root):
        return load_isic2018(
            root,
            image_dir="ISIC2018_Task3_Training_Input" if image_dir == "images" else image_dir,
            lesion_groupings=lesion_groupings or "auto",
        )
    csv, df = _read_csv(root, metadata, "ham10000: metadata CSV")
    if "dx" not in df.columns and set(HAM_CLASSES) <= set(df.columns):
        return load_isic2018(
            root, ground_truth_csv=metadata, image_dir=image_dir, lesion_groupings=lesion_groupings or "auto"
        )
    missing = [c for c in ("lesion_id", "image_id", "dx") if c not in df.columns]
    if missing:
        raise SourceError(f"lacks column(s) {missing}; it has {list(df.columns)}", csv, 1)
    dx = df["dx"].str.strip().str.lower()
    bad = ~dx.isin(list(DX_TO_CLASS)).to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(
            f"unknown dx value {df['dx'].iloc[i]!r} ({int(bad.sum())} such row(s)); expected one of "
            f"{sorted(DX_TO_CLASS)}",
            csv,
            i + 2,
        )
    image_id = df["image_id"].str.strip()
    frame = pd.DataFrame(
        {
            "image": _lookup(image_id, index_images(root, image_dir)),
            "patient_id": df["lesion_id"].str.strip(),
            "image_id": image_id,
            "dx": dx,
            "line": np.arange(len(df)) + 2,
        }
    )
    frame = pd.concat([frame, _one_hot(dx.map(DX_TO_CLASS), HAM_CLASSES)], axis=1)
    return _finish("ham10000", root, frame, csv, [str(csv)])


def load_isic2018(
    root: str | os.PathLike,
    ground_truth_csv: str | None = None,
    image_dir: str = "ISIC2018_Task3_Training_Input",
    lesion_groupings: str | None = "auto",
) -> SourceTable:
    """Load the ISIC 2018 Task 3 layout (``image,MEL,NV,BCC,AKIEC,BKL,DF,VASC`` one-hot, values 0/1 or 0.0/1.0).

    Args:
        root: dataset folder.
        ground_truth_csv: the ground-truth CSV (relative to ``root`` or absolute); default: the release's
            ``ISIC2018_Task3_Training_GroundTruth/ISIC2018_Task3_Training_GroundTruth.csv`` or the same file in root.
        image_dir: image folder under ``root`` (searched recursively).
        lesion_groupings: ``ISIC2018_Task3_Training_LesionGroupings.csv`` (``image, lesion_id, ...``): its lesion id
            becomes the patient id, so one lesion's images never straddle splits. ``"auto"`` (default) finds it in
            root and refuses when it is absent; ``"none"`` makes each image its own lesion (with a warning).

    Raises:
        SourceError: a row that is not one-hot, missing class columns, absent groupings, an image without a
            lesion id.
    """
    root = Path(root)
    if ground_truth_csv is None:
        ground_truth_csv = next((p for p in ISIC2018_GT_PATHS if (root / p).is_file()), ISIC2018_GT_PATHS[0])
    csv, df = _read_csv(root, ground_truth_csv, "isic2018: ground-truth CSV")
    missing = [c for c in ("image", *HAM_CLASSES) if c not in df.columns]
    if missing:
        raise SourceError(f"lacks column(s) {missing}; it has {list(df.columns)}", csv, 1)
    values = df[HAM_CLASSES].apply(pd.to_numeric, errors="coerce").to_numpy(float)
    bad = ~np.isin(values, (0.0, 1.0)).all(axis=1) | (values.sum(axis=1) != 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"row {df['image'].iloc[i]!r} is not one-hot over {HAM_CLASSES}", csv, i + 2)
    image_id = df["image"].str.strip()
    patient = image_id.copy()
    files = [str(csv)]
    if lesion_groupings == "auto":
        lesion_groupings = ISIC2018_GROUPS
        if not (root / ISIC2018_GROUPS).is_file():
            raise SourceError(
                f"{ISIC2018_GROUPS} not found in {root}: without the lesion groupings one lesion's images can land "
                "in train and test",
                hint=f"download {ISIC2018_GROUPS} from the ISIC 2018 challenge into {root}, or "
                "pass --source-arg lesion_groupings=none to treat every image as its own lesion",
            )
    if lesion_groupings and lesion_groupings != "none":
        gcsv, groups = _read_csv(root, lesion_groupings, "isic2018: lesion groupings")
        if not {"image", "lesion_id"} <= set(groups.columns):
            raise SourceError(f"lacks column(s) image / lesion_id; it has {list(groups.columns)}", gcsv, 1)
        lesion = dict(zip(groups["image"].str.strip(), groups["lesion_id"].str.strip()))
        absent = image_id.map(lambda i: not lesion.get(i)).to_numpy()
        if absent.any():
            i = int(np.flatnonzero(absent)[0])
            raise SourceError(f"image {image_id.iloc[i]} has no lesion_id in {gcsv}", csv, i + 2)
        patient = image_id.map(lesion)
        files.append(str(gcsv))
    elif lesion_groupings == "none":
        warnings.warn(
            "isic2018: no lesion groupings; every image is its own lesion, so images of one lesion may "
            "land in train and test"
        )
    labels = values.astype(np.int64)
    frame = pd.DataFrame(
        {
            "image": _lookup(image_id, index_images(root, image_dir)),
            "patient_id": patient,
            "image_id": image_id,
            "dx": [HAM_CLASSES[j].lower() for j in labels.argmax(axis=1)],
            "line": np.arange(len(df)) + 2,
        }
    )
    for j, c in enumerate(HAM_CLASSES):
        frame[c] = labels[:, j]
    return _finish("isic2018", root, frame, csv, files)
