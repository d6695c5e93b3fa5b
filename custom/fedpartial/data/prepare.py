"""Turn a source dataset into per-site manifests under a label protocol.

``prepare(...)`` (its command line, ``fedpartial-prepare``, is :mod:`fedpartial.data.prepare_cli`) loads a
source, optionally keeps a class subset, splits the patients into train / val / test, deals the training patients
IID over ``num_sites`` disjoint sites and blanks, in each site's manifest, the class columns the protocol does not
give that site. Output folder::

    site-1.csv ... site-N.csv   training rows of each site (split 'train'); empty cell = not annotated
    val.csv, test.csv           fully labelled, shared by all sites (split 'val' / 'test')
    dataset.json                classes, task, data_root, protocol, per-site annotated classes and counts

Everything is written into a temporary sibling folder, validated with :func:`read_manifest` /
:func:`check_coverage` and renamed into place at the end, so a failed run leaves nothing behind; a folder prepared
again (``overwrite``) is exchanged with the old one in one atomic step where Linux allows it, so a site reading it
meanwhile sees the old folder or the new one, never neither or a mix.
Two options model the surgical-aggregation paper's settings: ``vocabularies`` writes some sites' manifests in
another label vocabulary (``{"site-3": "chexpert"}``: CheXpert's column names; ``dataset.json`` records each such
site's ``{its column: global class}`` map, which the simulator applies as a site configuration's ``columns``
would), and ``centralise`` pools every site's training rows, each with the labels its site annotates, into one
site (the centralised baseline: missing labels become negatives under ``fedavg``).

Before any split, a quality pass (:mod:`fedpartial.data.quality`) applies ``exclude``, checks that every image
exists and decodes it fully (cached by path, size and mtime); a bad image is an error at its line of the
release's CSV, and every row left out (missing image, view filter, class outside the list, ``exclude``) is
reported (count, first names and lines) and recorded under ``dropped``. ``sources`` federates several releases
(each keeps its sites and column names), ``partition`` deals training patients IID, by centre, with Dirichlet
label skew or quantity skew (:mod:`fedpartial.data.partition`), and ``label_structure.png``
(:mod:`fedpartial.data.prepare_figure`, matplotlib) shows positives / annotated / unlabelled per class and site.
The layouts and commands of each release: ``docs/datasets.md``.

``ensure_prepared(spec, cache_dir)`` is the simulator's prepare-on-first-use (cached by a hash of the spec,
checked against the size and mtime of the release's label files, guarded by a file lock).

This module is the library a site imports (:mod:`fedpartial.data.site_config` runs ``ensure_prepared``): no
command line, no matplotlib.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from .cache import cache_dir
from .catalog import DATASETS
from .manifest import ManifestError, check_coverage, read_manifest, write_manifest
from .partition import (
    PARTITIONS,
    by_centre,
    cut_index,
    dirichlet_label_skew,
    quantity_skew,
    split_patients,
    split_sites,
)  # noqa: F401
from .prepared import (  # noqa: F401
    DATASET_JSON,
    NOT_HASHED,
    PreparedDataset,
    canonical_spec,
    check_job_classes,
    file_stamps,
    load_prepared,
    prepared_path,
    site_name,
    spec_hash,
    stale_sources,
)
from .protocols import assign
from .quality import quality_pass, read_exclude
from .settings import OPTION_GROUPS, ImageOptions, LabelOptions, SplitOptions, prepare_options  # noqa: F401
from .sources import SourceTable, load_source
from .sources.base import NOT_ANNOTATED, Dropped, SourceError, most_frequent_classes, spelling_key
from .vocabulary import (
    VOCABULARIES,
    closest,
    invert,
    match_classes,
    resolve_vocabulary,
)

PUBLISHED_SOURCES = (*(name for name, d in DATASETS.items() if d.published), "csv", "folder")
"""Sources read from a release's folder (--root required); the others are generated into the output folder."""
CENTRE_ORDER = tuple(dict.fromkeys(c for d in DATASETS.values() for c in d.centres))
"""The order of the centres the named datasets record (partition ``centre``; FLamby's for Fed-ISIC2019)."""
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------- class subset

EXPORT_SOURCES = ("csv", "folder")
"""A hospital's own export: a class of it outside the federation's vocabulary is refused (a release's other classes
are a subset choice)."""


def _match_subset(
    table: SourceTable, classes: Sequence[str], alone: bool, export: bool
) -> tuple[list[str], dict[str, str], list[str]]:
    """:func:`subset_classes`' choice: the wanted classes in order, ``{source column: wanted class}`` and the
    wanted classes the source lacks (``alone``); the errors of :func:`subset_classes`."""
    wanted = list(dict.fromkeys(classes))
    if not wanted:
        raise ValueError("empty class subset")
    twice = [(a, b) for i, a in enumerate(wanted) for b in wanted[i + 1 :] if spelling_key(a) == spelling_key(b)]
    if twice:
        raise ValueError(
            f"the classes {twice[0][0]!r} and {twice[0][1]!r} differ only in case or spaces: one class or two? "
            "give each class once"
        )
    found = match_classes(wanted, table.classes)
    absent = [c for c, col in found.items() if col is None]
    if absent and not alone:
        raise ValueError(
            f"unknown class(es) {absent}{closest(absent[0], table.classes)}; {table.name} has {table.classes}"
        )
    used = {col for col in found.values() if col is not None}
    if not used:
        raise ValueError(
            f"{table.name} has none of the classes {wanted} (it has {table.classes}): this site would annotate nothing"
        )
    extra = [c for c in table.classes if c not in used]
    if alone and export and extra:
        raise ValueError(
            f"{table.name}: class {extra[0]!r}{closest(extra[0], wanted)} is not in the "
            f"federation's classes {wanted}"
            + (f" ({len(extra) - 1} more: {extra[1:6]})" if len(extra) > 1 else "")
            + (
                "; a folder of images of no class of the federation: move it out of --root"
                if table.name == "folder"
                else "; a column that is no class: --source-arg ignore_columns=NAME"
            )
        )
    renamed = {col: c for c, col in found.items() if col is not None}
    return wanted, renamed, absent


