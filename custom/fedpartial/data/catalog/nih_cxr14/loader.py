"""NIH ChestX-ray14 (multi-label, 14 findings).

Two label layouts are read:

- the official ``Data_Entry_2017.csv`` (``Image Index``, ``Finding Labels`` = ``|``-separated names or
  ``No Finding``, ``Patient ID``, ``View Position``, ...);
- a ``labels.csv`` with ``Image Index``, ``Patient ID`` and one 0/1 column per finding (the layout of the
  1,000-image sample in ``shared/data/nih_cxr14_1000``).

The official release spreads the images over ``images_001/images/...`` ... ``images_012/images/...``: the
images are found recursively once (file name -> relative path). Rows without an image are left out and reported
(``SourceTable.dropped``).

The release's official split is two lists of image file names, one per line, ``train_val_list.txt`` and
``test_list.txt`` (NIH's ChestX-ray14 folder; e.g. the README of lulucikyo/CheXNet): ``official_split=True`` reads
them into column ``official_split`` (``train`` / ``test``; prepare cuts val out of train by patient).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ...sources.base import Dropped, SourceError, SourceTable, index_images, read_csv
from . import CLASSES as NIH_CLASSES

NO_FINDING = "No Finding"
LABEL_FILES = ("labels.csv", "Data_Entry_2017.csv", "Data_Entry_2017_v2020.csv")
VIEWS = ("all", "PA", "AP")


def _find_labels_csv(root: Path, labels_csv: str | None) -> Path:
    """The given label CSV, else the first of ``LABEL_FILES`` present in ``root``."""
    if labels_csv is not None:
        path = root / labels_csv
        if not path.is_file():
            raise SourceError("nih_cxr14: label CSV not found", path, hint="check --root and labels_csv")
        return path
    for name in LABEL_FILES:
        if (root / name).is_file():
            return root / name
    raise SourceError(
        f"nih_cxr14: none of {list(LABEL_FILES)} found in {root}",
        hint="--root must be the ChestX-ray14 folder holding Data_Entry_2017.csv",
    )


def _labels_from_findings(findings: pd.Series, csv: Path) -> np.ndarray:
    """``(N, 14)`` int matrix from ``Finding Labels`` strings."""
    pos = {c: j for j, c in enumerate(NIH_CLASSES)}
    out = np.zeros((len(findings), len(NIH_CLASSES)), np.int64)
    for i, text in enumerate(findings):
        for name in (s.strip() for s in str(text).split("|")):
            if name in ("", NO_FINDING):
                continue
            if name not in pos:
                raise SourceError(
                    f"unknown finding {name!r}; the findings are {NIH_CLASSES} or {NO_FINDING!r}", csv, i + 2
                )
            out[i, pos[name]] = 1
    return out


def _labels_from_columns(df: pd.DataFrame, csv: Path) -> np.ndarray:
    """``(N, 14)`` int matrix from 0/1 class columns."""
    missing = [c for c in NIH_CLASSES if c not in df.columns]
    if missing:
        raise SourceError(f"has neither 'Finding Labels' nor the class columns {missing}", csv, 1)
    values = df[NIH_CLASSES].apply(pd.to_numeric, errors="coerce").to_numpy(float)
    bad = ~np.isin(values, (0.0, 1.0))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise SourceError(f"column {NIH_CLASSES[j]!r} is not 0/1", csv, i + 2)
    return values.astype(np.int64)


def _check_classes(classes: Sequence[str] | None, available: Sequence[str]) -> list[str]:
    """Validate a class subset; returned in the source's order."""
    if classes is None:
        return list(available)
    unknown = [c for c in classes if c not in available]
    if unknown:
        raise SourceError(f"unknown class(es) {unknown}; available: {list(available)}")
    if not classes:
        raise SourceError("empty class subset")
    return [c for c in available if c in set(classes)]


