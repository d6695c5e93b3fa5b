"""Any label CSV in one of the layouts below (a hospital's own export, ...): ``fedpartial-prepare --source csv``.

One row per image. The columns:

- the image column (``image_column``, default ``image``): a path relative to the images root (default the CSV's
  folder; ``images_root`` relative to the CSV's folder or absolute), or an absolute path inside it. Windows
  separators (``\\``) are read as ``/``; ``image_suffix`` (e.g. ``.jpg``) is appended to every cell, for exports
  that give image ids;
- the labels, in one of two layouts:

  - **one column per class** (the default; ``classes`` names them, else every column that is not the image,
    patient or split column nor in ``ignore_columns``): each cell ``1`` positive, ``0`` negative, ``-1``
    uncertain (CheXpert's code; ``uncertain`` says what it becomes) or blank (``blank``: not annotated by
    default; the spellings of a missing value, ``nan``, ``NA``, ``N/A``, ``null``, ``None``, ``#N/A``, ``-``,
    ``?`` in any case, are blank too; ``1.0`` / ``0.0`` / ``-1.0`` and ``True`` / ``False`` are accepted); two
    class columns whose names differ only in case are an error (one class or two?);
  - **one label-name column** (``label_column``): the class name(s) of the row; several names are separated by
    ``label_separator`` (default ``|``, NIH's ``Finding Labels``), ``none_label`` (default ``No Finding``) means
    every class negative, a blank cell or one spelling a missing value (as above) follows ``blank``. Names that
    differ only in case or surrounding spaces are one class (``nv``, ``NV``, ``Nv``): spelt as in ``classes``,
    else as most rows spell it (a tie: the spelling found first); the report lists the merged spellings and the
    missing values with their counts. The classes are ``classes`` (a name outside them is an error) or the names
    found, sorted;

- the patient column (``patient_column``; ``auto`` = ``patient_id`` when the CSV has one): images of one patient
  never straddle train / val / test. Without one, ``patient_pattern`` (a regular expression whose first group,
  else whole match, found in the image path is the patient) or ``patient_column=none`` (every image its own
  patient; a warning) must say so: a CSV without either is refused;
- an optional split column (``split_column``: ``train`` / ``val`` / ``test``; ``valid``, ``validation`` and
  ``validate`` are ``val``): the publisher's split, as ``official_split`` of the releases.

``task``: ``multilabel``, ``multiclass`` or ``auto``: one column per class is single-label when every row is
one-hot (one ``1``, the rest ``0``) or blank in every class (an unlabelled image), and at least one row is
one-hot; a label-name column is multi-label when a cell holds the separator or ``none_label``. ``auto`` never
decides silently: the table's ``notes`` say what it chose and why (prepare prints them), and an export whose
rows are ambiguous (a single-label export of some of the federation's classes has all-``0`` rows: images of a
class the site does not annotate) names ``task=multiclass`` / ``--task``. Single-label: two positives in a row
are an error; a row blank in every class (or a blank label cell) is an unlabelled image, kept; a row ``0`` in
every class is an image of none of these classes (prepare refuses it only when the classes are the federation's
whole vocabulary).

Every problem is a :class:`SourceError` naming the CSV and the line (an editor's line number: the header is
line 1, blank lines and quoted line breaks counted): an unknown column, a bad cell value, an unknown class name, an
empty image cell, an image outside the images root, the same image on two rows, a blank patient, a patient in two
splits. Images that do not exist or do not decode are found by prepare's quality pass, at the same line.
"""

from __future__ import annotations

import csv as _csv
import gzip
import io
import os
import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence, get_type_hints

import numpy as np
import pandas as pd

from ...options import OptionError, build, opt, option_names
from .base import (
    BLANK_POLICIES,
    MISSING_LABELS,
    NOT_ANNOTATED,
    UNCERTAIN_POLICIES,
    SourceError,
    SourceTable,
    count_text,
    is_missing,
    merge_spellings,
    spelling_key,
)