def subset_classes(
    table: SourceTable,
    classes: Sequence[str] | None = None,
    top_k: int | None = None,
    alone: bool = False,
    export: bool = False,
) -> SourceTable:
    """The table in the federation's vocabulary: ``classes``, in that order, matched to the source's class names
    exactly or case-insensitively (renamed to the vocabulary's spelling).

    Args:
        table: the source.
        classes: the class list (``None``: the source's).
        top_k: then keep the ``top_k`` most frequent of those (FedMLP's 8 most frequent CXR14 findings).
        alone: one site prepared on its own (``--sites 1``): a class of ``classes`` the source lacks is *not
            annotated here* (a column of ``NOT_ANNOTATED``), not an error.
        export: the source is a hospital's own export (``csv`` / ``folder``): with ``alone``, a class of it outside
            ``classes`` is an error naming it (a release's other classes are left out, reported).

    Multi-label rows keep only the chosen columns (a row may become all-negative). Single-label rows whose
    positive class is left out are removed (reported); rows with no positive (an image of a class this site does
    not annotate) and unlabelled rows stay.

    Raises:
        ValueError: a class the source lacks (unless ``alone``), with the closest name; an export's class outside
            ``classes`` (``alone``); no class of ``classes`` in the source.
    """
    if classes is None and top_k is None:
        return table
    chosen, renamed, absent = list(table.classes), {}, []
    if classes is not None:
        chosen, renamed, absent = _match_subset(table, classes, alone, export)
    frame = table.frame
    dropped_cols = [c for c in table.classes if c not in renamed and classes is not None]
    lines = table.lines
    if table.task == "multiclass" and dropped_cols:
        outside = (frame[dropped_cols] == 1).any(axis=1).to_numpy()
        if outside.any():
            gone = frame[outside]
            table.dropped.append(
                Dropped(
                    table.files[0] if table.files else table.name,
                    f"are of a class outside {chosen}",
                    gone["image"].astype(str).tolist(),
                    gone["line"].astype(int).tolist() if "line" in gone else [],
                )
            )
            lines = None if lines is None else [l for l, k in zip(lines, ~outside) if k]
            frame = frame[~outside]
    frame = frame.drop(columns=dropped_cols).rename(columns=renamed)
    for c in absent:
        frame[c] = NOT_ANNOTATED
    rest = [c for c in frame.columns if c not in chosen]
    frame = frame[rest + chosen].reset_index(drop=True)
    sub = SourceTable(
        table.name,
        table.task,
        chosen,
        table.root,
        frame,
        table.synthetic,
        table.dropped,
        table.files,
        lines,
        table.notes,
    )
    if top_k is not None:
        keep = most_frequent_classes(sub, int(top_k))
        sub = subset_classes(sub, keep)
    return sub


def check_rows_have_class(table: SourceTable) -> None:
    """Single-label: a row ``0`` in every class of the vocabulary names no class; an error at its line. (A row with
    some class not annotated here is an image of such a class; a row blank in every class is unlabelled.)"""
    if table.task != "multiclass" or not table.classes:
        return
    values = table.frame[table.classes].to_numpy(np.int64)
    bad = np.flatnonzero((values == 0).all(axis=1))
    if len(bad):
        i = int(bad[0])
        line = table.row_lines()[i]
        raise SourceError(
            f"row of {table.frame['image'].iloc[i]!r} is 0 in every class {table.classes} but the task "
            "is single-label (a row needs its class)",
            table.files[0] if table.files else None,
            line,
            hint="give the row its class, or leave its cells blank (an unlabelled image)",
        )


# ---------------------------------------------------------------------------------------------------- prepare


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _counts(labels: np.ndarray, mask: np.ndarray, classes: Sequence[str]) -> dict[str, int | None]:
    """Labelled positives per class (None where the class is not annotated)."""
    pos = (labels * mask).sum(axis=0)
    annotated = mask.any(axis=0) if len(mask) else np.zeros(len(classes), bool)
    return {c: (int(pos[j]) if annotated[j] else None) for j, c in enumerate(classes)}


def manifests_fingerprint(folder: Path, info: dict) -> str:
    """sha256 (first 16 hex digits) of the manifests' bytes (image paths relative to the data root, labels,
    patients, splits): the same export prepared the same way gives the same value, on any machine."""
    h = hashlib.sha256()
    for name in sorted(info["files"]):
        h.update(name.encode() + b"\0" + (folder / info["files"][name]).read_bytes())
    return h.hexdigest()[:16]


def annotated_line(info: dict, site: str = "site-1") -> str:
    """What a site prepared alone annotates: ``site-1 annotates 2 of 7 classes: MEL, NV; not annotated here: ...;
    unlabelled images: N``."""
    classes, ann = info["classes"], info["sites"][site]
    rest = [c for c in classes if c not in ann]
    return (
        f"{site} annotates {len(ann)} of {len(classes)} classes: {', '.join(ann)}"
        + (f"; not annotated here: {', '.join(rest)}" if rest else "")
        + f"; unlabelled training images: {(info.get('unlabelled') or {}).get(site, 0)}"
        + " (the job's data check verifies that every class is annotated by some site)"
    )


