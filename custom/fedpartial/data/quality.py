"""The data-quality pass of ``fedpartial-prepare``: every image of a source is found and fully decoded once, an
``--exclude`` list is applied, and what is left out is reported (count and the first names), never silent.

Decoding results are cached in a small SQLite file keyed by (absolute path, size, mtime), so a rerun over
unchanged files decodes nothing; a file that changes is decoded again.
"""

from __future__ import annotations

import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from .cache import cache_hint
from .sources.base import Dropped, SourceError, SourceTable

DECODE_CACHE = "decoded.sqlite"
Decoded = tuple[str | None, tuple[int, int] | None, int | None, str | None]
"""A decode's result: the error (None when it decodes), the image's ``(width, height)``, the significant bits
assumed for an image deeper than 8 bits that does not declare them and a DICOM's decoding steps joined by ``;``
(:func:`decode_image`)."""
DICOM_STEPS = {
    "monochrome1 inverted": "stored as MONOCHROME1 (bone dark) and were inverted, so bone is bright as in every "
    "other image",
    "window": "were shown through their own Window Center / Width (the VOI the modality wrote) before scaling",
    "voi lut": "were shown through their own VOI LUT Sequence before scaling",
    "rsna repair": "are RSNA ICH slices stored with the release's known fault (unsigned 12-bit, wrong intercept) "
    "and were repaired (values shifted by 1000 modulo 4096, intercept -1000)",
}
"""What the report says of the DICOM images each decoding step (``dicom_pixels``'s ``steps``) was applied to."""
NOTE_EXAMPLES = 3
"""File names a data-quality warning about many images shows (the rest are counted)."""


MIN_SIDE = 32
"""An image whose shorter side is under this many pixels is reported as of a degenerate size (an icon, a thumbnail,
a 1 x 1 placeholder an export wrote for a missing scan): the smallest preset input is 64 px."""
MAX_ASPECT = 10
"""An image one of whose sides is more than this many times the other is reported as of a degenerate size (a strip,
a cropped ruler); dermoscopy, radiographs and CT slices are within 2:1."""


def decode_image(path: Path) -> Decoded:
    """Fully decode one image (every pixel): ``(None, (width, height), bits, steps)`` when it decodes (the size is
    the decoded array's; ``bits``: N when the image has more than 8 bits per sample (a 16-bit PNG / TIFF), no
    ``sBIT`` chunk saying how many are significant, and was read as N-bit, N < 16, from its largest value
    (:func:`~fedpartial.data.store.significant_bits`), else None; ``steps``: a DICOM's decoding steps,
    :data:`DICOM_STEPS`, joined by ``;``, or None), else ``(why not, None, None, None)``."""
    from .transforms import read_image  # imported where used: loads torch

    info: dict = {}
    try:
        x = read_image(path, channels=1, info=info)  # PIL raises on a truncated JPEG / PNG (it does not pad by default)
    except Exception as e:  # noqa: BLE001 - decoders raise many types
        return f"{type(e).__name__}: {e}".replace(str(path), path.name), None, None, None
    bits = info["bits"] if info.get("bits", 16) < 16 and not info.get("declared") else None
    return None, (int(x.shape[-1]), int(x.shape[-2])), bits, ";".join(info.get("steps") or []) or None


def decode_error(path: Path) -> str | None:
    """Fully decode one image (every pixel); None when it decodes, else why not."""
    return decode_image(path)[0]