TASKS = ("auto", "multilabel", "multiclass")
SPLIT_NAMES = {"train": "train", "val": "val", "valid": "val", "validation": "val", "validate": "val", "test": "test"}
"""Split cell (case-insensitive) -> split."""

_CELL = {
    "1": 1,
    "1.0": 1,
    "true": 1,
    "0": 0,
    "0.0": 0,
    "false": 0,
    "-1": -2,
    "-1.0": -2,
    **dict.fromkeys(MISSING_LABELS, -3),
}
"""Class cell (lower-cased) -> 1, 0, uncertain (-2) or blank (-3: empty, or a spelling of a missing value)."""
_UNCERTAIN, _BLANK = -2, -3


def split_names(value: str | Sequence[str] | None) -> list[str] | None:
    """A list option given as a list or as comma-separated text (``--source-arg classes=A,B``)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [str(s).strip() for s in value]
    return [s.strip() for s in str(value).split(",") if s.strip()]


def read_rows(path: Path, delimiter: str = ",") -> tuple[list[str], list[list[str]], list[int]]:
    """A CSV (``.csv`` or ``.csv.gz``, BOM-tolerant) -> header, rows, and each row's first line in the file.

    Blank lines are skipped (and counted); a quoted cell spanning lines counts them all.

    Raises:
        SourceError: the file is absent, unreadable, empty, has no rows, or a row whose field count differs from the
            header's (at its line).
    """
    if not path.is_file():
        raise SourceError(
            "label CSV not found", path, hint="--root is the CSV file, or its folder with --source-arg csv=NAME"
        )
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise SourceError(f"cannot be read as a UTF-8 CSV ({type(e).__name__}: {e})", path) from None
    reader = _csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header: list[str] | None = None
    rows, lines = [], []
    end = 0
    try:
        for record in reader:
            start, end = end + 1, reader.line_num
            if not any(cell.strip() for cell in record):
                continue  # blank line
            if header is None:
                header = [c.strip() for c in record]
                header_line = start
                continue
            if len(record) != len(header):
                raise SourceError(
                    f"has {len(record)} fields, the header (line {header_line}) has {len(header)}",
                    path,
                    start,
                    hint=_delimiter_hint(header, delimiter),
                )
            rows.append([c.strip() for c in record])
            lines.append(start)
    except _csv.Error as e:
        raise SourceError(f"is not a valid CSV ({e})", path, reader.line_num) from None
    if header is None:
        raise SourceError("the file is empty (no header)", path)
    dup = sorted({h for h in header if header.count(h) > 1})
    if dup:
        raise SourceError(f"duplicate column(s) {dup}", path, header_line)
    if not rows:
        raise SourceError("the CSV has a header but no rows", path)
    return header, rows, lines


def _delimiter_hint(header: Sequence[str], delimiter: str) -> str | None:
    if len(header) == 1:
        for d, name in ((";", ";"), ("\t", "tab")):
            if d != delimiter and d in header[0]:
                return f"the header looks {name}-separated: pass --source-arg delimiter={name}"
    return None


def _find_csv(root: Path, csv: str | None) -> Path:
    """``root`` itself when it is a file, else ``root / csv``, else the one CSV in ``root``."""
    if root.is_file():
        if csv is not None:
            raise SourceError(
                f"--root is already a file ({root}); csv={csv!r} names another",
                hint="give either --root FILE or --root FOLDER with --source-arg csv=NAME",
            )
        return root
    if csv is not None:
        return Path(csv) if Path(csv).is_absolute() else root / csv
    if not root.is_dir():
        raise SourceError(f"csv: {root} is neither a CSV file nor a folder", hint="--root is the label CSV")
    found = sorted(p.name for p in root.iterdir() if p.is_file() and p.name.lower().endswith((".csv", ".csv.gz")))
    if len(found) != 1:
        raise SourceError(
            f"csv: {root} holds {len(found)} CSV files {found[:10]}; name the label CSV",
            hint="--root FOLDER/labels.csv, or --source-arg csv=NAME",
        )
    return root / found[0]


def _image_paths(
    cells: Sequence[str], lines: Sequence[int], images_root: Path, column: str, path: Path, suffix: str = ""
) -> list[str]:
    """Image cells -> posix paths relative to ``images_root`` (checked lexically: no ``..`` out of it; an absolute
    path that reaches the root through a symbolic link, on either side, is compared by its real folder); duplicates
    are errors naming both lines."""
    root = os.path.normpath(str(images_root))
    prefix = root.rstrip("/") + "/"
    real_prefix = os.path.realpath(root).rstrip("/") + "/"
    real_dirs: dict[str, str] = {}  # a folder's real path, once per folder (10^5-10^6 rows, few folders)
    out, seen = [], {}
    for cell, line in zip(cells, lines):
        if not cell:
            raise SourceError(f"image column {column!r} is empty", path, line)
        text = cell.replace("\\", "/") + suffix
        full = os.path.normpath(text if text.startswith("/") else prefix + text)
        if not full.startswith(prefix) and text.startswith("/"):
            folder, name = os.path.split(full)
            if folder not in real_dirs:
                real_dirs[folder] = os.path.realpath(folder)
            real = os.path.join(real_dirs[folder], name)
            if real.startswith(real_prefix):
                full = prefix + real[len(real_prefix) :]
        if not full.startswith(prefix):
            raise SourceError(
                f"image path {cell!r} lies outside the images root {root}",
                path,
                line,
                hint="pass --source-arg images_root=FOLDER, a folder that holds every image",
            )
        rel = full[len(prefix) :]
        if rel in seen:
            raise SourceError(
                f"image {cell!r} is listed twice (lines {seen[rel]} and {line}); keep one row per image", path, line
            )
        seen[rel] = line
        out.append(rel)
    return out


def _class_columns(
    header: list[str],
    rows: list[list[str]],
    lines: list[int],
    classes: list[str],
    uncertain: str,
    blank: str,
    path: Path,
    ignore_hint: str,
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Class cells -> raw codes ``(N, C)`` (1, 0, ``_UNCERTAIN``, ``_BLANK``), the policy-applied matrix and how
    many cells spell a missing value each way (``{'': 40, 'NA': 3}``)."""
    col = {h: k for k, h in enumerate(header)}
    raw = np.empty((len(rows), len(classes)), np.int64)
    columns = list(zip(*rows))
    missing: dict[str, int] = {}
    for j, c in enumerate(classes):
        cells = pd.Series(columns[col[c]], dtype=object)
        codes = cells.str.lower().map(_CELL)
        for spelling, n in cells[(codes == _BLANK).to_numpy()].value_counts(sort=False).items():
            missing[spelling] = missing.get(spelling, 0) + int(n)
        bad = codes.isna().to_numpy()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SourceError(
                f"column {c!r} has value {cells.iloc[i]!r}; a class cell is 1 (positive), 0 (negative), "
                "-1 (uncertain) or blank (not annotated)",
                path,
                lines[i],
                hint=ignore_hint,
            )
        raw[:, j] = codes.to_numpy(np.int64)
    values = raw.copy()
    values[raw == _UNCERTAIN] = {"ignore": NOT_ANNOTATED, "zeros": 0, "ones": 1}[uncertain]
    values[raw == _BLANK] = {"ignore": NOT_ANNOTATED, "zeros": 0}[blank]
    return raw, values, missing


