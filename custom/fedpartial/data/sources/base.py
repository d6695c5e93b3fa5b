"""What every source loader returns: the whole labelled dataset as one table (method- and protocol-agnostic),
plus the small helpers the loaders share (label policies, view filters, row reports)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pandas is imported where a table is read: a site process imports this module at start-up
    import pandas as pd

UNCERTAIN_POLICIES = ("ignore", "zeros", "ones")
"""What a CheXpert-style ``-1`` (uncertain) cell becomes: ``ignore`` = not annotated (the row does not train or
score that class; CheXpert paper's U-Ignore), ``zeros`` = negative (U-Zeros), ``ones`` = positive (U-Ones)."""

BLANK_POLICIES = ("zeros", "ignore")
"""What a blank cell (finding not mentioned in the report) becomes: ``zeros`` = negative, ``ignore`` = not
annotated."""

NOT_ANNOTATED = -1
"""Value of a class cell of ``SourceTable.frame`` that carries no label (written as an empty manifest cell)."""

RELEASE_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
"""The image file endings a named release's loader looks up (:func:`index_images`)."""

MISSING_LABELS = frozenset({"", "nan", "na", "n/a", "null", "none", "#n/a", "-", "?"})
"""A hospital export's spellings of "no value" (compared stripped and case-insensitively: ``NaN``, ``N/A``, ``NULL``,
``None``, ``#N/A`` from Excel, ``-``, ``?``, an empty or blank cell): a label cell holding one is unlabelled (a class
cell blank), never a class."""


def is_missing(cell: str) -> bool:
    """A label cell that spells a missing value (:data:`MISSING_LABELS`)."""
    return cell.strip().casefold() in MISSING_LABELS


def spelling_key(name: str) -> str:
    """Class names equal up to case and surrounding spaces are one class: ``'nv'``, ``' NV '``, ``'Nv'``."""
    return name.strip().casefold()


def count_text(counts: dict[str, int], unit: str = "row") -> str:
    """``{'NA': 3, '': 2}`` -> ``"'NA' (3 rows), '' (2 rows)"``, most frequent first."""
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k!r} ({n} {unit}{'s' if n != 1 else ''})" for k, n in items)


def merge_spellings(
    counts: dict[str, int], preferred: Sequence[str] | None = None, what: str = "class", unit: str = "row"
) -> tuple[dict[str, str], list[str]]:
    """Class names that differ only in case or surrounding spaces (:func:`spelling_key`) -> one class.

    Args:
        counts: each spelling found and how many rows (images) use it, in the order first found.
        preferred: the class list given by the user (``classes``), whose spelling wins; else the most frequent
            spelling is kept (a tie: the one found first).
        what / unit: the words of the report (``class`` / ``row``; a folder tree: ``class folder`` / ``image``).

    Returns:
        ``({spelling: the class name kept}, report lines)``, a line per class spelt more than one way:
        ``class 'nv' also spelt 'NV' (12 rows), 'Nv' (3 rows)``.

    Raises:
        SourceError: ``preferred`` names one class twice in two spellings (``NV`` and ``nv``): which is meant is
            the user's to say.
    """
    chosen: dict[str, str] = {}
    for name in preferred or []:
        key = spelling_key(name)
        if key in chosen and chosen[key] != name:
            raise SourceError(
                f"the classes {chosen[key]!r} and {name!r} differ only in case or spaces: one class or two? "
                "give each class once"
            )
        chosen[key] = name
    groups: dict[str, list[str]] = {}
    for spelling in counts:
        groups.setdefault(spelling_key(spelling), []).append(spelling)
    out: dict[str, str] = {}
    notes: list[str] = []
    for key, spellings in groups.items():
        kept = chosen.get(key) or max(spellings, key=lambda s: counts[s]).strip()  # max: the first of a tie
        out.update({s: kept for s in spellings})
        others = {s: counts[s] for s in spellings if s != kept}
        if others:
            notes.append(
                f"{what} {kept!r} also spelt {count_text(others, unit)}: read as one class "
                + ("(the spelling of classes)" if key in chosen else "(the most frequent spelling is kept)")
            )
    return out, notes