class DecodeCache:
    """``(path, size, mtime_ns) -> (error or None, width, height, assumed bits, DICOM steps)`` in SQLite (safe with
    several processes). The table is ``decodes`` (a cache written before the sizes, bits and steps were kept,
    table ``decoded``, ``images`` or ``pixels``, is not read: each image is decoded once more)."""

    def __init__(self, file: str | os.PathLike | None):
        self.file = None if file is None else Path(file)
        self._db = None
        if self.file is not None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._db = sqlite3.connect(str(self.file), timeout=60)
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS decodes (path TEXT, size INTEGER, mtime INTEGER, error TEXT, "
                    "width INTEGER, height INTEGER, bits INTEGER, steps TEXT, PRIMARY KEY (path, size, mtime))"
                )
            except sqlite3.Error as e:
                raise OSError(f"cannot open the decode cache {self.file} ({e}){cache_hint(self.file)}") from None

    def get(self, keys: Sequence[tuple[str, int, int]]) -> dict[tuple[str, int, int], Decoded]:
        if self._db is None or not keys:
            return {}
        out = {}
        cur = self._db.cursor()
        for k in keys:
            row = cur.execute(
                "SELECT error, width, height, bits, steps FROM decodes WHERE path=? AND size=? AND mtime=?", k
            ).fetchone()
            if row is not None:
                out[k] = (row[0], None if row[1] is None else (row[1], row[2]), row[3], row[4])
        return out

    def put(self, items: Iterable[tuple[tuple[str, int, int], Decoded]]) -> None:
        if self._db is None:
            return
        rows = [(*k, e, *(size or (None, None)), bits, steps) for k, (e, size, bits, steps) in items]
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO decodes VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


@dataclass
class Unreadable:
    image: str
    file: str
    line: int | None
    error: str


def decode_all(
    paths: Sequence[Path],
    cache: DecodeCache,
    workers: int | None = None,
    sizes: list[tuple[int, int] | None] | None = None,
    bits: list[int | None] | None = None,
    steps: list[str | None] | None = None,
) -> list[str | None]:
    """The decode error (or None) of every path, decoding only those the cache does not know; ``sizes``, when
    given, receives each image's ``(width, height)`` from its decode (None where it does not decode), ``bits``
    the significant bits assumed for it, ``steps`` its DICOM decoding steps (:func:`decode_image`)."""
    keys = []
    for p in paths:
        st = p.stat()
        keys.append((str(p.resolve()), int(st.st_size), int(st.st_mtime_ns)))
    known = cache.get(keys)
    todo = [i for i, k in enumerate(keys) if k not in known]
    if todo:
        with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
            results = list(pool.map(decode_image, (paths[i] for i in todo), chunksize=16))
        new = {keys[i]: r for i, r in zip(todo, results)}
        cache.put(new.items())
        known.update(new)
    if sizes is not None:
        sizes[:] = [known[k][1] for k in keys]
    if bits is not None:
        bits[:] = [known[k][2] for k in keys]
    if steps is not None:
        steps[:] = [known[k][3] for k in keys]
    return [known[k][0] for k in keys]


def dicom_steps(table: SourceTable, rows: Sequence[int], steps: Sequence[str | None]) -> None:
    """What the decoding did to DICOM images beyond their rescale (:data:`DICOM_STEPS`: MONOCHROME1 inverted, a
    window or VOI LUT applied, the RSNA ICH repair): one line in ``table.notes`` per step, with the count and the
    first :data:`NOTE_EXAMPLES` names. ``steps``: those the decode pass found, of the frame's ``rows``."""
    names = table.frame["image"].astype(str).to_numpy()
    by_step: dict[str, list[str]] = {}
    for i, joined in zip(rows, steps):
        for step in (joined or "").split(";"):
            if step:
                by_step.setdefault(step, []).append(names[i])
    for step in DICOM_STEPS:
        found = by_step.get(step, [])
        if found:
            shown = ", ".join(found[:NOTE_EXAMPLES])
            more = f", ... {len(found) - NOTE_EXAMPLES} more" if len(found) > NOTE_EXAMPLES else ""
            table.notes.append(
                f"{table.name}: {len(found)} DICOM image(s) ({shown}{more}) {DICOM_STEPS[step]}; the image store, "
                "fedpartial-predict and an exported bundle decode them alike"
            )


