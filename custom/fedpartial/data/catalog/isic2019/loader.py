"""ISIC 2019 training set (single-label, 8 diagnoses + UNK) and FLamby's Fed-ISIC2019 centres.

Published layout (facts from owkin/FLamby ``flamby/datasets/fed_isic2019/dataset_creation_scripts/
download_isic.py`` (file names and its centre rule) and ``.../train_test_split`` (the ground-truth header with
``0.0`` / ``1.0`` one-hot cells and image ids such as ``ISIC_0012669_downsampled``), README (the six centres)):

- ``ISIC_2019_Training_GroundTruth.csv``: ``image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK``, one-hot ``0.0`` / ``1.0``;
  UNK has no training image;
- ``ISIC_2019_Training_Metadata.csv``: ``image, ..., lesion_id, ...``; ``lesion_id`` is blank for the images whose
  centre is unknown (FLamby removes them) and otherwise starts with the centre's code (``BCN_...``,
  ``HAM_...``, ``MSK...``);
- ``ISIC_2019_Training_Input/<image>.jpg``.

Centres (``partition="centre"`` in prepare): FLamby splits the HAM images by the ``dataset`` column of a
HAM10000 metadata file (``vidir_molemax``, ``vidir_modern``, ``rosendahl``, ``vienna_dias``; the copy FLamby ships
as ``flamby/datasets/fed_isic2019/HAM10000_metadata``). Pass that file as ``ham_metadata`` to get FLamby's six
centres (:data:`fedpartial.data.catalog.isic2019.FLAMBY_CENTRES`); without it the HAM images form one centre
``HAM`` (three centres).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ...sources.base import Dropped, SourceError, SourceTable, index_images, pick_classes, read_csv, require_columns
from . import CLASSES as ISIC2019_TRAIN_CLASSES
from . import COLUMNS as ISIC2019_CLASSES

_CODE = re.compile(r"^([A-Za-z]+)")


def _centres(meta: pd.DataFrame, meta_csv: Path, root: Path, ham_metadata: str | None) -> pd.Series:
    code = meta["lesion_id"].str.strip().str.extract(_CODE, expand=False).fillna("").str.upper()
    if not ham_metadata:
        return code
    ham_csv = Path(ham_metadata) if Path(ham_metadata).is_absolute() else root / ham_metadata
    ham = read_csv(ham_csv, "HAM10000 metadata with a 'dataset' column")
    require_columns(ham, ["image_id", "dataset"], ham_csv)
    ds = dict(zip(ham["image_id"].str.strip(), ham["dataset"].str.strip()))
    image = meta["image"].str.strip()
    out = code.copy()
    is_ham = (code == "HAM").to_numpy()
    for i in np.flatnonzero(is_ham):
        d = ds.get(image.iloc[i], "")
        if not d:
            raise SourceError(f"HAM image {image.iloc[i]} has no row in {ham_csv}", meta_csv, i + 2)
        out.iloc[i] = f"HAM_{d}"
    return out


def _one_hot(gt: pd.DataFrame, gt_csv: Path) -> np.ndarray:
    """The ground truth's class columns, each row one-hot (else an error at its line)."""
    values = gt[ISIC2019_CLASSES].apply(pd.to_numeric, errors="coerce").to_numpy(float)
    bad = ~np.isin(values, (0.0, 1.0)).all(axis=1) | (values.sum(axis=1) != 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"row {gt['image'].iloc[i]!r} is not one-hot over {ISIC2019_CLASSES}", gt_csv, i + 2)
    return values


def _known_lesions_of(
    frame: pd.DataFrame, chosen: list[str], meta_csv: Path, gt_csv: Path, dropped: list[Dropped]
) -> pd.DataFrame:
    """The rows with a lesion id (a known centre) of the chosen classes; the others recorded as dropped."""
    no_lesion = (frame["patient_id"] == "").to_numpy()
    if no_lesion.any():
        dropped.append(
            Dropped(
                str(meta_csv),
                "have no lesion_id (centre unknown; FLamby leaves them out too)",
                frame["image_id"][no_lesion].tolist(),
                frame["line"][no_lesion].tolist(),
            )
        )
    other = ~frame["dx"].isin(chosen).to_numpy() & ~no_lesion
    if other.any():
        dropped.append(
            Dropped(
                str(gt_csv),
                f"are of a class outside {chosen}",
                frame["image_id"][other].tolist(),
                frame["line"][other].tolist(),
            )
        )
    frame = frame[~no_lesion & ~other].drop(columns=[c for c in ISIC2019_CLASSES if c not in chosen])
    return frame


