"""RSNA Intracranial Hemorrhage Detection (Kaggle 2019): label CSV -> :class:`SourceTable`, DICOM -> CT windows.

The label CSV has one row per (image, subtype)::

    ID,Label
    ID_12cadc6af_epidural,0
    ID_12cadc6af_intraparenchymal,0
    ...
    ID_12cadc6af_any,0

:func:`load_rsna_ich` pivots it to one row per image (``any`` dropped, it is the union of the five subtypes);
:func:`read_dicom_hu` and :func:`apply_windows` turn a slice into the usual 3-window input (brain, subdural,
bone) of RSNA ICH classifiers.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import numpy as np
import pandas as pd

from ...dicom import DEFAULT_WINDOWS, apply_windows, first_value, read_dicom_hu  # noqa: F401 - re-exported
from ...sources.base import SourceTable
from . import CLASSES as ICH_CLASSES
from . import LABELS as ICH_SUBTYPES

logger = logging.getLogger(__name__)

_ID_RE = r"^(ID_[0-9A-Fa-f]+)_(" + "|".join(ICH_SUBTYPES) + r")$"


def parse_rsna_csv(csv_path: str | os.PathLike) -> pd.DataFrame:
    """The RSNA label CSV -> one row per image: columns ``image_id`` and the five subtypes (int 0/1).

    Images keep their order of first appearance. Duplicate (image, subtype) rows keep the first (with a
    warning). A malformed ID, a label other than 0/1 or an image lacking a subtype -> ValueError naming the
    file and the CSV line (header = line 1).
    """
    csv_path = Path(csv_path)
    try:
        raw = pd.read_csv(csv_path, dtype=str, keep_default_na=False, skip_blank_lines=False)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise ValueError(f"cannot read RSNA label CSV '{csv_path}': {e}") from e
    if not {"ID", "Label"} <= set(raw.columns):
        raise ValueError(f"'{csv_path}' line 1: expected columns ID,Label, got {list(raw.columns)}")
    ids, label = raw["ID"].str.strip(), raw["Label"].str.strip()
    keep = ((ids != "") | (label != "")).to_numpy(dtype=bool)  # blank lines are skipped
    lines = (np.arange(len(raw)) + 2)[keep]
    ids, label = ids[keep], label[keep]
    if not len(ids):
        raise ValueError(f"'{csv_path}': no label rows")
    bad = ~ids.str.fullmatch(_ID_RE).to_numpy(dtype=bool)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"'{csv_path}' line {lines[i]}: malformed ID {ids.iloc[i]!r} "
            f"(expected ID_<hex>_<subtype>, subtype one of {list(ICH_SUBTYPES)})"
        )
    labels = (label == "1").to_numpy(dtype=bool)
    bad = ~labels & (label != "0").to_numpy(dtype=bool)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"'{csv_path}' line {lines[i]}: label {label.iloc[i]!r} is not 0 or 1")
    image, subtype = _split_ids(ids.to_numpy(dtype=str))
    img_code, order = pd.factorize(image)  # codes in order of first appearance
    key = img_code.astype(np.int64) * len(ICH_SUBTYPES) + pd.Index(ICH_SUBTYPES).get_indexer(subtype)
    _, first = np.unique(key, return_index=True)  # first row of every (image, subtype)
    wide = np.full((len(order), len(ICH_SUBTYPES)), -1, dtype=np.int8)
    wide.flat[key[first]] = labels[first]
    if len(first) < len(key):
        conflicts = int((wide.flat[key] != labels).sum())
        logger.warning(
            "%s: %d duplicate (image, subtype) rows dropped, kept the first (%d with another label)",
            csv_path,
            len(key) - len(first),
            conflicts,
        )
    missing = (wide[:, : len(ICH_CLASSES)] < 0).any(axis=1)
    if missing.any():
        k = int(np.argmax(missing))
        lacks = [c for j, c in enumerate(ICH_CLASSES) if wide[k, j] < 0]
        raise ValueError(
            f"'{csv_path}' line {lines[np.argmax(img_code == k)]}: image {order[k]} has no row for subtype(s) {lacks}"
        )
    union, any_ = wide[:, : len(ICH_CLASSES)].max(axis=1), wide[:, -1]
    n_bad = int(((any_ >= 0) & (any_ != union)).sum())
    if n_bad:
        logger.warning("%s: %d images whose 'any' label differs from the union of the subtypes", csv_path, n_bad)
    out = pd.DataFrame(wide[:, : len(ICH_CLASSES)].astype(int), columns=ICH_CLASSES)
    out.insert(0, "image_id", np.asarray(order, dtype=object))
    _, first_row = np.unique(img_code, return_index=True)  # each image's first CSV row (codes are 0..n-1)
    out["line"] = lines[first_row]
    return out


def _split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ID_<hex>_<subtype>`` strings ``(n,)`` -> image ids ``(n,)`` and subtypes ``(n,)``."""
    if hasattr(np, "strings") and hasattr(np.strings, "rpartition"):  # numpy >= 2.3: a fast ufunc
        head, _, tail = np.strings.rpartition(ids, "_")
        return head, tail
    parts = np.char.rpartition(ids, "_")
    return parts[:, 0], parts[:, 2]