def _label_names(
    cells: Sequence[str],
    lines: Sequence[int],
    classes: list[str] | None,
    separator: str | None,
    none_label: str,
    column: str,
    path: Path,
    blank: str = "ignore",
) -> tuple[list[list[str] | None], list[str], list[str]]:
    """Label-name cells -> per row the names (None = a blank cell or a spelling of a missing value, [] =
    ``none_label``), the class list and the report's lines (the missing values counted, the spellings merged).

    Names equal up to case and surrounding spaces are one class (:func:`~.base.merge_spellings`): ``classes``'
    spelling, else the most frequent; ``none_label`` is matched so too."""
    names: list[list[str] | None] = []
    missing: dict[str, int] = {}  # cells that name nothing: unlabelled
    stray: dict[str, int] = {}  # a missing value beside a class name ('Mass|nan'): dropped
    none_key = spelling_key(none_label)
    for cell in cells:
        if is_missing(cell) and spelling_key(cell) != none_key:
            missing[cell] = missing.get(cell, 0) + 1
            names.append(None)
            continue
        parts = [s.strip() for s in (cell.split(separator) if separator else [cell])]
        parts = [s for s in parts if s]
        gone = [s for s in parts if is_missing(s) and spelling_key(s) != none_key]  # 'Mass|nan': a stray token
        parts = [s for s in parts if s not in gone]
        for s in gone:
            (stray if parts else missing)[s] = (stray if parts else missing).get(s, 0) + 1
        if not parts:  # 'nan|N/A': nothing named
            names.append(None)
            continue
        names.append([] if [spelling_key(s) for s in parts] == [none_key] else parts)
    found: dict[str, int] = {}
    for row in names:
        for n in row or []:
            found[n] = found.get(n, 0) + 1
    if any(spelling_key(n) == none_key for n in found):
        i = next(i for i, row in enumerate(names) if row and any(spelling_key(n) == none_key for n in row))
        raise SourceError(f"label {cells[i]!r} mixes {none_label!r} with findings", path, lines[i])
    kept, notes = merge_spellings(found, classes)
    names = [None if row is None else list(dict.fromkeys(kept[n] for n in row)) for row in names]
    if missing:
        notes.insert(
            0,
            f"{sum(missing.values())} cell(s) of column {column!r} spell a missing value, read as "
            + ("unlabelled images" if blank == "ignore" else "no class positive (blank=zeros)")
            + f": {count_text(missing)}",
        )
    if stray:
        notes.append(
            f"{sum(stray.values())} missing value(s) beside a class name in column {column!r} were dropped: "
            f"{count_text(stray)}"
        )
    if classes is None:
        return names, sorted(set(kept.values())), notes
    known = set(classes)
    for i, row in enumerate(names):
        unknown = [n for n in row or [] if n not in known]
        if unknown:
            raise SourceError(
                f"column {column!r} names unknown class {unknown[0]!r}; the classes are {classes}"
                + (f" or {none_label!r}" if separator else ""),
                path,
                lines[i],
                hint="add it to --source-arg classes=..., or correct the row",
            )
    return names, list(classes), notes