class SourceError(ValueError):
    """A problem with a source's published files: the message names the file and, where it is one row, its line
    (the header is line 1)."""

    def __init__(
        self, message: str, file: str | os.PathLike | None = None, line: int | None = None, hint: str | None = None
    ):
        self.file, self.line, self.hint, self.reason = None if file is None else str(file), line, hint, message
        where = ""
        if file is not None:
            where = f"{file}" + (f" line {line}" if line is not None else "") + ": "
        super().__init__(where + message + (f" (hint: {hint})" if hint else ""))


@dataclass
class Dropped:
    """Rows a loader left out, with why (reported by prepare, never silent)."""

    file: str
    reason: str
    names: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)

    def summary(self, first: int = 5) -> str:
        shown = ", ".join(f"{n} (line {l})" if l else n for n, l in zip(self.names[:first], self.lines[:first]))
        more = f", ... {len(self.names) - first} more" if len(self.names) > first else ""
        return f"{len(self.names)} row(s) of {self.file} {self.reason}: {shown}{more}"


@dataclass
class SourceTable:
    """A source dataset.

    Attributes:
        name: source name (e.g. 'ham10000', 'nih_cxr14', 'chexpert').
        task: 'multilabel' or 'multiclass' (single-label, one-hot rows).
        classes: class names, in column order.
        root: data root; ``frame['image']`` paths are relative to it.
        frame: one row per image with columns ``image`` (str, relative to root), ``patient_id`` (str; the image
            id itself where the source has no patient id) and one int column per class: 1 / 0, or
            ``NOT_ANNOTATED`` (-1) where the release gives no usable label for that image (CheXpert's uncertain
            cells under the ``ignore`` policy). Optional columns: ``official_split`` ('train' / 'val' / 'test',
            the publisher's split), ``centre`` (the image's acquiring centre), ``line`` (its source CSV line).
        synthetic: True for generated data (logged loudly by users of the table).
        dropped: rows left out by the loader, with the reason (missing image, view filter, ...).
        files: the published label files read (prepare's cache notices when one of them changes); the first is
            the one error messages name.
        lines: the CSV line of each frame row, for a loader whose frame has no ``line`` column.
        notes: what the loader decided for the user that they should read (``task=auto``'s choice and why);
            prepare prints them.
    """

    name: str
    task: str
    classes: list[str]
    root: Path
    frame: pd.DataFrame
    synthetic: bool = False
    dropped: list[Dropped] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: list[int] | None = None
    notes: list[str] = field(default_factory=list)

    def row_lines(self) -> list[int | None]:
        """Source CSV line of every frame row (None where unknown)."""
        if "line" in self.frame.columns:
            return [int(v) for v in self.frame["line"]]
        if self.lines is not None and len(self.lines) == len(self.frame):
            return [int(v) for v in self.lines]
        return [None] * len(self.frame)

    def row_files(self) -> list[str]:
        """Source label file of every frame row ('' where unknown)."""
        if "label_file" in self.frame.columns and self.files:
            folder = Path(self.files[0]).parent
            return [str(folder / f) for f in self.frame["label_file"]]
        return [self.files[0] if self.files else ""] * len(self.frame)

    def __post_init__(self):
        self.root = Path(self.root)
        missing = [c for c in ["image", "patient_id", *self.classes] if c not in self.frame.columns]
        if missing:
            raise ValueError(f"source {self.name}: frame lacks columns {missing}")


def read_csv(path: Path, what: str) -> pd.DataFrame:
    """A published CSV (``.csv`` or ``.csv.gz``) as strings, BOM-tolerant, with stripped column names.

    Raises:
        SourceError: the file is absent (names it and what it is) or not a readable CSV.
    """
    if not path.is_file():
        raise SourceError(f"{what} not found", path, hint="check --root and the release's folder layout")
    import pandas as pd

    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except Exception as e:  # noqa: BLE001 - pandas raises many types
        raise SourceError(f"not a readable CSV ({type(e).__name__}: {e})", path) from None
    df.columns = [str(c).strip() for c in df.columns]
    return df


