"""The site-data contract: one manifest CSV per site.

A manifest is a CSV a hospital can write by hand::

    image,patient_id,split,epidural,intraparenchymal,intraventricular,subarachnoid,subdural
    scans/ID_0001.dcm,P17,train,1,0,,,
    scans/ID_0002.dcm,P17,train,0,0,,,

- ``image``: path relative to the site's data root (required).
- one column per *global* class (the class list lives in the job config), each cell ``1`` / ``0`` / empty,
  empty meaning "not annotated". A class column may be absent altogether (= never annotated here).
- ``patient_id`` and ``split`` (``train`` / ``val`` / ``test``) are optional.

A site's *annotated* classes follow from its manifest: a class is annotated when at least one row of the
training split carries a 0 or 1 in its column.

Every problem is reported as a :class:`ManifestError` naming the site, the file and the CSV line (the header
is line 1), before any training starts.
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .cache import cache_dir
from .quality import DecodeCache, decode_all
from .vocabulary import IGNORED, VocabularyError, closest, map_header

IMAGE_COL = "image"
PATIENT_COL = "patient_id"
SPLIT_COL = "split"
SPLITS = ("train", "val", "test")
RESERVED_COLS = (IMAGE_COL, PATIENT_COL, SPLIT_COL)
TASKS = ("multilabel", "multiclass")


class ManifestError(ValueError):
    """A bad site manifest: names the site, the file and the CSV line (header = line 1)."""

    def __init__(
        self, message: str, site: str | None = None, file: str | os.PathLike | None = None, row: int | None = None
    ):
        self.site, self.file, self.row, self.reason = site, None if file is None else str(file), row, message
        where = []
        if site:
            where.append(f"site '{site}'")
        if file:
            where.append(f"file '{file}'")
        if row is not None:
            where.append(f"line {row}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


@dataclass
class Manifest:
    """A validated manifest.

    Attributes:
        paths: absolute image paths, one per row.
        labels: ``(N, C)`` float32 array, 1 / 0 where annotated, 0 where not (see ``mask``).
        mask: ``(N, C)`` bool array, True where the entry is annotated.
        classes: the global class list (column order of ``labels``).
        patient_ids: patient id per row ('' where absent).
        splits: split per row ('train' where absent).
        lines: CSV line number of each row (for error messages).
    """

    paths: list[str]
    labels: np.ndarray
    mask: np.ndarray
    classes: list[str]
    patient_ids: list[str]
    splits: list[str]
    lines: list[int]
    file: str = ""
    site: str = ""
    task: str = "multilabel"

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def annotated(self) -> np.ndarray:
        """``(C,)`` bool: the classes this manifest annotates (any 0/1 in the column)."""
        return self.mask.any(axis=0) if len(self) else np.zeros(len(self.classes), bool)

    def annotated_classes(self) -> list[str]:
        return [c for c, a in zip(self.classes, self.annotated) if a]

    def subset(self, split: str) -> "Manifest":
        """Rows of one split (a manifest without a split column is all 'train')."""
        idx = [i for i, s in enumerate(self.splits) if s == split]
        return Manifest(
            paths=[self.paths[i] for i in idx],
            labels=self.labels[idx],
            mask=self.mask[idx],
            classes=list(self.classes),
            patient_ids=[self.patient_ids[i] for i in idx],
            splits=[split] * len(idx),
            lines=[self.lines[i] for i in idx],
            file=self.file,
            site=self.site,
            task=self.task,
        )

    def fingerprint(self) -> str:
        """sha256 of the rows (absolute image paths, labels, annotation mask): two sites holding the same
        evaluation set (the simulator's shared val / test splits) get the same fingerprint; nothing about
        the rows can be read back from it."""
        h = hashlib.sha256()
        for path in self.paths:
            h.update(path.encode() + b"\0")
        h.update(np.ascontiguousarray(self.labels, dtype=np.float32).tobytes())
        h.update(np.ascontiguousarray(self.mask, dtype=bool).tobytes())
        return h.hexdigest()

    def positives(self) -> np.ndarray:
        """``(C,)`` int: annotated positives per class."""
        return (self.labels * self.mask).sum(axis=0).astype(int)

    def negatives(self) -> np.ndarray:
        """``(C,)`` int: annotated negatives per class."""
        return ((1 - self.labels) * self.mask).sum(axis=0).astype(int)


def _parse_cell(value, site, file, line, column) -> float:
    """'1' -> 1.0, '0' -> 0.0, empty -> nan; anything else is an error naming the cell."""
    if value is None:
        return np.nan
    s = str(value).strip()
    if s == "" or s.lower() == "nan":
        return np.nan
    if s in ("1", "1.0", "1.00"):
        return 1.0
    if s in ("0", "0.0", "0.00"):
        return 0.0
    raise ManifestError(
        f"class column '{column}' has value {s!r}; allowed values are 1, 0 or empty (= not annotated)", site, file, line
    )


def _read_header(
    file: Path, classes: Sequence[str], columns, ignore_columns: Sequence[str], site: str | None
) -> tuple[list[list[str]], list[str]]:
    """The CSV's rows and its header in the job's class names (the site's vocabulary applied), checked."""
    try:
        with open(file, newline="", encoding="utf-8-sig") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ManifestError(f"cannot be read as CSV ({e})", site, file) from e
    if not rows:
        raise ManifestError("the file is empty (no header)", site, file)
    header = [h.strip() for h in rows[0]]
    if IMAGE_COL not in header:
        raise ManifestError(f"missing required column '{IMAGE_COL}' (columns: {header})", site, file, 1)
    dup = sorted({h for h in header if header.count(h) > 1})
    if dup:
        raise ManifestError(f"duplicate column(s) {dup}", site, file, 1)
    try:  # the site's own column names -> the job's classes (fedpartial.data.vocabulary)
        header, _ = map_header(header, classes, columns, ignore_columns)
    except VocabularyError as e:
        raise ManifestError(str(e), site, file, 1) from None
    unknown = [c for c in header if c not in RESERVED_COLS and c not in classes and not c.startswith(IGNORED)]
    if unknown:
        raise ManifestError(
            f"unknown class column(s) {unknown}{closest(unknown[0], classes)}; the job's classes are "
            f"{list(classes)} (a site naming a class "
            "differently maps it with 'columns' in its fedpartial_data.json; 'ignore_columns' skips a column)",
            site,
            file,
            1,
        )
    return rows, header


def _body(rows: list[list[str]], header: list[str], site: str | None, file: Path) -> tuple[list, list[int]]:
    """The non-blank data rows and their line numbers (as an editor shows them), each as wide as the header."""
    body, line_numbers = [], []
    for number, r in enumerate(rows[1:], start=2):  # csv line numbers as an editor shows them
        if not any(cell.strip() for cell in r):
            continue  # blank line
        if len(r) != len(header):
            raise ManifestError(f"has {len(r)} fields, the header has {len(header)}", site, file, number)
        body.append(r)
        line_numbers.append(number)
    if not body:
        raise ManifestError("the manifest has no rows (empty site)", site, file)
    return body, line_numbers


def _check_image(
    rel: str,
    root: Path,
    root_resolved: Path,
    confine: bool,
    check_images: bool,
    verify_images: bool,
    site: str | None,
    file: Path,
    line: int,
) -> tuple[Path, Path]:
    """One row's image: inside the data root (``confine``), present and not empty (``check_images``), its header
    sound (``verify_images``). Returns its path and its resolved path."""
    p = Path(rel)
    p = p if p.is_absolute() else root / p
    real = p.resolve()
    if confine and not real.is_relative_to(root_resolved):
        raise ManifestError(
            f"image path {rel!r} resolves outside the site's data root (absolute paths, '..' "
            "and symbolic links must stay inside it)",
            site,
            file,
            line,
        )
    if check_images:
        if not p.is_file():
            raise ManifestError(f"image not found: {rel}", site, file, line)
        if p.stat().st_size == 0:
            raise ManifestError(f"image file is empty: {rel}", site, file, line)
        if verify_images:
            # imported where used: loads torch and PIL, which a manifest read without its images skips
            from .transforms import ImageLoadError, check_image_header

            try:
                check_image_header(p)
            except ImageLoadError as e:
                raise ManifestError(str(e).replace(str(p), rel), site, file, line) from None
    return p, real


def _refuse_duplicate(
    rel: str, labels: np.ndarray, j0: int, i: int, line_numbers: list[int], site: str | None, file: Path
) -> None:
    """The error of an image listed on two rows (``j0`` and ``i``), saying whether their labels conflict."""
    line = line_numbers[i]
    same = bool(np.array_equal(labels[j0], labels[i], equal_nan=True))
    raise ManifestError(
        f"image {rel!r} is listed twice (lines {line_numbers[j0]} and {line}"
        + (")" if same else ") with conflicting labels")
        + "; keep one row per image",
        site,
        file,
        line,
    )


def read_manifest(
    file: str | os.PathLike,
    classes: Sequence[str],
    data_root: str | os.PathLike | None = None,
    site: str | None = None,
    task: str = "multilabel",
    check_images: bool = True,
    require_annotated: bool = True,
    columns: dict[str, str] | None = None,
    ignore_columns: Sequence[str] = (),
    verify_images: bool = False,
    confine: bool = True,
    duplicates: str = "allow",
) -> Manifest:
    """Read and validate a manifest CSV.

    Args:
        file: the CSV.
        classes: the global class list (from the job config).
        data_root: folder the ``image`` paths are relative to (default: the CSV's folder).
        site: site name, only used in error messages.
        task: 'multilabel' or 'multiclass' (single-label: at most one 1 per row).
        check_images: check that every image file exists and is non-empty.
        verify_images: also check each image's header (:func:`fedpartial.data.transforms.check_image_header`:
            PIL ``verify``, DICOM header and pixel-data length) and then decode every image fully (a truncated
            JPEG passes the header check), the results cached by path, size and mtime
            (:mod:`fedpartial.data.quality`); the executor's data check does, so a site stops before round 0.
        confine: every image path must resolve (``Path.resolve``: symlinks and ``..`` followed) inside the data
            root; an absolute path or a link pointing elsewhere is an error.
        duplicates: ``"error"``: the same image (after resolving) twice in the file is an error naming both lines
            and whether their labels conflict (the executor's data check); ``"allow"``: accepted.
        require_annotated: raise if no class is annotated at all (a site with nothing to learn from is allowed
            for semi-supervised methods, which pass False).
        columns, ignore_columns: the site's vocabulary (:mod:`fedpartial.data.vocabulary`): its own column names
            mapped to global classes, and columns to skip.

    Image paths in the messages are as written in the manifest (relative to the data root), never the absolute
    location.

    Raises:
        ManifestError: naming the site, the file and the line of the first problem found.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    file = Path(file)
    if not file.is_file():
        raise ManifestError("manifest file not found", site, file)
    root = Path(data_root) if data_root is not None else file.parent
    rows, header = _read_header(file, classes, columns, ignore_columns, site)
    root_resolved = root.resolve()
    body, line_numbers = _body(rows, header, site, file)

    n, c = len(body), len(classes)
    labels = np.full((n, c), np.nan, dtype=np.float32)
    paths, pids, splits, lines = [], [], [], []
    has_split = SPLIT_COL in header
    has_pid = PATIENT_COL in header
    present = [(j, name) for j, name in enumerate(classes) if name in header]
    col = {name: k for k, name in enumerate(header)}
    seen: dict[str, int] = {}  # resolved image path -> row index
    for i in range(n):
        line = line_numbers[i]
        rel = str(body[i][col[IMAGE_COL]]).strip()
        if not rel:
            raise ManifestError("empty image path", site, file, line)
        p, real = _check_image(rel, root, root_resolved, confine, check_images, verify_images, site, file, line)
        for j, name in present:
            labels[i, j] = _parse_cell(body[i][col[name]], site, file, line, name)
        key = str(real)
        if key in seen and duplicates == "error":
            _refuse_duplicate(rel, labels, seen[key], i, line_numbers, site, file)
        seen[key] = i
        if task == "multiclass" and np.nansum(labels[i]) > 1:
            raise ManifestError("single-label task but the row has more than one positive class", site, file, line)
        split = str(body[i][col[SPLIT_COL]]).strip().lower() if has_split else "train"
        split = split or "train"
        if split not in SPLITS:
            raise ManifestError(f"split {split!r} is not one of {SPLITS}", site, file, line)
        paths.append(str(p))
        pids.append(str(body[i][col[PATIENT_COL]]).strip() if has_pid else "")
        splits.append(split)
        lines.append(line)
    if verify_images and check_images and paths:
        _decode_fully(paths, lines, site, file)
    mask = ~np.isnan(labels)
    m = Manifest(
        paths=paths,
        labels=np.nan_to_num(labels, nan=0.0),
        mask=mask,
        classes=list(classes),
        patient_ids=pids,
        splits=splits,
        lines=lines,
        file=str(file),
        site=site or "",
        task=task,
    )
    if require_annotated and not m.annotated.any():
        raise ManifestError("no class is annotated in any row (all class cells empty)", site, file)
    return m


def _decode_fully(paths: list[str], lines: list[int], site, file) -> None:
    """Decode every image (cached); the first that fails is a ManifestError at its line."""

    cache = DecodeCache(cache_dir() / "decoded.sqlite")
    try:
        errors = decode_all([Path(p) for p in paths], cache)
    finally:
        cache.close()
    for p, line, err in zip(paths, lines, errors):
        if err is not None:
            bad = [q for q, e in zip(paths, errors) if e is not None]
            more = f" ({len(bad) - 1} more undecodable image(s))" if len(bad) > 1 else ""
            raise ManifestError(f"image {Path(p).name} cannot be decoded: {err}{more}", site, file, line)


def write_manifest(
    file: str | os.PathLike,
    images: Iterable[str],
    labels: np.ndarray,
    mask: np.ndarray,
    classes: Sequence[str],
    patient_ids: Sequence[str] | None = None,
    splits: Sequence[str] | None = None,
) -> None:
    """Write a manifest atomically (temp file + rename): empty cells where ``mask`` is False."""
    images = list(images)
    data = {IMAGE_COL: images}
    if patient_ids is not None:
        data[PATIENT_COL] = list(patient_ids)
    if splits is not None:
        data[SPLIT_COL] = list(splits)
    lab = np.asarray(labels)
    msk = np.asarray(mask, bool)
    for j, name in enumerate(classes):
        data[name] = ["" if not msk[i, j] else str(int(lab[i, j])) for i in range(len(images))]
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(file.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w", newline="") as f:  # as pandas' to_csv wrote it: minimal quoting, "\n" line ends
        w = csv.writer(f, lineterminator="\n")
        w.writerow(list(data))
        w.writerows(zip(*data.values()))
    os.replace(tmp, file)


def check_coverage(annotated_by_site: dict[str, np.ndarray], classes: Sequence[str]) -> None:
    """Raise if some class is annotated by no site (nothing could ever learn it)."""
    if not annotated_by_site:
        raise ManifestError("no site reported any data")
    cover = np.zeros(len(classes), bool)
    for a in annotated_by_site.values():
        cover |= np.asarray(a, bool)
    missing = [c for c, ok in zip(classes, cover) if not ok]
    if missing:
        raise ManifestError(
            f"class(es) {missing} are annotated by no site (sites: {sorted(annotated_by_site)}); "
            "every class must be labelled somewhere"
        )