@dataclass(frozen=True)
class CsvLayout:
    """How a label CSV is laid out (see the module docstring): which file, which columns hold what, what its cells
    mean. ``--source-arg KEY=VALUE`` and a site's ``source_args`` give these keys."""

    csv: str | None = opt(None, "the CSV's name in root (or an absolute path); default: root's only CSV")
    delimiter: str = opt(",", "the field separator (',', ';' or 'tab' for such exports)")
    images_root: str | os.PathLike | None = opt(
        None,
        "folder the image paths are relative to (default the CSV's folder; a relative value is relative to the "
        "CSV's folder)",
    )
    image_suffix: str = opt("", "appended to every image cell (an export of image ids: '.jpg')")
    image_column: str = opt("image", "the column of image paths")
    label_column: str | None = opt(
        None,
        "the column of class names (one per row, or several joined by label_separator); None: one column per class",
    )
    label_separator: str = opt("|", "separator of several names in label_column (multi-label)")
    none_label: str = opt("No Finding", "the label_column value meaning 'no class positive' (multi-label)")
    classes: str | list[str] | None = opt(
        None,
        "the class columns (one column per class) or the allowed names (label_column), in this order; a list or "
        "comma-separated text",
    )
    ignore_columns: str | list[str] | None = opt(
        None, "columns that are neither image, patient, split nor class (one column per class)"
    )
    patient_column: str = opt(
        "auto", "the patient id column; auto: patient_id if present; none: every image is its own patient"
    )
    patient_pattern: str | None = opt(
        None,
        "a regular expression searched in the image path; its first group (else the whole match) is the patient "
        "(when there is no patient column)",
    )
    split_column: str | None = opt(None, "a column of train / val / test (the publisher's split)")
    task: str = opt("auto", "auto, multilabel or multiclass")
    uncertain: str = opt("ignore", "what a -1 cell becomes, one of UNCERTAIN_POLICIES (ignore = not annotated)")
    blank: str = opt("ignore", "what a blank cell becomes, one of BLANK_POLICIES (ignore = not annotated)")
    source_name: str = opt(
        "csv",
        "the source name recorded (and the prefix of its patient ids in a federation of several sources: two "
        "exports federated together need two names, or their patient ids would mix)",
    )