def assumed_depths(table: SourceTable, rows: Sequence[int], bits: Sequence[int | None]) -> None:
    """Images of more than 8 bits per sample with no ``sBIT`` chunk, read as fewer bits than their container's
    16 (:func:`decode_image`): one WARNING line in ``table.notes`` per depth assumed, with their count and the
    first :data:`NOTE_EXAMPLES` names (one line for 10^5 images), saying what was done and how to say otherwise.
    ``bits``: those the decode pass found, of the frame's ``rows``."""
    names = table.frame["image"].astype(str).to_numpy()
    by_bits: dict[int, list[str]] = {}
    for i, b in zip(rows, bits):
        if b is not None:
            by_bits.setdefault(int(b), []).append(names[i])
    for b, found in sorted(by_bits.items()):
        shown = ", ".join(found[:NOTE_EXAMPLES])
        more = f", ... {len(found) - NOTE_EXAMPLES} more" if len(found) > NOTE_EXAMPLES else ""
        table.notes.append(
            f"WARNING {table.name}: {len(found)} image(s) of 16 bits per sample hold values of only {b} bits and no "
            f"sBIT chunk says how many bits are significant ({shown}{more}): each is read as {b}-bit (its values / "
            f"{2**b - 1:,}; a 16-bit image scaled by 65,535 would be nearly black), in the image store, "
            "fedpartial-predict and an exported bundle alike; if they are 16-bit images that are merely dark, "
            "export them with an sBIT chunk of 16"
        )


def degenerate_sizes(table: SourceTable, rows: Sequence[int], sizes: Sequence[tuple[int, int] | None]) -> None:
    """Images whose shorter side is under :data:`MIN_SIDE` px or whose sides differ more than :data:`MAX_ASPECT`
    times: one line in ``table.notes`` (their count and the first five, each with its size and line), the images
    kept. ``sizes``: those the decode pass read, of the frame's ``rows``."""
    names = table.frame["image"].astype(str).to_numpy()
    lines = table.row_lines()
    odd = [
        (i, w, h)
        for i, size in zip(rows, sizes)
        if size is not None
        for w, h in [size]
        if min(w, h) < MIN_SIDE or max(w, h) > MAX_ASPECT * max(1, min(w, h))
    ]
    if not odd:
        return
    shown = ", ".join(f"{names[i]} {w} x {h} px" + (f" (line {lines[i]})" if lines[i] else "") for i, w, h in odd[:5])
    more = f", ... {len(odd) - 5} more" if len(odd) > 5 else ""
    table.notes.append(
        f"{table.name}: {len(odd)} image(s) of a degenerate size (shorter side under {MIN_SIDE} px, or one side "
        f"over {MAX_ASPECT} times the other): {shown}{more}; they are kept, resized to the job's input: check the "
        "export (an icon, a placeholder, a strip?) and --exclude any that is no scan"
    )


def duplicate_groups(paths: Sequence[Path], sizes: Sequence[int], probe: int = 65536) -> list[list[int]]:
    """Groups (positions into ``paths``) of byte-identical files, each of two or more. Only files of one size are
    compared: first by the sha256 of their first and last ``probe`` bytes, then in full (a release of fixed-size
    files, e.g. uncompressed DICOM, differs in its headers; a 10^5-file JPEG release has few equal sizes)."""
    import hashlib

    def digest(i: int, whole: bool) -> str:
        h = hashlib.sha256()
        with open(paths[i], "rb") as f:
            if whole or sizes[i] <= 2 * probe:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                h.update(f.read(probe))
                f.seek(-probe, os.SEEK_END)
                h.update(f.read(probe))
        return h.hexdigest()

    def group(items: list[int], whole: bool) -> list[list[int]]:
        found: dict[str, list[int]] = {}
        for i in items:
            found.setdefault(digest(i, whole), []).append(i)
        return [g for g in found.values() if len(g) > 1]

    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        by_size.setdefault(int(n), []).append(i)
    out = []
    for size, same in by_size.items():
        if len(same) < 2:
            continue
        for g in group(same, whole=False):
            out += [g] if size <= 2 * probe else group(g, whole=True)  # a small file's probe is all of it
    return out