def require_columns(df: pd.DataFrame, columns: Sequence[str], path: Path) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise SourceError(f"lacks column(s) {missing}; it has {list(df.columns)}", path, 1)


def find_file(root: Path, names: Sequence[str], what: str) -> Path:
    """The first of ``names`` (relative to root) that exists."""
    for n in names:
        if (root / n).is_file():
            return root / n
    raise SourceError(f"{what}: none of {list(names)} found in {root}", hint="check --root")


def chexpert_values(
    df: pd.DataFrame, classes: Sequence[str], path: Path, uncertain: str, blank: str, line_offset: int = 2
) -> np.ndarray:
    """CheXpert-labeler cells (``1.0`` positive, ``0.0`` negative, ``-1.0`` uncertain, blank = not mentioned)
    -> ``(N, C)`` int matrix of 1 / 0 / ``NOT_ANNOTATED`` under the two policies.

    Raises:
        SourceError: a cell that is none of these, naming the file, the line and the column.
    """
    if uncertain not in UNCERTAIN_POLICIES:
        raise SourceError(f"uncertain must be one of {UNCERTAIN_POLICIES}, got {uncertain!r}")
    if blank not in BLANK_POLICIES:
        raise SourceError(f"blank must be one of {BLANK_POLICIES}, got {blank!r}")
    code = {"1": 1, "1.0": 1, "0": 0, "0.0": 0, "-1": -2, "-1.0": -2, "": -3}
    out = np.empty((len(df), len(classes)), np.int64)
    for j, c in enumerate(classes):
        cells = df[c].str.strip()
        mapped = cells.map(code)
        bad = mapped.isna().to_numpy()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SourceError(
                f"column {c!r} has value {cells.iloc[i]!r}; the CheXpert labeler writes 1.0, 0.0, -1.0 or blank",
                path,
                i + line_offset,
            )
        out[:, j] = mapped.to_numpy(np.int64)
    unc = {"ignore": NOT_ANNOTATED, "zeros": 0, "ones": 1}[uncertain]
    out[out == -2] = unc
    out[out == -3] = {"zeros": 0, "ignore": NOT_ANNOTATED}[blank]
    return out


def pick_classes(classes: Sequence[str] | None, available: Sequence[str], source: str) -> list[str]:
    """Validate a class choice; returned in the source's order."""
    if classes is None:
        return list(available)
    if isinstance(classes, str):
        classes = [c for c in classes.split(",") if c]
    unknown = [c for c in classes if c not in available]
    if unknown:
        raise SourceError(f"{source}: unknown class(es) {unknown}; the release has {list(available)}")
    if not classes:
        raise SourceError(f"{source}: empty class list")
    return [c for c in available if c in set(classes)]


def drop_missing(frame: pd.DataFrame, file: Path, dropped: list[Dropped], name_col: str = "image_id") -> pd.DataFrame:
    """Rows whose ``image`` is '' are removed and recorded (count, names, CSV lines) in ``dropped``."""
    miss = frame["image"] == ""
    if miss.any():
        rows = frame[miss]
        dropped.append(
            Dropped(
                str(file),
                "have no image file under the root",
                rows[name_col].astype(str).tolist(),
                rows["line"].astype(int).tolist() if "line" in rows else [],
            )
        )
    return frame[~miss]


def index_images(
    root: str | os.PathLike, image_dir: str | os.PathLike = "images", suffixes: tuple[str, ...] = RELEASE_IMAGE_SUFFIXES
) -> dict[str, str]:
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


def most_frequent_classes(table: SourceTable, k: int) -> list[str]:
    """The ``k`` classes with the most positives (FedMLP: "the eight categories with the highest incidence").

    Ties are broken by the table's class order; the result is returned in the table's class order (so column
    order stays stable).
    """
    if not 1 <= k <= len(table.classes):
        raise ValueError(f"k must be in 1..{len(table.classes)}, got {k}")
    counts = table.frame[table.classes].clip(lower=0).sum(axis=0).to_numpy()
    order = sorted(range(len(table.classes)), key=lambda j: (-counts[j], j))
    chosen = set(order[:k])
    return [c for j, c in enumerate(table.classes) if j in chosen]