_TEXT = frozenset(k for k, hint in get_type_hints(CsvLayout).items() if hint in (str, str | None))  # text options


def csv_layout(settings: dict, layout: CsvLayout | None = None) -> CsvLayout:
    """``layout`` (default :class:`CsvLayout`'s) with the flat ``settings`` (``--source-arg`` keys) applied and
    checked: an unknown key, a value of the wrong type or an unknown policy is a :class:`SourceError`. A text
    option given as a number (``--source-arg`` values that parse as JSON numbers arrive as numbers) is its text."""
    base = layout or CsvLayout()
    name = str(settings.get("source_name", base.source_name))
    unknown = sorted(k for k in settings if k not in option_names(CsvLayout))
    if unknown:
        raise SourceError(
            f"source 'csv' takes no option(s) {unknown}; its options are {[f.name for f in fields(CsvLayout)]}"
        )
    values = {f.name: getattr(base, f.name) for f in fields(CsvLayout)}
    for key, value in settings.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        values[key] = str(value) if key in _TEXT and number else value
    if values["delimiter"] in ("tab", "\\t"):
        values["delimiter"] = "\t"
    try:
        out = build(CsvLayout, values, name)
    except OptionError as e:
        raise SourceError(str(e)) from None
    for key, allowed in (("task", TASKS), ("uncertain", UNCERTAIN_POLICIES), ("blank", BLANK_POLICIES)):
        if getattr(out, key) not in allowed:
            raise SourceError(f"{name}: {key} must be one of {allowed}, got {getattr(out, key)!r}")
    if len(out.delimiter) != 1:
        raise SourceError(f"{name}: delimiter must be one character (or 'tab'), got {out.delimiter!r}")
    return out


def _images_root(path: Path, lay: CsvLayout) -> Path:
    """The folder the image paths are relative to (``images_root``, else the CSV's folder), checked."""
    name = lay.source_name
    base = path.parent
    images = base if lay.images_root is None else Path(lay.images_root).expanduser()
    images = (images if images.is_absolute() else base / images).resolve()
    if not images.is_dir():
        raise SourceError(
            f"{name}: images root {images} is not a folder",
            hint="--source-arg images_root=FOLDER (relative to the CSV's folder, or absolute)",
        )
    return images


def _patient_and_reserved(
    header: list[str], lay: CsvLayout, path: Path, hint: str | None
) -> tuple[str, bool, list[str]]:
    """The patient column (``""``: none), whether every image is its own patient, and the reserved columns
    (image, patient, split, label), each checked against the header."""
    name, patient_column = lay.source_name, lay.patient_column
    image_column, label_column, split_column = lay.image_column, lay.label_column, lay.split_column
    own_patient = patient_column == "none"
    if patient_column == "auto":
        patient_column = "patient_id" if "patient_id" in header else ""
    if own_patient:
        patient_column = ""
    if patient_column and lay.patient_pattern:
        raise SourceError(f"{name}: give patient_column or patient_pattern, not both")
    reserved = [c for c in (image_column, patient_column, split_column, label_column) if c]
    missing = [c for c in reserved if c not in header]
    if missing:
        raise SourceError(
            f"lacks column(s) {missing}; it has {header}",
            path,
            1,
            hint=hint
            or "name the columns with --source-arg image_column=..., label_column=..., "
            "patient_column=..., split_column=...",
        )
    if not (patient_column or lay.patient_pattern or own_patient):
        raise SourceError(
            f"has no patient column ('patient_id'); without one, images of one patient can land in "
            f"train and test (columns: {header})",
            path,
            1,
            hint="--source-arg patient_column=NAME, patient_pattern=REGEX (found in the image path), "
            "or patient_column=none (every image its own patient)",
        )
    return patient_column, own_patient, reserved