def _read_patient_csv(path: Path) -> dict[str, str]:
    """``image id -> patient id`` from a CSV with a patient column (``patient_id`` / ``PatientID``) and an image
    column (``image_id`` / ``image`` / ``ID`` / ``SOPInstanceUID``, else the first other column)."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    pcol = next((c for c in ("patient_id", "PatientID") if c in df.columns), None)
    if pcol is None:
        raise ValueError(f"'{path}' line 1: no patient_id / PatientID column in {list(df.columns)}")
    icol = next(
        (c for c in ("image_id", "image", "ID", "SOPInstanceUID") if c in df.columns),
        next((c for c in df.columns if c != pcol), None),
    )
    if icol is None:
        raise ValueError(f"'{path}' line 1: no image id column in {list(df.columns)}")
    ids = df[icol].map(lambda s: PurePosixPath(s.strip().replace("\\", "/")).name.removesuffix(".dcm"))
    return {i: p.strip() for i, p in zip(ids, df[pcol]) if p.strip()}


def _dicom_patient_id(path: Path) -> str | None:
    """The PatientID tag of one file (header only); None when the file is missing or the tag empty."""
    import pydicom

    if not path.is_file():
        return None
    try:
        ds = pydicom.dcmread(str(path), stop_before_pixels=True, specific_tags=["PatientID"])
    except Exception as e:
        raise ValueError(f"cannot read DICOM header of '{path}': {e}") from e
    pid = str(ds.get("PatientID", "") or "").strip()
    return pid or None


def load_rsna_ich(
    root: str | os.PathLike,
    csv_name: str = "stage_2_train.csv",
    image_dir: str = "stage_2_train",
    patient_ids: str | None = None,
    read_patient_ids_from_dicom: bool = True,
    limit: int | None = None,
) -> SourceTable:
    """The RSNA ICH training set under ``root`` as a multilabel :class:`SourceTable` (5 subtypes, no ``any``).

    Args:
        root: data root holding ``csv_name`` and ``image_dir``.
        csv_name: the label CSV (``ID,Label`` rows), relative to root.
        image_dir: folder of ``ID_<hex>.dcm`` files, relative to root.
        patient_ids: optional CSV (relative to root or absolute) mapping image id -> patient id.
        read_patient_ids_from_dicom: read the PatientID tag of each DICOM (header only) for images the
            patient CSV does not cover; otherwise (or when the file / tag is missing) the image id is used.
        limit: keep only the first ``limit`` images of the CSV (quick experiments).
    """
    root = Path(root)
    labels = parse_rsna_csv(root / csv_name)
    if limit is not None:
        labels = labels.iloc[: int(limit)].reset_index(drop=True)
    ids = labels["image_id"].tolist()
    rel = [f"{PurePosixPath(image_dir.replace(os.sep, '/')) / i}.dcm" for i in ids]

    pids: list[str | None] = [None] * len(ids)
    if patient_ids:
        pmap = _read_patient_csv(Path(patient_ids) if Path(patient_ids).is_absolute() else root / patient_ids)
        pids = [pmap.get(i) for i in ids]
        if any(p is None for p in pids):
            logger.warning("%s: no patient id for %d of %d images", patient_ids, sum(p is None for p in pids), len(ids))
    todo = [k for k, p in enumerate(pids) if p is None]
    if todo and read_patient_ids_from_dicom:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            found = list(pool.map(_dicom_patient_id, (root / rel[k] for k in todo), chunksize=64))
        for k, p in zip(todo, found):
            pids[k] = p
        n_miss = sum(p is None for p in found)
        if n_miss:
            logger.warning(
                "%s: %d of %d images without a readable PatientID; using the image id",
                root / image_dir,
                n_miss,
                len(todo),
            )
    frame = pd.DataFrame({"image": rel, "patient_id": [p if p is not None else i for p, i in zip(pids, ids)]})
    for c in ICH_CLASSES:
        frame[c] = labels[c].to_numpy(dtype=int)
    return SourceTable(
        name="rsna_ich",
        task="multilabel",
        classes=list(ICH_CLASSES),
        root=root,
        frame=frame,
        files=[str(root / csv_name)],
        lines=labels["line"].tolist(),
    )