def format_counts(info: dict) -> str:
    """Per-site table of labelled positives per class ('-' = not annotated), like FedLSM's Tables 5-6."""
    classes = info["classes"]
    rows = list(info["counts"])
    width = max(8, *(len(c) + 1 for c in classes))
    head = f"{'':<8}" + "".join(f"{c:>{width}}" for c in classes) + f"{'images':>{width}}"
    lines = [head]
    for r in rows:
        cells = ["-" if info["counts"][r][c] is None else str(info["counts"][r][c]) for c in classes]
        lines.append(f"{r:<8}" + "".join(f"{v:>{width}}" for v in cells) + f"{info['sizes'][r]:>{width}}")
    return "\n".join(lines)


def _validate(folder: Path, info: dict, data_root: Path) -> None:
    """Read every manifest back, check coverage and that patients never straddle splits."""
    classes, task = info["classes"], info["task"]
    annotated = {}
    patients: dict[str, set[str]] = {}
    for name, file in info["files"].items():
        m = read_manifest(
            folder / file,
            classes,
            data_root=data_root,
            site=name,
            task=task,
            require_annotated=bool(info["sites"].get(name, True)),
            columns=(info.get("vocabularies") or {}).get(name),
        )
        if name in info["sites"]:
            got = m.annotated_classes()
            if got != info["sites"][name]:
                raise RuntimeError(f"{name}: manifest annotates {got}, protocol says {info['sites'][name]}")
            annotated[name] = m.annotated
        patients[name] = set(m.patient_ids)
    if info.get("alone"):  # one site alone: the job's data check knows the other sites (coverage there)
        if not any(np.asarray(a).any() for a in annotated.values()):
            raise ManifestError(f"the site annotates none of the classes {classes}")
    else:
        check_coverage(annotated, classes)
    site_pat = set().union(*(patients[s] for s in info["sites"]))
    for a, b in (("val", "test"), ("val", None), ("test", None)):
        other = site_pat if b is None else patients[b]
        shared = patients[a] & other
        if shared:
            raise RuntimeError(f"patient(s) {sorted(shared)[:5]} appear in '{a}' and '{b or 'train'}'")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot, and the
    caller falls back to two renames (between which ``b`` is briefly absent)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: Path, final: Path, inside: bool, overwrite: bool) -> None:
    """Move the finished ``tmp`` folder into place (dataset.json last when merging into an existing folder)."""
    if inside:
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == DATASET_JSON):
            os.replace(f, final / f.name)
        tmp.rmdir()
        return
    if final.exists():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        elif overwrite:
            if _exchange(tmp, final):  # one atomic step: a reader sees the old folder or the new one, whole
                shutil.rmtree(tmp, ignore_errors=True)
                return
            trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
            return
        else:
            raise FileExistsError(f"{final} already exists (pass overwrite=True)")
    os.rename(tmp, final)


def _decode_cache_file() -> Path:
    return cache_dir() / "decoded.sqlite"


def _load_one(
    source: str,
    root: Path,
    source_args: dict | None,
    labels: LabelOptions,
    images: ImageOptions,
    exclude: set[str],
    matched: set[str] | None = None,
    alone: bool = False,
) -> SourceTable:
    """Load a source, put it in the federation's vocabulary (:func:`subset_classes`) and run the quality pass
    (``exclude``: the names read from ``images.exclude``; ``matched`` collects those found, for a federation of
    several sources). ``labels.task``: the federation's task, given to a CSV export's loader (its ``task``),
    checked against the others."""
    task = labels.task
    args = dict(source_args or {})
    if task is not None and source == "csv":
        if args.get("task", task) != task:
            raise SourceError(f"--task {task} and --source-arg task={args['task']} disagree")
        args["task"] = task
    table = load_source(source, root, **args)
    if task is not None and table.task != task:
        raise SourceError(
            f"{table.name} is {table.task} ("
            + ("one class folder per image" if source == "folder" else "as published")
            + f") but --task says {task}"
        )
    if table.lines is not None and "line" not in table.frame.columns:
        table.frame = table.frame.assign(line=table.lines)
    table = subset_classes(table, labels.classes, labels.top_k_classes, alone=alone, export=source in EXPORT_SOURCES)
    check_some_labelled(table)  # before any image is decoded, and again after the quality pass left some out
    table = quality_pass(
        table,
        decode=images.decode_images,
        drop_unreadable=images.drop_unreadable,
        exclude=exclude,
        cache_file=_decode_cache_file() if images.decode_images else None,
        matched_out=matched,
    )
    check_some_labelled(table)
    return table


def check_some_labelled(table: SourceTable) -> None:
    """A source none of whose images has a label (every class cell blank or a spelling of a missing value) is an
    error naming its file: it can train nothing, and its validation and test sets would be empty."""
    values = table.frame[table.classes].to_numpy(np.int64)
    if len(values) and (values == NOT_ANNOTATED).all():
        raise SourceError(
            f"none of its {len(values)} image(s) has a label (every label cell is blank or spells a missing "
            f"value) for the classes {table.classes}: the site would train on nothing and score on nothing",
            table.files[0] if table.files else table.name,
            hint="fill in the labels; a label-name column is --source-arg label_column=NAME",
        )


def _group_vocabulary(source: str, given, multi: bool) -> dict[str, str]:
    """``{source column: global class}`` of one source of a federation."""
    if given is None:  # a named dataset's own (a CheXpert-labelled release read in NIH's names)
        own = DATASETS[source].vocabulary if source in DATASETS else None
        return invert(VOCABULARIES[own]) if multi and own else {}
    if isinstance(given, str):
        return invert(resolve_vocabulary(given, list(VOCABULARIES.get(given, {}))))
    return dict(given)