def merge_duplicate_patients(table: SourceTable, keep: np.ndarray, paths: Sequence[Path]) -> None:
    """Exact duplicate files under other names (:func:`duplicate_groups`) become one patient (the first's id), so
    the split keeps them together; reported in ``table.notes``."""
    idx = np.flatnonzero(keep)
    if len(idx) < 2:
        return
    sizes = [paths[i].stat().st_size for i in idx]
    groups = [[int(idx[j]) for j in g] for g in duplicate_groups([paths[i] for i in idx], sizes)]
    if not groups:
        return
    pid = table.frame["patient_id"].astype(str).to_numpy().copy()
    lines = table.row_lines()
    names = table.frame["image"].astype(str).to_numpy()
    merged = 0
    for g in groups:
        others = {pid[i] for i in g} - {pid[g[0]]}
        if others:
            pid[np.isin(pid, list(others))] = pid[g[0]]
            merged += 1
    if merged:
        table.frame = table.frame.assign(patient_id=pid)
    shown = "; ".join(
        " = ".join(f"{names[i]}" + (f" (line {lines[i]})" if lines[i] else "") for i in g) for g in groups[:3]
    )
    more = f"; ... {len(groups) - 3} more group(s)" if len(groups) > 3 else ""
    table.notes.append(
        f"{table.name}: {sum(len(g) for g in groups)} image(s) are byte-identical copies in "
        f"{len(groups)} group(s): {shown}{more}; each group is kept in one split (its patients are "
        "one patient); remove the copies or --exclude them"
    )
    conflicting_copies(table, groups)


def label_text(values: np.ndarray, classes: Sequence[str], task: str) -> str:
    """One row's labels in words: single-label ``'MEL'`` / ``'unlabelled'`` / ``'none of the classes'``;
    multi-label ``'Effusion+Mass'`` / ``'no finding'``, with the classes not annotated in the row."""
    pos = [c for c, v in zip(classes, values) if v == 1]
    unknown = [c for c, v in zip(classes, values) if v < 0]
    if len(unknown) == len(classes):
        return "unlabelled"
    if task == "multiclass":
        return pos[0] if pos else "none of the classes"
    return ("+".join(pos) or "no finding") + (f" ({', '.join(unknown)} not annotated)" if unknown else "")


def conflicting_copies(table: SourceTable, groups: Sequence[Sequence[int]]) -> None:
    """Byte-identical copies whose labels disagree on a class both annotate: one line in ``table.notes`` naming
    each such group's files, lines and labels (the first three groups; one image cannot be both)."""
    values = table.frame[table.classes].to_numpy(np.int64)
    names = table.frame["image"].astype(str).to_numpy()
    lines = table.row_lines()
    bad = []
    for g in groups:
        v = values[list(g)]
        both = (v[:, None, :] >= 0) & (v[None, :, :] >= 0)  # a class two copies annotate
        if (both & (v[:, None, :] != v[None, :, :])).any():
            bad.append(g)
    if not bad:
        return
    shown = "; ".join(
        " vs ".join(
            f"{names[i]}"
            + (f" (line {lines[i]})" if lines[i] else "")
            + f": {label_text(values[i], table.classes, table.task)}"
            for i in g
        )
        for g in bad[:3]
    )
    more = f"; ... {len(bad) - 3} more group(s)" if len(bad) > 3 else ""
    table.notes.append(
        f"{table.name}: {len(bad)} group(s) of byte-identical images have conflicting labels: {shown}{more}; "
        "one image cannot be both: correct the labels, or --exclude the wrong copy"
    )


def read_exclude(exclude: str | os.PathLike | Sequence[str] | None) -> set[str]:
    """An exclude list: a file (one image name or relative path per line, '#' comments) or names."""
    if exclude is None:
        return set()
    items: list[str]
    if isinstance(exclude, (str, os.PathLike)) and Path(exclude).is_file():
        items = Path(exclude).read_text(encoding="utf-8-sig").splitlines()
    elif isinstance(exclude, (str, os.PathLike)):
        items = [s for s in str(exclude).split(",")]
    else:
        items = list(exclude)
    return {s.split("#", 1)[0].strip() for s in items} - {""}