def load_isic2019(
    root: str | os.PathLike,
    classes: Sequence[str] | None = None,
    ground_truth: str = "ISIC_2019_Training_GroundTruth.csv",
    metadata: str = "ISIC_2019_Training_Metadata.csv",
    image_dir: str = "ISIC_2019_Training_Input",
    ham_metadata: str | None = None,
    name: str = "isic2019",
) -> SourceTable:
    """Load the ISIC 2019 training set.

    Args:
        classes: subset of ``ISIC2019_CLASSES`` (default ``ISIC2019_TRAIN_CLASSES``); rows of other classes are
            left out (and reported).
        ham_metadata: HAM10000 metadata with a ``dataset`` column (FLamby's six centres), relative to root or
            absolute.

    Returns:
        A ``multiclass`` :class:`SourceTable` with ``patient_id`` = ``lesion_id`` and column ``centre``; rows
        without a lesion id (unknown centre) are left out, as FLamby does, and reported.
    """
    root = Path(root)
    chosen = pick_classes(classes if classes is not None else ISIC2019_TRAIN_CLASSES, ISIC2019_CLASSES, name)
    gt_csv, meta_csv = root / ground_truth, root / metadata
    gt = read_csv(gt_csv, "ISIC 2019 ground truth")
    meta = read_csv(meta_csv, "ISIC 2019 metadata")
    require_columns(gt, ["image", *ISIC2019_CLASSES], gt_csv)
    require_columns(meta, ["image", "lesion_id"], meta_csv)
    values = _one_hot(gt, gt_csv)
    image = gt["image"].str.strip()
    meta_row = dict(zip(meta["image"].str.strip(), range(len(meta))))
    missing_meta = image.map(lambda i: i not in meta_row).to_numpy()
    if missing_meta.any():
        i = int(np.flatnonzero(missing_meta)[0])
        raise SourceError(f"image {image.iloc[i]} has no row in {meta_csv.name}", gt_csv, i + 2)
    m = meta.iloc[image.map(meta_row).to_numpy()].reset_index(drop=True)
    centre = _centres(m, meta_csv, root, ham_metadata)
    labels = values.astype(np.int64)
    frame = pd.DataFrame(
        {
            "image_id": image,
            "patient_id": m["lesion_id"].str.strip(),
            "centre": centre,
            "line": np.arange(len(gt)) + 2,
            "dx": [ISIC2019_CLASSES[j] for j in labels.argmax(axis=1)],
        }
    )
    for j, c in enumerate(ISIC2019_CLASSES):
        frame[c] = labels[:, j]
    dropped: list[Dropped] = []
    frame = _known_lesions_of(frame, chosen, meta_csv, gt_csv, dropped)
    index = index_images(root, image_dir)
    frame["image"] = frame["image_id"].map(lambda i: index.get(i + ".jpg", ""))
    miss = (frame["image"] == "").to_numpy()
    if miss.any():
        dropped.append(
            Dropped(
                str(gt_csv),
                "have no image file under the root",
                frame["image_id"][miss].tolist(),
                frame["line"][miss].tolist(),
            )
        )
    frame = frame[~miss].reset_index(drop=True)
    if frame.empty:
        raise SourceError(
            f"{name}: no image of {gt_csv} was found under {root}",
            hint="--root must be the folder holding ISIC_2019_Training_GroundTruth.csv and ISIC_2019_Training_Input/",
        )
    return SourceTable(
        name=name,
        task="multiclass",
        classes=chosen,
        root=root,
        frame=frame,
        dropped=dropped,
        files=[str(gt_csv), str(meta_csv)] + ([str(ham_metadata)] if ham_metadata else []),
    )