def _distinct_names(names: list[str], loaders: list[str]) -> None:
    """Refuse a federation in which two sources have one name: the name prefixes their patient ids, so a patient id
    both hold (two hospitals' ``P1``) would be one patient in the split."""
    first: dict[str, int] = {}
    for k, (name, loader) in enumerate(zip(names, loaders), 1):
        if name not in first:
            first[name] = k
            continue
        j = first[name]
        how = (
            f"give each its own source_name (--source-arg {k}:source_name=NAME names source {k}, counting the "
            "--source options; in a job, its source_args.source_name)"
            if {loaders[j - 1], loader} & {"csv", "folder"}
            else "a release is federated once: give it more sites (--sites) instead"
        )
        raise SourceError(
            f"sources {j} and {k} are both named {name!r}, the prefix of their patient ids (a patient "
            f"id both hold would be one patient): {how}"
        )


def _combine(
    tables: list[SourceTable], vocabs: list[dict[str, str]], classes: Sequence[str] | None
) -> tuple[SourceTable, list[np.ndarray]]:
    """Several sources -> one table over global classes (cells a source lacks = ``NOT_ANNOTATED``), images
    relative to the sources' common folder, patient ids prefixed by source; returns (table, row mask per source)."""
    import pandas as pd  # imported where used: a site process imports this module at start-up

    tasks = {t.task for t in tables}
    if len(tasks) > 1:
        raise SourceError(f"the sources mix tasks {sorted(tasks)}; a federation needs one task")
    mapped = [[v.get(c, c) for c in t.classes] for t, v in zip(tables, vocabs)]
    union: list[str] = []
    for m in mapped:
        union += [c for c in m if c not in union]
    if classes is not None:
        unknown = [c for c in classes if c not in union]
        if unknown:
            raise SourceError(f"class(es) {unknown} are in none of the sources; they have {union}")
        union = list(classes)
    common = Path(os.path.commonpath([str(t.root.resolve()) for t in tables]))
    parts, masks, files, dropped = [], [], [], []
    for k, (t, m) in enumerate(zip(tables, mapped)):
        f = t.frame
        prefix = (t.root.resolve()).relative_to(common)
        part = pd.DataFrame(
            {
                "image": [(prefix / p).as_posix() for p in f["image"]],
                "patient_id": [f"{t.name}:{p}" for p in f["patient_id"]],
                "official_split": f["official_split"] if "official_split" in f.columns else "",
                "line": t.row_lines(),
                "label_file": t.row_files(),
                "group": k,
            }
        )
        for c in union:
            part[c] = f[t.classes[m.index(c)]].to_numpy() if c in m else NOT_ANNOTATED
        parts.append(part)
        files += t.files
        dropped += t.dropped
    frame = pd.concat(parts, ignore_index=True)
    masks = [(frame["group"] == k).to_numpy() for k in range(len(tables))]
    table = SourceTable(
        "+".join(t.name for t in tables),
        tables[0].task,
        union,
        common,
        frame,
        any(t.synthetic for t in tables),
        dropped,
        files,
    )
    return table, masks


def _val_from_train(patient_ids: Sequence[str], val_frac: float, seed: int) -> np.ndarray:
    """Boolean ``(N,)``: the rows (whole patients) carved out of a publisher's train list as val."""
    pids = np.asarray([str(p) for p in patient_ids])
    uniq, inverse, sizes = np.unique(pids, return_inverse=True, return_counts=True)
    order = np.random.default_rng([1, seed]).permutation(len(uniq))
    cum = np.concatenate([[0], np.cumsum(sizes[order])])
    n_val = cut_index(cum, val_frac * len(pids), 1, max(1, len(uniq) - 1))
    is_val = np.zeros(len(uniq), bool)
    is_val[order[:n_val]] = True
    return is_val[inverse]


def _group_split(frame: pd.DataFrame, rows: np.ndarray, val_frac: float, test_frac: float, seed: int) -> np.ndarray:
    """'train' / 'val' / 'test' for ``rows`` of the frame: the publisher's split where the loader read one."""
    pids = frame["patient_id"].astype(str).to_numpy()[rows]
    official = frame["official_split"].astype(str).to_numpy()[rows] if "official_split" in frame else None
    if official is None or not (official != "").any():
        return split_patients(pids, val_frac, test_frac, seed)
    out = official.astype(object)
    train = np.flatnonzero(out == "train")
    if not (out == "val").any() and len(train):
        out[train[_val_from_train(pids[train], val_frac, seed)]] = "val"
    for s in ("train", "val", "test"):
        if not (out == s).any():
            raise SourceError(f"the publisher's split leaves '{s}' empty for this selection")
    return out.astype(str)


def _partition(
    frame: pd.DataFrame,
    train: np.ndarray,
    n: int | None,
    partition: str,
    seed: int,
    site_sizes,
    classes: list[str],
    alpha: float,
    centre_order: Sequence[str] | None,
) -> tuple[list[np.ndarray], list[str] | None]:
    """Training rows per site of one group (positions into the frame), and the centre names (centre partition)."""
    pids = frame["patient_id"].astype(str).to_numpy()[train]
    if partition == "iid":
        return [train[r] for r in split_sites(pids, n, seed, site_sizes)], None
    if partition == "centre":
        if "centre" not in frame.columns:
            recording = ", ".join(name for name, d in DATASETS.items() if d.centres)
            raise SourceError(f"partition 'centre' needs a source that records each image's centre ({recording})")
        rows, names = by_centre(frame["centre"].astype(str).to_numpy()[train], n, centre_order)
        return [train[r] for r in rows], names
    if partition == "dirichlet":
        labels = frame[classes].to_numpy(np.int64)[train]
        return [train[r] for r in dirichlet_label_skew(pids, labels, n, alpha, seed)], None
    if partition == "quantity":
        return [train[r] for r in quantity_skew(pids, n, alpha, seed)], None
    raise SourceError(f"unknown partition {partition!r}; known: {list(PARTITIONS)}")


