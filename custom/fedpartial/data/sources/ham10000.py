"""HAM10000 / ISIC 2018 Task 3 dermoscopy (single-label, 7 classes).

Two layouts are read:

- the HAM10000 release: ``HAM10000_metadata.csv`` (``lesion_id, image_id, dx, ...``) and the images as
  ``<image_dir>/<image_id>.jpg`` (:func:`load_ham10000`); the patient id is the ``lesion_id`` so that images of
  one lesion never straddle two splits;
- the ISIC 2018 Task 3 ground truth: ``image,MEL,NV,BCC,AKIEC,BKL,DF,VASC`` one-hot rows
  (:func:`load_isic2018`); the patient id is the lesion id from the optional lesion-groupings CSV, else the image
  id.

Images are looked up recursively under ``image_dir`` (the official HAM10000 archive ships two folders,
``HAM10000_images_part_1`` / ``_part_2``); rows whose image does not exist are dropped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from .base import SourceTable

HAM_CLASSES: list[str] = ["MEL", "NV", "BCC", "AKIEC", "BKL", "DF", "VASC"]
"""The ISIC 2018 class order."""

DX_TO_CLASS: dict[str, str] = {c.lower(): c for c in HAM_CLASSES}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def index_images(root: str | os.PathLike, image_dir: str | os.PathLike = "images",
                 suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> dict[str, str]:
    """Find images once, recursively.

    Args:
        root: the source root.
        image_dir: folder under ``root`` to search; when it does not exist the whole ``root`` is searched.
        suffixes: file name endings to keep (case-insensitive).

    Returns:
        ``{file name: path relative to root (posix)}``; when a name occurs twice the first one in sorted walk
        order wins (deterministic).
    """
    root = Path(root)
    base = root / image_dir if (root / image_dir).is_dir() else root
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            if name.lower().endswith(suffixes) and name not in found:
                found[name] = (rel_dir / name).as_posix()
    return found


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


def _finish(name: str, root: Path, frame: pd.DataFrame) -> SourceTable:
    """Drop rows without an image, dedupe, reset the index and wrap."""
    frame = frame[frame["image"] != ""].drop_duplicates("image").reset_index(drop=True)
    if frame.empty:
        raise FileNotFoundError(f"{name}: no image of the CSV was found under {root}")
    return SourceTable(name=name, task="multiclass", classes=list(HAM_CLASSES), root=root, frame=frame)


def _read_csv(root: Path, name: str, what: str) -> tuple[Path, pd.DataFrame]:
    """``root / name`` read as strings with stripped column names; FileNotFoundError naming ``what``."""
    csv = root / name
    if not csv.is_file():
        raise FileNotFoundError(f"{what} not found: {csv}")
    df = pd.read_csv(csv, dtype=str, keep_default_na=False)
    df.columns = [str(c).strip() for c in df.columns]
    return csv, df


def load_ham10000(root: str | os.PathLike, metadata: str = "HAM10000_metadata.csv",
                  image_dir: str = "images") -> SourceTable:
    """Load HAM10000 as a single-label source table.

    Args:
        root: dataset folder.
        metadata: the metadata CSV (relative to ``root`` or absolute). When it has the ISIC 2018 ground-truth
            layout (``image`` + one-hot class columns) it is read by :func:`load_isic2018` instead.
        image_dir: image folder under ``root`` (searched recursively).

    Returns:
        A ``multiclass`` :class:`SourceTable` with classes ``HAM_CLASSES``, ``patient_id`` = ``lesion_id`` and
        extra columns ``image_id`` and ``dx``; only rows whose image exists.
    """
    root = Path(root)
    csv, df = _read_csv(root, metadata, "ham10000: metadata CSV")
    if "dx" not in df.columns and set(HAM_CLASSES) <= set(df.columns):
        return load_isic2018(root, ground_truth_csv=metadata, image_dir=image_dir)
    missing = [c for c in ("lesion_id", "image_id", "dx") if c not in df.columns]
    if missing:
        raise ValueError(f"ham10000: {csv} lacks columns {missing}")
    dx = df["dx"].str.strip().str.lower()
    bad = sorted(set(dx) - set(DX_TO_CLASS))
    if bad:
        raise ValueError(f"ham10000: {csv} has unknown dx value(s) {bad}; expected {sorted(DX_TO_CLASS)}")
    image_id = df["image_id"].str.strip()
    frame = pd.DataFrame({
        "image": _lookup(image_id, index_images(root, image_dir)),
        "patient_id": df["lesion_id"].str.strip(),
        "image_id": image_id,
        "dx": dx,
    })
    frame = pd.concat([frame, _one_hot(dx.map(DX_TO_CLASS), HAM_CLASSES)], axis=1)
    return _finish("ham10000", root, frame)


def load_isic2018(root: str | os.PathLike, ground_truth_csv: str = "ISIC2018_Task3_Training_GroundTruth.csv",
                  image_dir: str = "ISIC2018_Task3_Training_Input",
                  lesion_groupings: str | None = None) -> SourceTable:
    """Load the ISIC 2018 Task 3 layout (``image,MEL,NV,BCC,AKIEC,BKL,DF,VASC`` one-hot, values 0/1 or 0.0/1.0).

    Args:
        root: dataset folder.
        ground_truth_csv: the ground-truth CSV (relative to ``root`` or absolute).
        image_dir: image folder under ``root`` (searched recursively).
        lesion_groupings: optional ``ISIC2018_Task3_Training_LesionGroupings.csv`` (``image, lesion_id``); its
            lesion id becomes the patient id. Without it each image is its own patient.

    Raises:
        ValueError: a row that is not one-hot, or missing class columns.
    """
    root = Path(root)
    csv, df = _read_csv(root, ground_truth_csv, "isic2018: ground-truth CSV")
    missing = [c for c in ("image", *HAM_CLASSES) if c not in df.columns]
    if missing:
        raise ValueError(f"isic2018: {csv} lacks columns {missing}")
    values = df[HAM_CLASSES].apply(pd.to_numeric, errors="coerce").to_numpy(float)
    bad = ~np.isin(values, (0.0, 1.0)).all(axis=1) | (values.sum(axis=1) != 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"isic2018: {csv} line {i + 2} is not a one-hot row over {HAM_CLASSES}")
    image_id = df["image"].str.strip()
    patient = image_id.copy()
    if lesion_groupings:
        groups = pd.read_csv(root / lesion_groupings, dtype=str, keep_default_na=False)
        lesion = dict(zip(groups["image"].str.strip(), groups["lesion_id"].str.strip()))
        patient = image_id.map(lambda i: lesion.get(i) or i)
    labels = values.astype(np.int64)
    frame = pd.DataFrame({
        "image": _lookup(image_id, index_images(root, image_dir)),
        "patient_id": patient,
        "image_id": image_id,
        "dx": [HAM_CLASSES[j].lower() for j in labels.argmax(axis=1)],
    })
    for j, c in enumerate(HAM_CLASSES):
        frame[c] = labels[:, j]
    table = _finish("isic2018", root, frame)
    return table