def _class_column_labels(
    header: list[str],
    rows: list,
    lines: list[int],
    lay: CsvLayout,
    task: str,
    wanted: list[str] | None,
    excluded: set[str],
    path: Path,
    hint: str | None,
    notes: list[str],
) -> tuple[list[str], np.ndarray, str]:
    """One column per class: the classes, the values and the task (``auto`` decided, said in ``notes``)."""
    name, blank = lay.source_name, lay.blank
    if wanted is None:
        cls = [h for h in header if h not in excluded]
    else:
        absent = [c for c in wanted if c not in header]
        if absent:
            raise SourceError(f"lacks class column(s) {absent}; it has {header}", path, 1, hint=hint)
        cls = list(dict.fromkeys(wanted))
    if not cls:
        raise SourceError(
            f"has no class column (columns {header})",
            path,
            1,
            hint="one column per class, or --source-arg label_column=NAME for a column of names",
        )
    clash = _case_clash(cls)
    if clash:
        raise SourceError(
            f"class columns {clash} differ only in case: one class or two?",
            path,
            1,
            hint="keep one of them (--source-arg ignore_columns=NAME) or rename one",
        )
    raw, values, missing = _class_columns(
        header,
        rows,
        lines,
        cls,
        lay.uncertain,
        blank,
        path,
        "if it is not a class column, list the classes with --source-arg classes=A,B "
        "or skip it with --source-arg ignore_columns=NAME",
    )
    if task == "auto":
        task, why = _auto_task(raw, lines)
        notes.append(f"{name}: task=auto chose {task}: {why}")
    if missing:
        notes.append(
            f"{name}: {sum(missing.values())} class cell(s) are blank or spell a missing value, read as "
            + ("not annotated" if blank == "ignore" else "negative (blank=zeros)")
            + f": {count_text(missing, 'cell')}"
        )
    return cls, values, task


def _label_column_labels(
    cells: list[str],
    lines: list[int],
    lay: CsvLayout,
    task: str,
    wanted: list[str] | None,
    path: Path,
    notes: list[str],
) -> tuple[list[str], np.ndarray, str]:
    """A column of class names: the classes, the values and the task (``auto`` decided, said in ``notes``)."""
    name, label_column, blank = lay.source_name, lay.label_column, lay.blank
    if task == "auto":
        none_key = spelling_key(lay.none_label)
        several = next(
            (i for i, c in enumerate(cells) if lay.label_separator in c or spelling_key(c) == none_key), None
        )
        task = "multiclass" if several is None else "multilabel"
        notes.append(
            f"{name}: task=auto chose {task}: "
            + (
                f"column {label_column!r} holds {cells[several]!r} at line {lines[several]} (several classes or "
                f"{lay.none_label!r})"
                if several is not None
                else f"every cell of column {label_column!r} names at most one class"
            )
            + "; --source-arg task=multilabel|multiclass decides otherwise"
        )
    separator = lay.label_separator if task == "multilabel" else None
    if separator is None and lay.label_separator:
        both = next((i for i, c in enumerate(cells) if lay.label_separator in c), None)
        if both is not None:
            raise SourceError(
                f"column {label_column!r} holds several classes {cells[both]!r} but the task is single-label",
                path,
                lines[both],
                hint="keep one class per row, or pass --source-arg task=multilabel",
            )
    names, cls, said = _label_names(cells, lines, wanted, separator, lay.none_label, label_column, path, blank)
    notes += [f"{name}: {line}" for line in said]
    if not cls:
        raise SourceError(
            f"column {label_column!r} names no class: none of its {len(cells)} image(s) has a label (every "
            "cell is blank or spells a missing value)",
            path,
            hint="fill in the labels, or name the label column with --source-arg label_column=NAME",
        )
    pos = {c: j for j, c in enumerate(cls)}
    values = np.zeros((len(cells), len(cls)), np.int64)
    for i, row in enumerate(names):
        if row is None:  # a blank cell: an unlabelled image (blank=ignore) or no class positive (zeros)
            values[i] = {"ignore": NOT_ANNOTATED, "zeros": 0}[blank]
        else:
            values[i, [pos[n] for n in row]] = 1
    return cls, values, task