def _excluded(
    table: SourceTable, names: pd.Series, lines: list, exclude: set[str], matched_out: set[str] | None
) -> np.ndarray:
    """The rows ``exclude`` leaves (by path, file name, stem or image id), the others recorded as dropped; an
    entry that matches no row is an error (with ``matched_out``, a federation's: collected there instead)."""
    frame = table.frame
    base = names.map(lambda p: Path(p).name)
    stem = names.map(lambda p: Path(p).stem)
    hit = (names.isin(exclude) | base.isin(exclude) | stem.isin(exclude)).to_numpy().copy()
    if "image_id" in frame.columns:
        hit |= frame["image_id"].astype(str).isin(exclude).to_numpy()
    matched = set(names[hit]) | set(base[hit]) | set(stem[hit])
    if "image_id" in frame.columns:
        matched |= set(frame["image_id"].astype(str)[hit])
    unused = sorted(exclude - matched)
    if matched_out is not None:
        matched_out |= exclude & matched
    elif unused:
        raise SourceError(
            f"--exclude names {len(unused)} image(s) the source does not have: {unused[:5]}",
            hint="give file names, ids or paths relative to --root as the release writes them",
        )
    if hit.any():
        table.dropped.append(
            Dropped("--exclude", "were excluded", names[hit].tolist(), [lines[i] for i in np.flatnonzero(hit)])
        )
    keep = ~hit
    keep = keep.copy()
    return keep


def quality_pass(
    table: SourceTable,
    decode: bool = True,
    drop_unreadable: bool = False,
    exclude: set[str] | None = None,
    cache_file: str | os.PathLike | None = None,
    matched_out: set[str] | None = None,
) -> SourceTable:
    """Apply ``exclude``, check that every image exists and (``decode``) fully decodes.

    Returns:
        The table without the excluded rows (and, with ``drop_unreadable``, without unreadable ones), each
        leaving recorded in ``table.dropped``.

    Raises:
        SourceError: an unreadable or missing image (without ``drop_unreadable``), naming the source file, its
            line and the image; an ``exclude`` entry that matches no row.
    """
    frame = table.frame
    lines = table.row_lines()
    files = table.row_files()
    names = frame["image"].astype(str)
    if exclude:
        keep = _excluded(table, names, lines, exclude, matched_out)
    else:
        keep = np.ones(len(frame), bool)
    root = table.root
    paths = [root / p for p in names]
    bad: list[Unreadable] = []
    exists = np.array([keep[i] and paths[i].is_file() for i in range(len(paths))])
    for i in np.flatnonzero(keep & ~exists):
        bad.append(Unreadable(names.iloc[i], files[i], lines[i], "image file not found"))
    merge_duplicate_patients(table, keep & exists, paths)  # a copy under another name never straddles splits
    frame = table.frame
    if decode:
        idx = np.flatnonzero(keep & exists)
        cache = DecodeCache(cache_file)
        sizes: list[tuple[int, int] | None] = []
        bits: list[int | None] = []
        steps: list[str | None] = []
        try:
            errors = decode_all([paths[i] for i in idx], cache, sizes=sizes, bits=bits, steps=steps)
        finally:
            cache.close()
        degenerate_sizes(table, idx, sizes)  # the sizes the decode read: no file is opened again
        assumed_depths(table, idx, bits)
        dicom_steps(table, idx, steps)
        for i, e in zip(idx, errors):
            if e is not None:
                bad.append(Unreadable(names.iloc[i], files[i], lines[i], e))
    if bad and not drop_unreadable:
        b = bad[0]
        more = f" ({len(bad) - 1} more unreadable image(s): {[x.image for x in bad[1:4]]})" if len(bad) > 1 else ""
        raise SourceError(
            f"image {b.image} cannot be used: {b.error}{more}",
            b.file or None,
            b.line,
            hint="replace the file, list it in --exclude, or pass --drop-unreadable",
        )
    if bad:
        table.dropped.append(
            Dropped(
                bad[0].file,
                "have an unreadable or missing image (--drop-unreadable)",
                [b.image for b in bad],
                [b.line or 0 for b in bad],
            )
        )
        unreadable = {b.image for b in bad}
        keep &= ~names.isin(unreadable).to_numpy()
    if not keep.all():
        table = SourceTable(
            table.name,
            table.task,
            table.classes,
            table.root,
            frame[keep].reset_index(drop=True),
            table.synthetic,
            table.dropped,
            table.files,
            None if table.lines is None else [l for l, k in zip(table.lines, keep) if k],
            table.notes,
        )
    if table.frame.empty:
        raise SourceError(f"{table.name}: no usable image is left", hint="check --exclude and the image folders")
    return table