def _structure(labels: np.ndarray, mask: np.ndarray, classes: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per class: positives, annotated rows and unlabelled rows."""
    ann = mask.sum(axis=0)
    pos = (labels * mask).sum(axis=0)
    return {
        c: {"positives": int(pos[j]), "annotated": int(ann[j]), "unlabelled": int(len(mask) - ann[j])}
        for j, c in enumerate(classes)
    }


def format_structure(info: dict) -> str:
    """Per site and class ``positives/annotated`` (``-`` = not annotated) and the unlabelled rows."""
    classes = info["classes"]
    width = max(10, *(len(c) + 1 for c in classes))
    lines = [f"{'':<8}" + "".join(f"{c:>{width}}" for c in classes)]
    for site, per in info.get("structure", {}).items():
        cells = [f"{per[c]['positives']}/{per[c]['annotated']}" if per[c]["annotated"] else "-" for c in classes]
        lines.append(f"{site:<8}" + "".join(f"{v:>{width}}" for v in cells))
    return "\n".join(lines)


def _is_exclude_file(exclude) -> bool:
    return isinstance(exclude, (str, os.PathLike)) and Path(exclude).is_file()


def _check_out(final: Path, inside: bool, overwrite: bool) -> None:
    """Refuse an output folder that holds a prepared dataset or anything else (unless ``overwrite``, or the
    source lives inside it)."""
    if not overwrite and (final / DATASET_JSON).exists():
        raise FileExistsError(f"{final} already holds a prepared dataset (pass overwrite=True / --overwrite)")
    if not overwrite and not inside and final.exists() and any(final.iterdir()):
        raise FileExistsError(f"{final} exists and is not empty (pass overwrite=True / --overwrite)")


def _load_federation(
    sources: Sequence[dict],
    num_sites: int | None,
    labels: LabelOptions,
    images: ImageOptions,
    excluded: set,
) -> tuple[SourceTable, list]:
    """Several published sources as one table and its groups (:func:`_build`'s ``groups``): each source's sites
    hold only its images and keep its column names."""
    tables, vocabs, groups, matched = [], [], [], set()
    # the names the loaders will give (a CSV / folder: its source_name), refused before any is read
    if all(isinstance(s, dict) for s in sources):
        _distinct_names(
            [str((s.get("source_args") or {}).get("source_name") or s.get("source")) for s in sources],
            [str(s.get("source")) for s in sources],
        )
    for spec in sources:
        unknown = sorted(set(spec) - {"source", "root", "num_sites", "source_args", "vocabulary"})
        if unknown or "source" not in spec or "root" not in spec:
            raise SourceError(
                f"a federation source needs 'source' and 'root' (and 'num_sites', "
                f"'source_args', 'vocabulary'); got {sorted(spec)}"
            )
        t = _load_one(
            spec["source"],
            Path(spec["root"]).expanduser().resolve(),
            spec.get("source_args"),
            LabelOptions(task=labels.task),
            images,
            excluded,
            matched,
        )
        tables.append(t)
        vocabs.append(_group_vocabulary(spec["source"], spec.get("vocabulary"), True))
        groups.append(int(spec.get("num_sites", 1)))
    _distinct_names([t.name for t in tables], [spec["source"] for spec in sources])  # the names loaded
    if excluded - matched:
        raise SourceError(
            f"--exclude names {len(excluded - matched)} image(s) none of the sources has: "
            f"{sorted(excluded - matched)[:5]}"
        )
    table, masks = _combine(tables, vocabs, labels.classes)
    if num_sites is not None and num_sites != sum(groups):
        raise SourceError(f"the sources' num_sites add up to {sum(groups)}, not {num_sites}")
    group_specs = [
        (n, m, {g: l for l, g in vocabs[k].items() if g in table.classes})
        for k, (n, m) in enumerate(zip(groups, masks))
    ]
    return table, group_specs


def _load_single(
    source: str,
    root: Path | None,
    tmp: Path,
    num_sites: int | None,
    source_args: dict | None,
    labels: LabelOptions,
    images: ImageOptions,
    excluded: set,
) -> tuple[SourceTable, list, bool]:
    """One source as a table, its one group (:func:`_build`'s ``groups``) and whether it is one site prepared on
    its own (``alone``); a generated source is generated into ``tmp / "source"``."""
    if root is None and source in PUBLISHED_SOURCES:
        raise SourceError(
            f"source {source!r} needs its folder: --root (a job's dataset.prepare.root), the "
            "folder of the published release",
            hint="see docs/datasets.md for each layout",
        )
    if root is None:
        root = tmp / "source"
    alone = num_sites == 1 and not labels.centralise
    table = _load_one(
        source,
        root,
        source_args,
        labels,
        images,
        excluded,
        alone=alone,
    )
    group_specs = [(num_sites, np.ones(len(table.frame), bool), {})]
    return table, group_specs, alone


def _record_inputs(
    info: dict,
    table: SourceTable,
    sources: Sequence[dict] | None,
    labels: LabelOptions,
    images: ImageOptions,
    tmp: Path,
    alone: bool,
) -> None:
    """Add to ``info`` (dataset.json) what the split was made from: the sources, their label files' stamps, the
    notes and the rows left out."""
    info["top_k_classes"] = labels.top_k_classes
    if alone:  # one site, prepared on its own: coverage of the vocabulary is the job's data check's to know
        info["alone"] = True
    info["notes"] = list(table.notes)
    info["sources"] = [
        {
            "source": s["source"],
            "root": str(Path(s["root"]).expanduser().resolve()),
            "num_sites": int(s.get("num_sites", 1)),
            "source_args": s.get("source_args") or {},
        }
        for s in (sources or [])
    ]
    # the release's own label files; a generated source's files live in the folder being written (they move
    # with it, and recording their temporary path would make every later use look stale and prepare again)
    info["source_files"] = file_stamps(
        [f for f in table.files if not Path(f).resolve().is_relative_to(tmp.resolve())]
        + ([str(images.exclude)] if _is_exclude_file(images.exclude) else [])
    )
    info["dropped"] = [
        {"file": d.file, "reason": d.reason, "count": len(d.names), "first": d.names[:10], "lines": d.lines[:10]}
        for d in table.dropped
    ]


def _report(
    final: Path, info: dict, table: SourceTable, source: str, protocol: str, protocol_params: dict, split: SplitOptions
) -> None:
    """The summary ``prepare(verbose=True)`` prints: the split, notes, rows left out, counts and structure."""
    synthetic = " (SYNTHETIC data)" if info["synthetic"] else ""
    print(
        f"prepared {final}{synthetic}: {source}, protocol {protocol} {protocol_params}, "
        f"partition {split.partition}, seed {split.seed}"
    )
    for note in info.get("notes") or []:
        print(note)
    for d in table.dropped:
        print(f"left out: {d.summary()}")
    if info.get("alone"):
        print(annotated_line(info))
    print("labelled positives per class ('-' = not annotated):")
    print(format_counts(info))
    print(
        "label structure per site: positives/annotated per class ('-' = not annotated); unlabelled = rows "
        "without a label for the class"
    )
    print(format_structure(info))
    if info.get("figure"):
        print(f"figure: {final / info['figure']}")


def _validate_written(tmp: Path, final: Path, info: dict, data_root: Path, table: SourceTable) -> None:
    """:func:`_validate` the manifests written into ``tmp``; an error names them where they would have been."""
    try:
        _validate(tmp, info, data_root)
    except ManifestError as e:  # about a manifest being written: name it where it would have been
        raise ManifestError(
            str(e).replace(str(tmp), str(final)) + " (nothing was written; the input is "
            f"{table.files[0] if table.files else table.name})"
        ) from None


def _draw_figure(info: dict, tmp: Path) -> None:
    """Save ``label_structure.png`` into ``tmp`` and name it in ``info`` (nothing without matplotlib)."""
    from .prepare_figure import plot_structure  # imported where drawn: matplotlib, when installed

    if plot_structure(info, tmp / "label_structure.png") is not None:
        info["figure"] = "label_structure.png"


def prepare(
    source: str | None,
    source_root: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    num_sites: int | None,
    protocol: str,
    *,
    split: SplitOptions | None = None,
    labels: LabelOptions | None = None,
    images: ImageOptions | None = None,
    source_args: dict | None = None,
    sources: Sequence[dict] | None = None,
    overwrite: bool = False,
    verbose: bool = True,
    figure: bool = True,
    **settings: Any,
) -> Path:
    """Prepare a federated partial-label dataset; returns the output folder.

    Args:
        source: a name from ``fedpartial.data.sources.SOURCES`` (None with ``sources``).
        source_root: the source's folder. ``None`` for generated sources (``ich_phantom``): the data are then
            generated inside the output folder (``<out_dir>/source``, ``data_root`` '.').
        out_dir: output folder (must not exist or be empty unless ``overwrite``; when the source lives inside it
            the manifests are added next to the images).
        num_sites: number of sites (``site-1`` .. ``site-N``); with ``partition="centre"`` it may be None (one
            site per centre); with ``sources`` the sum of their ``num_sites``.
        protocol: a name from ``fedpartial.data.protocols.PROTOCOLS``.
        split: :class:`SplitOptions` (seed, val / test fractions, site sizes, partition).
        labels: :class:`LabelOptions` (the federation's classes, task, vocabularies, centralise).
        images: :class:`ImageOptions` (exclusions, decoding, unreadable images).
        source_args: keyword arguments for the source loader.
        sources: a federation of several published sources, each ``{"source", "root", "num_sites",
            "source_args" (optional), "vocabulary" (optional {its column: global class} or a vocabulary name)}``;
            each source's sites hold only its images and keep its own column names (CheXpert / MIMIC-CXR's
            ``Pleural Effusion`` is NIH's ``Effusion`` by default).
        overwrite: replace an existing output folder.
        verbose: print the per-site count tables and the dropped-row report.
        figure: save ``label_structure.png`` (matplotlib) next to the manifests.
        **settings: the same options flat, as a job's ``dataset.prepare`` and the CLI give them (any field of the
            three groups, e.g. ``seed=1, classes=[...]``; it overrides the group's value), and the protocol's
            parameter (``k``, ``s``, ``m`` or ``table``). See :func:`prepare_options`.

    Raises:
        SourceError / ValueError / ManifestError: bad arguments or files, an impossible protocol, or a result
            that fails validation; nothing is left behind.
    """
    split, labels, images, protocol_params = prepare_options(settings, split, labels, images)
    final = Path(out_dir).expanduser().resolve()
    root = None if source_root is None else Path(source_root).expanduser().resolve()
    inside = root is not None and _is_within(root, final)
    _check_out(final, inside, overwrite)
    excluded = read_exclude(images.exclude)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if sources:
            table, group_specs = _load_federation(sources, num_sites, labels, images, excluded)
            source = table.name
            local, alone = False, False
        else:
            table, group_specs, alone = _load_single(
                source, root, tmp, num_sites, source_args, labels, images, excluded
            )
            local = source_root is None or inside
        check_rows_have_class(table)
        base = final if inside else tmp  # folder the manifests' image paths are relative to, before publishing
        info = _build(
            table,
            tmp,
            base,
            local,
            group_specs,
            protocol,
            protocol_params,
            split,
            labels,
            source,
            source_args,
            alone,
        )
        _record_inputs(info, table, sources, labels, images, tmp, alone)
        _validate_written(tmp, final, info, base if local else table.root.resolve(), table)
        info["fingerprint"] = manifests_fingerprint(tmp, info)
        if figure:
            _draw_figure(info, tmp)
        (tmp / DATASET_JSON).write_text(json.dumps(info, indent=2) + "\n")
        _publish(tmp, final, inside, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        _report(final, info, table, source, protocol, protocol_params, split)
    return final


def _deal(
    frame: pd.DataFrame,
    groups: list,
    known: np.ndarray,
    pids: np.ndarray,
    split_opts: SplitOptions,
    classes: list[str],
    alone: bool,
) -> tuple[np.ndarray, list, list[int], dict[str, str]]:
    """Split each group's patients into train / val / test and deal its training rows over its sites: the split
    of every row, each site's rows, each site's group and the centre of each site (partition ``centre``)."""
    import pandas as pd  # imported where used (see _combine)

    seed, val_frac, test_frac = split_opts.seed, split_opts.val_frac, split_opts.test_frac
    site_sizes, partition, alpha = split_opts.site_sizes, split_opts.partition, split_opts.alpha
    split = np.empty(len(frame), dtype=object)
    site_rows, site_group, centres = [], [], {}
    unscored = np.zeros(len(frame), bool)
    if alone:  # a site's own export: val / test are cut from the patients with a label; the others all train
        unscored = pd.Series(~known.any(axis=1)).groupby(pids).transform("all").to_numpy()
    for g, (n, rows_mask, _) in enumerate(groups):
        rows = np.flatnonzero(rows_mask)
        scored = rows[~unscored[rows]]
        split[rows] = "train"
        split[scored] = _group_split(frame, scored, val_frac, test_frac, seed)
        train = rows[split[rows] == "train"]

        parts, names = _partition(
            frame,
            train,
            n,
            partition,
            seed,
            site_sizes,
            classes,
            alpha,
            CENTRE_ORDER if partition == "centre" else None,
        )
        for k, part in enumerate(parts):
            if names is not None:
                centres[site_name(len(site_rows))] = names[k]
            site_rows.append(part)
            site_group.append(g)
    return split.astype(str), site_rows, site_group, centres


def _info(
    table: SourceTable,
    classes: list[str],
    local: bool,
    protocol: str,
    protocol_params: dict,
    split_opts: SplitOptions,
    num_sites: int,
    source: str,
    source_args,
    centres: dict[str, str],
) -> dict[str, Any]:
    """The dataset.json content known before the manifests are written (their per-site entries filled later)."""
    frame = table.frame
    seed, val_frac, test_frac = split_opts.seed, split_opts.val_frac, split_opts.test_frac
    site_sizes, partition, alpha = split_opts.site_sizes, split_opts.partition, split_opts.alpha
    info: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "task": table.task,
        "classes": classes,
        "data_root": "." if local else str(table.root.resolve()),
        "protocol": protocol,
        "protocol_params": protocol_params,
        "seed": seed,
        "num_sites": num_sites,
        "val_frac": val_frac,
        "test_frac": test_frac,
        "site_sizes": site_sizes,
        "source_args": source_args or {},
        "partition": partition,
        "synthetic": bool(table.synthetic),
        "sites": {},
        "files": {},
        "sizes": {},
        "counts": {},
        "structure": {},
        "unlabelled": {},
    }
    if partition in ("dirichlet", "quantity"):
        info["alpha"] = alpha
    if centres:
        info["centres"] = centres
    if "official_split" in frame.columns and (frame["official_split"].astype(str) != "").any():
        info["official_split"] = True
    return info


def _renames(
    groups: list, site_group: list[int], centralise: bool, vocabularies, classes: list[str], parts: list
) -> dict[str, dict[str, str]]:
    """``{site: {global class: its column name}}``: a federation source's own names and ``vocabularies``."""
    renames = {}
    if not centralise:
        for i, g in enumerate(site_group):
            if groups[g][2]:
                renames[site_name(i)] = dict(groups[g][2])
    for site, v in (vocabularies or {}).items():
        renames[site] = {**renames.get(site, {}), **resolve_vocabulary(v, classes)}
    unknown = sorted(set(renames) - {p[0] for p in parts if p[2] == "train"})
    if unknown:
        raise ValueError(f"vocabularies name site(s) {unknown} that this split does not have")
    return renames


def _write_parts(
    tmp: Path,
    parts: list,
    renames: dict,
    images,
    labels: np.ndarray,
    pids: np.ndarray,
    classes: list[str],
    info: dict,
) -> None:
    """Write each part's manifest into ``tmp`` and record its annotated classes, size, counts and structure."""
    for name, rows, split_name, mask in parts:
        columns = [renames.get(name, {}).get(c, c) for c in classes]
        write_manifest(
            tmp / f"{name}.csv",
            images.iloc[rows],
            labels[rows],
            mask,
            columns,
            patient_ids=pids[rows],
            splits=[split_name] * len(rows),
        )
        if split_name == "train":
            annotated = np.flatnonzero(mask.any(axis=0)) if len(mask) else []
            info["sites"][name] = [classes[j] for j in annotated]
        info["files"][name] = f"{name}.csv"
        info["sizes"][name] = int(len(rows))
        info["counts"][name] = _counts(labels[rows], mask, classes)
        info["structure"][name] = _structure(labels[rows], mask, classes)
        info["unlabelled"][name] = int((~mask.any(axis=1)).sum()) if len(mask) else 0


def _build(
    table: SourceTable,
    tmp: Path,
    base: Path,
    local: bool,
    groups: list,
    protocol: str,
    protocol_params: dict,
    split_opts: SplitOptions,
    labels: LabelOptions,
    source: str,
    source_args,
    alone: bool = False,
) -> dict:
    """Split, deal, assign and write the manifests into ``tmp``; returns the dataset.json content.

    ``groups``: per source of the federation ``(number of sites or None, (N,) row mask, {global class: its
    column name})``; one group for a single source.
    """
    vocabularies, centralise = labels.vocabularies, labels.centralise
    frame, classes = table.frame, list(table.classes)
    images = frame["image"].astype(str)
    if local:  # the images live inside the output folder: paths relative to it
        src = table.root.resolve()
        images = images.map(lambda p: (src / p).relative_to(base).as_posix())
    pids = frame["patient_id"].astype(str).to_numpy()
    raw = frame[classes].to_numpy(dtype=np.int64)
    known = raw >= 0  # NOT_ANNOTATED cells carry no label
    labels = np.where(known, raw, 0)
    split, site_rows, site_group, centres = _deal(frame, groups, known, pids, split_opts, classes, alone)
    num_sites = len(site_rows)
    per_site = assign(protocol, classes, num_sites, split_opts.seed, **protocol_params)
    info = _info(table, classes, local, protocol, protocol_params, split_opts, num_sites, source, source_args, centres)

    def masked(rows, annotated):
        mask = np.zeros((len(rows), len(classes)), bool)
        mask[:, annotated] = True
        return mask & known[rows]

    parts = [(site_name(i), rows, "train", masked(rows, per_site[i])) for i, rows in enumerate(site_rows)]
    if centralise:  # one site holding every site's rows, each with its own site's labels
        parts = [(site_name(0), np.concatenate([p[1] for p in parts]), "train", np.concatenate([p[3] for p in parts]))]
        info["centralised_from"] = num_sites
        site_group = [0]
    parts += [
        (s, rows, s, masked(rows, list(range(len(classes)))))
        for s in ("val", "test")
        for rows in [np.flatnonzero(split == s)]
    ]
    renames = _renames(groups, site_group, centralise, vocabularies, classes, parts)
    if renames:
        info["vocabularies"] = {site: invert(r) for site, r in renames.items()}
    _write_parts(tmp, parts, renames, images, labels, pids, classes, info)
    return info


# ------------------------------------------------------------------------------------------ loading / caching

REFRESH_ENV = "FEDPARTIAL_REFRESH_DATA"
_STARTED = time.time()


def _fresh(out: Path, refresh: bool) -> bool:
    """A prepared folder that can be reused: complete, sources unchanged, not older than a requested refresh."""
    meta = out / DATASET_JSON
    if not meta.is_file() or stale_sources(out):
        return False
    return not (refresh and meta.stat().st_mtime < _STARTED)


def ensure_prepared(spec: dict, cache_dir: str | os.PathLike, verbose: bool = True) -> Path:
    """Prepare on first use: ``cache_dir/<source>-<protocol>-<hash>``, reused while its dataset.json exists and
    the source's label files keep their size and mtime (a corrected label in the source CSV is picked up).

    Args:
        spec: ``{"source", "root", "num_sites", "protocol", "seed", ...}``: every other key is a
            :func:`prepare` keyword (``val_frac``, ``site_sizes``, ``k``, ``table``, ``sources``, ...). ``root``
            may be omitted / None for generated sources. ``"refresh": true`` (or ``FEDPARTIAL_REFRESH_DATA=1``)
            prepares again once per process start.
        cache_dir: folder of prepared datasets.

    Concurrent callers (simulated clients starting together) serialise on a ``filelock.FileLock``; only the
    first prepares.
    """
    from filelock import FileLock

    verbose = bool(spec.get("verbose", verbose))
    refresh = bool(spec.get("refresh")) or os.environ.get(REFRESH_ENV, "").strip().lower() in ("1", "true", "yes")
    spec = canonical_spec(spec)
    cache = Path(cache_dir).expanduser().resolve()
    out = prepared_path(spec, cache)
    if _fresh(out, refresh):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f".{out.name}.lock")):
        if _fresh(out, refresh):
            return out
        if verbose and (out / DATASET_JSON).is_file():
            changed = stale_sources(out)
            print(f"re-preparing {out}: " + (f"source file(s) changed: {changed}" if changed else "refresh asked"))
        kwargs = dict(spec)
        source, root = kwargs.pop("source", None), kwargs.pop("root", None)
        num_sites = kwargs.pop("num_sites", None)
        protocol = kwargs.pop("protocol")
        prepare(source, root, out, num_sites, protocol, overwrite=True, verbose=verbose, **kwargs)
    return out