def _patients(
    rows: list, col: dict[str, int], rel: list[str], lines: list[int], patient_column: str, lay: CsvLayout, path: Path
) -> list[str]:
    """Each row's patient: its patient column, the ``patient_pattern`` found in its image path, or itself."""
    name = lay.source_name
    if patient_column:
        patients = [r[col[patient_column]] for r in rows]
        for p, line in zip(patients, lines):
            if not p:
                raise SourceError(f"patient column {patient_column!r} is blank", path, line)
    elif lay.patient_pattern:
        patients = patients_from_pattern(rel, lay.patient_pattern, [(path, line) for line in lines])
    else:
        warnings.warn(
            f"{name}: no patient column (patient_column=none): every image is its own patient, so "
            "images of one patient may land in train and test"
        )
        patients = list(rel)
    return patients


def load_csv(root: str | os.PathLike, layout: CsvLayout | None = None, **settings) -> SourceTable:
    """Load any label CSV as a source table (see the module docstring for the layouts).

    Args:
        root: the label CSV, or the folder holding it (then ``layout.csv`` names it, unless it is the folder's
            only CSV).
        layout: :class:`CsvLayout` (default: its defaults).
        **settings: :class:`CsvLayout` fields, flat (``image_column="path"``), overriding ``layout``'s.

    Returns:
        A :class:`SourceTable` (``root`` = the images root; column ``line`` = each row's CSV line; column
        ``official_split`` with ``split_column``).

    Raises:
        SourceError: naming the CSV and the line of the first problem.
    """
    lay = csv_layout(settings, layout)
    name, task, patient_column = lay.source_name, lay.task, lay.patient_column
    image_column, label_column, split_column = lay.image_column, lay.label_column, lay.split_column
    notes: list[str] = []
    path = _find_csv(Path(root).expanduser(), lay.csv).resolve()
    header, rows, lines = read_rows(path, lay.delimiter)
    hint = _delimiter_hint(header, lay.delimiter)
    images = _images_root(path, lay)
    patient_column, own_patient, reserved = _patient_and_reserved(header, lay, path, hint)
    col = {h: k for k, h in enumerate(header)}
    wanted = split_names(lay.classes)
    ignored = set(split_names(lay.ignore_columns) or [])
    unknown_ignored = sorted(ignored - set(header))
    if unknown_ignored:
        raise SourceError(f"ignore_columns names column(s) {unknown_ignored} the CSV lacks; it has {header}", path, 1)

    # ---- images
    rel = _image_paths([r[col[image_column]] for r in rows], lines, images, image_column, path, str(lay.image_suffix))

    # ---- labels
    if label_column is None:
        cls, values, task = _class_column_labels(
            header, rows, lines, lay, task, wanted, set(reserved) | ignored, path, hint, notes
        )
    else:
        cells = [r[col[label_column]] for r in rows]
        cls, values, task = _label_column_labels(cells, lines, lay, task, wanted, path, notes)
    if task == "multiclass":
        _check_single_label(values, lines, cls, path)

    # ---- patients and split
    patients = _patients(rows, col, rel, lines, patient_column, lay, path)
    frame = pd.DataFrame({"image": rel, "patient_id": patients, "line": lines})
    if split_column:
        frame["official_split"] = _splits([r[col[split_column]] for r in rows], lines, split_column, path)
        _check_patient_splits(frame, path)
    for j, c in enumerate(cls):
        frame[c] = values[:, j]
    return SourceTable(name=name, task=task, classes=cls, root=images, frame=frame, files=[str(path)], notes=notes)


def _case_clash(names: Sequence[str]) -> list[str]:
    """The first names of ``names`` that are equal up to case and spaces (``['nv', 'NV']``), else []."""
    seen: dict[str, str] = {}
    for n in names:
        if spelling_key(n) in seen:
            return [seen[spelling_key(n)], n]
        seen[spelling_key(n)] = n
    return []