def load_nih_cxr14(
    root: str | os.PathLike,
    labels_csv: str | None = None,
    image_dir: str = "images",
    classes: Sequence[str] | None = None,
    view: str = "all",
    official_split: bool = False,
) -> SourceTable:
    """Load ChestX-ray14 as a multi-label source table.

    Args:
        root: dataset folder.
        labels_csv: label CSV relative to ``root``; default: the first of ``labels.csv``,
            ``Data_Entry_2017.csv``, ``Data_Entry_2017_v2020.csv`` found.
        image_dir: folder under ``root`` searched recursively for PNGs; when absent, ``root`` itself is searched
            (the official ``images_001/images/...`` layout).
        classes: optional subset of ``NIH_CLASSES`` (kept in NIH order); the other columns are dropped.
        view: ``"all"``, ``"PA"`` or ``"AP"``; filtering needs a ``View Position`` column.
        official_split: read ``train_val_list.txt`` / ``test_list.txt`` into column ``official_split``.

    Returns:
        A ``multilabel`` :class:`SourceTable` (``patient_id`` = ``Patient ID``; extra column ``view`` when
        known).
    """
    if view not in VIEWS:
        raise SourceError(f"nih_cxr14: view must be one of {VIEWS}, got {view!r}")
    root = Path(root)
    csv = _find_labels_csv(root, labels_csv)
    df = read_csv(csv, "nih_cxr14: label CSV")
    for col in ("Image Index", "Patient ID"):
        if col not in df.columns:
            raise SourceError(f"lacks column {col!r}; it has {list(df.columns)}", csv, 1)
    if "Finding Labels" in df.columns:
        labels = _labels_from_findings(df["Finding Labels"], csv)
    else:
        labels = _labels_from_columns(df, csv)
    keep = np.ones(len(df), bool)
    has_view = "View Position" in df.columns
    if view != "all":
        if not has_view:
            raise SourceError(f"view={view!r} needs a 'View Position' column, which this file lacks", csv, 1)
        keep &= (df["View Position"].str.strip().str.upper() == view).to_numpy()
    dropped: list[Dropped] = []
    names = df["Image Index"].str.strip()
    lines = np.arange(len(df)) + 2
    if not keep.all():
        dropped.append(
            Dropped(str(csv), f"are not {view} views (view filter)", names[~keep].tolist(), lines[~keep].tolist())
        )
    index = index_images(root, image_dir, suffixes=(".png",))
    images = names.map(lambda n: index.get(n, ""))
    missing = keep & (images == "").to_numpy()
    if missing.any():
        dropped.append(
            Dropped(str(csv), "have no image file under the root", names[missing].tolist(), lines[missing].tolist())
        )
    keep &= ~missing
    chosen = _check_classes(classes, NIH_CLASSES)
    frame = pd.DataFrame({"image": images, "patient_id": df["Patient ID"].str.strip(), "line": lines})
    files = [str(csv)]
    if official_split:
        frame["official_split"] = _official_split(root, names, csv)
        files += [str(root / "train_val_list.txt"), str(root / "test_list.txt")]
    if has_view:
        frame["view"] = df["View Position"].str.strip()
    for j, c in enumerate(NIH_CLASSES):
        if c in chosen:
            frame[c] = labels[:, j]
    frame = frame[keep].drop_duplicates("image").reset_index(drop=True)
    if frame.empty:
        raise SourceError(
            f"nih_cxr14: no image of {csv} (view {view}) was found under {root}",
            hint="--root must be the folder holding the label CSV and the images_*/ folders",
        )
    return SourceTable(
        name="nih_cxr14", task="multilabel", classes=chosen, root=root, frame=frame, dropped=dropped, files=files
    )


def _official_split(root: Path, names: pd.Series, csv: Path) -> pd.Series:
    """'train' / 'test' per row from ``train_val_list.txt`` / ``test_list.txt``."""
    of: dict[str, str] = {}
    for file, split in (("train_val_list.txt", "train"), ("test_list.txt", "test")):
        path = root / file
        if not path.is_file():
            raise SourceError(
                f"official_split needs {file}, not found in {root}",
                hint="copy the release's train_val_list.txt and test_list.txt next to the label CSV",
            )
        for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            name = line.strip()
            if name:
                if name in of and of[name] != split:
                    raise SourceError(f"{name} is in both train_val_list.txt and test_list.txt", path, n)
                of[name] = split
    out = names.map(lambda n: of.get(n, ""))
    absent = (out == "").to_numpy()
    if absent.any():
        i = int(np.flatnonzero(absent)[0])
        raise SourceError(f"image {names.iloc[i]} is in neither train_val_list.txt nor test_list.txt", csv, i + 2)
    return out
