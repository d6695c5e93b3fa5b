"""One sub-folder per class (single-label): ``fedpartial-prepare --source folder``.

Layout (the ``ImageFolder`` layout; sub-folders inside a class folder are searched too)::

    <root>/MEL/a.jpg, <root>/MEL/2021/b.jpg
    <root>/NV/c.jpg ...

With ``official_split=true`` the publisher's split is one level up: ``<root>/train/<class>/``,
``<root>/test/<class>/`` and optionally ``<root>/val/<class>/`` (``valid`` / ``validation`` too); without a val
folder prepare cuts val out of train by patient.

The classes are the class folders' names, sorted (``classes`` picks and orders some; the images of the other
folders are left out and reported). Folder names that differ only in case or surrounding spaces (``Pneumonia/``,
``pneumonia/``) are one class, spelt as in ``classes``, else as the folder holding the most images (the report
says which spellings merged). Images are the files ending in ``suffixes`` (case-insensitive); hidden files
and folders (``.``) are skipped, other files are left out and reported, never silently. A folder has no patient
ids: every image is its own patient (a warning) unless ``patient_pattern``, a regular expression searched in the
path below the class folder (its first group, else the whole match), names the patient.

Errors (:class:`SourceError`, naming the folder or file): no class folder, an empty class folder, an unknown
class in ``classes``, a class folder inside another (``nv/mel/``), a patient in two splits, a file
``patient_pattern`` does not match.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from .base import Dropped, SourceError, SourceTable, merge_spellings
from .csv_source import SPLIT_NAMES, patients_from_pattern, split_names

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm")
"""File endings read as images by default (PIL formats and DICOM)."""


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _walk(folder: Path, suffixes: tuple[str, ...]) -> tuple[list[Path], list[Path]]:
    """Images and other (non-hidden) files under ``folder``, recursively, in sorted order."""
    images, others = [], []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            (images if f.lower().endswith(suffixes) else others).append(Path(dirpath) / f)
    return images, others


def _refuse_nested(found: dict[str, list[Path]], root: Path, name: str) -> None:
    """A class folder inside another (``nv/mel/x.jpg``: its images would be labelled ``nv``) is an error naming it;
    other sub-folders (``MEL/2021/``) are searched as part of their class."""
    names = {c.lower() for c in found}
    for c, folders in found.items():
        for d in folders:
            for dirpath, dirnames, _ in os.walk(d):
                dirnames[:] = [x for x in dirnames if not x.startswith(".")]
                for x in dirnames:
                    if x.lower() in names:
                        inner = (Path(dirpath) / x).relative_to(root).as_posix()
                        raise SourceError(
                            f"{name}: class folder {inner!r} lies inside class folder {c!r}: its images "
                            f"would be labelled {c!r}",
                            Path(dirpath) / x,
                            hint="move it up beside the other class folders",
                        )


def _split_parts(root: Path, top: list[Path], official_split: bool, name: str) -> list[tuple[str, Path]]:
    """``(split, folder)`` of the class folders' parents: ``train`` / ``val`` / ``test`` (``official_split``), else
    ``("", root)``."""
    if official_split:
        parts = [(SPLIT_NAMES[d.name.lower()], d) for d in top if d.name.lower() in SPLIT_NAMES]
        if not any(s == "train" for s, _ in parts) or not any(s == "test" for s, _ in parts):
            raise SourceError(
                f"{name}: official_split needs train/ and test/ folders in {root}; it has {[d.name for d in top]}"
            )
    else:
        if top and {d.name.lower() for d in top} <= set(SPLIT_NAMES):
            raise SourceError(
                f"{name}: {root} holds only split folders {[d.name for d in top]}, not class folders",
                hint="pass --source-arg official_split=true to read <split>/<class>/ folders",
            )
        parts = [("", root)]
    return parts


def _loose_files(root: Path, parts: list[tuple[str, Path]], dropped: list[Dropped]) -> None:
    """Record the files lying next to the class folders (outside any class) as dropped."""
    loose = [
        p
        for folder in {root, *(f for _, f in parts)}
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".")
    ]
    if loose:
        dropped.append(
            Dropped(str(root), "lie outside any class folder", [p.relative_to(root).as_posix() for p in sorted(loose)])
        )


def _class_folders(parts: list[tuple[str, Path]], name: str) -> dict[str, list[Path]]:
    """``{class folder name: its folders}`` (one per split), each parent holding at least one."""
    found: dict[str, list[Path]] = {}
    for split, folder in parts:
        dirs = _visible_dirs(folder)
        if not dirs:
            raise SourceError(
                f"{name}: {folder} has no class sub-folder",
                hint="one sub-folder per class, each holding that class's images",
            )
        for d in dirs:
            found.setdefault(d.name, []).append(d)
    return found


def _image_rows(
    root: Path,
    parts: list[tuple[str, Path]],
    found: dict[str, list[Path]],
    walked: dict,
    available: list[str],
    chosen: list[str],
    ends: tuple[str, ...],
    dropped: list[Dropped],
) -> list[tuple[str, str, str, int]]:
    """``(image, split, path below the class folder, class index)`` of every image of the chosen classes; the
    images of the other classes and the files that are no image recorded as dropped."""
    rows: list[tuple[str, str, str, int]] = []  # image, split, path below the class folder, class index
    others: list[Path] = []
    split_of = {folder: split for split, folder in parts}
    for c in available:
        for d in found[c]:
            images, rest = walked[d]
            others += rest
            if c not in chosen:
                if images:
                    dropped.append(
                        Dropped(
                            str(d), f"are of a class outside {chosen}", [p.relative_to(root).as_posix() for p in images]
                        )
                    )
                continue
            if not images:
                raise SourceError(
                    f"class folder {c!r} holds no image (files ending in {list(ends)})",
                    d,
                    hint="remove the folder, add its images, or leave it out with --source-arg "
                    "classes=...; other endings: --source-arg suffixes=.png,.jpg",
                )
            for p in images:
                rows.append(
                    (p.relative_to(root).as_posix(), split_of[d.parent], p.relative_to(d).as_posix(), chosen.index(c))
                )
    if others:
        dropped.append(
            Dropped(
                str(root),
                f"are not image files (endings {list(ends)})",
                [p.relative_to(root).as_posix() for p in others],
            )
        )
    return rows


def load_folder(
    root: str | os.PathLike,
    classes: str | Sequence[str] | None = None,
    patient_pattern: str | None = None,
    suffixes: str | Sequence[str] | None = None,
    official_split: bool = False,
    source_name: str = "folder",
) -> SourceTable:
    """Load a folder of class sub-folders as a single-label source table.

    Args:
        root: the folder holding one sub-folder per class (or ``train`` / ``val`` / ``test`` with
            ``official_split``).
        classes: class folder names to keep, in this order (a list or comma-separated text); default all, sorted.
        patient_pattern: regular expression finding the patient in an image's path below its class folder.
        suffixes: image file endings (default ``IMAGE_SUFFIXES``; a list or comma-separated text).
        official_split: read ``train`` / ``val`` / ``test`` folders (column ``official_split``).
        source_name: the source name recorded (and the prefix of its patient ids in a federation of several
            sources: two exports federated together need two names, or their patient ids would mix).

    Returns:
        A ``multiclass`` :class:`SourceTable` (``image`` relative to ``root``; ``files`` = ``[root]``).
    """
    name = source_name
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise SourceError(f"{name}: {root} is not a folder", hint="--root is the folder of class sub-folders")
    ends = tuple(s if s.startswith(".") else f".{s}" for s in (split_names(suffixes) or IMAGE_SUFFIXES))
    ends = tuple(s.lower() for s in ends)
    top = _visible_dirs(root)
    parts = _split_parts(root, top, official_split, name)
    dropped: list[Dropped] = []
    _loose_files(root, parts, dropped)
    found = _class_folders(parts, name)
    walked = {d: _walk(d, ends) for folders in found.values() for d in folders}  # each folder walked once
    wanted = split_names(classes)
    # class folders named alike but for case or spaces (Pneumonia/, pneumonia/) are one class
    kept, said = merge_spellings(
        {c: sum(len(walked[d][0]) for d in folders) for c, folders in found.items()}, wanted, "class folder", "image"
    )
    merged: dict[str, list[Path]] = {}
    for c, folders in found.items():
        merged.setdefault(kept[c], []).extend(folders)
    found = merged
    available = sorted(found)
    _refuse_nested(found, root, name)
    if wanted is not None:
        unknown = [c for c in wanted if c not in found]
        if unknown:
            raise SourceError(f"{name}: unknown class(es) {unknown}; the class folders of {root} are {available}")
        chosen = list(dict.fromkeys(wanted))
    else:
        chosen = available
    rows = _image_rows(root, parts, found, walked, available, chosen, ends, dropped)
    if official_split:
        for split in ("train", "test"):
            if not any(r[1] == split for r in rows):
                raise SourceError(f"{name}: the {split}/ folder of {root} holds no image of the classes {chosen}")
    rel = [r[0] for r in rows]
    if patient_pattern:
        patients = patients_from_pattern([r[2] for r in rows], patient_pattern, [(root / p, None) for p in rel])
        _check_patients(patients, rows, root)
    else:
        warnings.warn(
            f"{name}: no patient_pattern: every image is its own patient, so images of one patient may "
            "land in train and test"
        )
        patients = rel
    labels = np.zeros((len(rows), len(chosen)), np.int64)
    labels[np.arange(len(rows)), [r[3] for r in rows]] = 1
    frame = pd.DataFrame({"image": rel, "patient_id": patients})
    if official_split:
        frame["official_split"] = [r[1] for r in rows]
    for j, c in enumerate(chosen):
        frame[c] = labels[:, j]
    return SourceTable(
        name=name,
        task="multiclass",
        classes=chosen,
        root=root,
        frame=frame,
        dropped=dropped,
        files=[str(root)],
        notes=[f"{name}: {line}" for line in said],
    )


def _check_patients(patients: Sequence[str], rows: Sequence[tuple[str, str, str, int]], root: Path) -> None:
    """A patient's images share one split (leakage otherwise)."""
    first: dict[str, tuple[str, str, int]] = {}
    for p, (image, split, _, c) in zip(patients, rows):
        seen = first.setdefault(p, (image, split, c))
        if seen[1] != split:
            raise SourceError(
                f"patient {p!r} has images in '{seen[1]}' ({seen[0]}) and in '{split}' ({image}); a "
                "patient's images must share one split",
                root / image,
            )