def _auto_task(raw: np.ndarray, lines: Sequence[int]) -> tuple[str, str]:
    """``task=auto`` for one column per class: ``(task, why)``. Blank cells are not annotated and say nothing;
    single-label when no cell is uncertain, no row has two positives or only ``0`` cells (ambiguous: an image of a
    class this site does not annotate, or a multi-label row with no finding) and some row has its positive; the
    reason names the first row that decided."""
    hint = (
        "; a single-label export of some of the federation's classes has rows 0 in every column (images of a "
        "class this site does not annotate): pass --source-arg task=multiclass (fedpartial-prepare: --task "
        "multiclass)"
    )
    blank_row = (raw == _BLANK).all(axis=1)
    pos = (raw == 1).sum(axis=1)
    uncertain = np.flatnonzero((raw == _UNCERTAIN).any(axis=1))
    if len(uncertain):
        return "multilabel", f"line {lines[int(uncertain[0])]} has an uncertain (-1) cell"
    many = np.flatnonzero(pos > 1)
    if len(many):
        return "multilabel", f"line {lines[int(many[0])]} has {int(pos[many[0]])} positive classes"
    none = np.flatnonzero((pos == 0) & ~blank_row)
    if len(none):
        return "multilabel", f"line {lines[int(none[0])]} (and {len(none) - 1} more) has no positive class" + hint
    if not (pos == 1).any():
        return "multilabel", "no row has a positive class"
    unl = int(blank_row.sum())
    return "multiclass", (
        "every row has exactly one positive class"
        + (f" or is blank in every class ({unl} unlabelled image(s))" if unl else "")
        + "; --source-arg task=multilabel decides otherwise"
    )


def _check_single_label(values: np.ndarray, lines: Sequence[int], classes: list[str], path: Path) -> None:
    """Single-label rows: at most one positive (a row with none, or blank in every class, is checked by prepare,
    which knows the federation's vocabulary: an image of a class this site does not annotate, or unlabelled)."""
    pos = (values == 1).sum(axis=1)
    many = np.flatnonzero(pos > 1)
    if len(many):
        i = int(many[0])
        hit = [c for c, v in zip(classes, values[i]) if v == 1]
        raise SourceError(
            f"row has {len(hit)} positive classes {hit} but the task is single-label",
            path,
            lines[i],
            hint="keep one class per row, or pass --source-arg task=multilabel",
        )


def patients_from_pattern(images: Sequence[str], pattern: str, where: Sequence[tuple[Path, int | None]]) -> list[str]:
    """The patient of each image path: the first group of ``pattern`` (else the whole match) found in it.

    Raises:
        SourceError: a bad expression, or a path it does not match (naming ``where``: file and line).
    """
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise SourceError(f"patient_pattern {pattern!r} is not a regular expression ({e})") from None
    out = []
    for image, (file, line) in zip(images, where):
        m = rx.search(image)
        if m is None or not (m.group(1) if rx.groups else m.group(0)):
            raise SourceError(
                f"patient_pattern {pattern!r} finds no patient in {image!r}",
                file,
                line,
                hint="adjust the expression (its first group is the patient)",
            )
        out.append(m.group(1) if rx.groups else m.group(0))
    return out


def _splits(cells: Sequence[str], lines: Sequence[int], column: str, path: Path) -> list[str]:
    out = []
    for cell, line in zip(cells, lines):
        split = SPLIT_NAMES.get(cell.lower())
        if split is None:
            raise SourceError(f"split column {column!r} has value {cell!r}; expected train, val or test", path, line)
        out.append(split)
    return out


def _check_patient_splits(frame: pd.DataFrame, path: Path) -> None:
    """A patient's images all in one split."""
    first: dict[str, tuple[str, int]] = {}
    for pid, split, line in zip(frame["patient_id"], frame["official_split"], frame["line"]):
        seen = first.setdefault(pid, (split, line))
        if seen[0] != split:
            raise SourceError(
                f"patient {pid!r} is in '{seen[0]}' (line {seen[1]}) and in '{split}'; a patient's "
                "images must share one split",
                path,
                int(line),
            )
