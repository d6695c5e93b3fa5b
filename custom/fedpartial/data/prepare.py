"""Turn a source dataset into per-site manifests under a label protocol.

``prepare(...)`` (CLI: ``fedpartial-prepare``) loads a source, optionally keeps a class subset, splits the
patients into train / val / test, deals the training patients IID over ``num_sites`` disjoint sites and blanks,
in each site's manifest, the class columns the protocol does not give that site. Output folder::

    site-1.csv ... site-N.csv   training rows of each site (split 'train'); empty cell = not annotated
    val.csv, test.csv           fully labelled, shared by all sites (split 'val' / 'test')
    dataset.json                classes, task, data_root, protocol, per-site annotated classes and counts

Everything is written into a temporary sibling folder, validated with :func:`read_manifest` /
:func:`check_coverage` and renamed into place at the end, so a failed run leaves nothing behind.
Two options model the surgical-aggregation paper's settings: ``vocabularies`` writes some sites' manifests in
another label vocabulary (``{"site-3": "chexpert"}``: CheXpert's column names; ``dataset.json`` records each such
site's ``{its column: global class}`` map, which the simulator applies as a site configuration's ``columns``
would), and ``centralise`` pools every site's training rows, each with the labels its site annotates, into one
site (the centralised baseline: missing labels become negatives under ``fedavg``).

``ensure_prepared(spec, cache_dir)`` is the simulator's prepare-on-first-use (cached by a hash of the spec,
guarded by a file lock).

Example::

    fedpartial-prepare --source ham10000 --root ../shared/data/ham10000 --out data/ham_fedlsm \\
        --sites 5 --protocol table --table fedlsm_isic --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .manifest import check_coverage, read_manifest, write_manifest
from .protocols import assign
from .vocabulary import invert, resolve_vocabulary
from .sources import SourceTable, load_source

DATASET_JSON = "dataset.json"
FORMAT_VERSION = 1


def site_name(i: int) -> str:
    """0-based site index -> NVFlare simulator client name ('site-1', ...)."""
    return f"site-{i + 1}"


@dataclass
class PreparedDataset:
    """A prepared dataset folder, as read by :func:`load_prepared`.

    Attributes:
        classes: global class list (manifest column order).
        task: 'multilabel' or 'multiclass'.
        data_root: absolute folder the manifests' image paths are relative to.
        sites: ``{'site-1': manifest path, ...}``.
        val: validation manifest (fully labelled).
        test: test manifest (fully labelled).
        info: the whole ``dataset.json``.
        path: the prepared folder.
    """

    classes: list[str]
    task: str
    data_root: Path
    sites: dict[str, Path]
    val: Path
    test: Path
    info: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def site_classes(self) -> dict[str, list[str]]:
        """Annotated class names per site."""
        return {k: list(v) for k, v in self.info.get("sites", {}).items()}


# ----------------------------------------------------------------------------------------------- class subset

def subset_classes(table: SourceTable, classes: Sequence[str] | None = None,
                   top_k: int | None = None) -> SourceTable:
    """Keep only some classes (in the source's order).

    Args:
        table: the source.
        classes: class names to keep (``None``: all).
        top_k: then keep the ``top_k`` most frequent of those (FedMLP's 8 most frequent CXR14 findings).

    Multi-label rows keep only the chosen columns (a row may become all-negative). Single-label rows whose
    class is dropped are removed (a softmax target must exist).
    """
    from .sources.nih_cxr14 import most_frequent_classes

    if classes is None and top_k is None:
        return table
    chosen = list(table.classes)
    if classes is not None:
        unknown = [c for c in classes if c not in table.classes]
        if unknown:
            raise ValueError(f"unknown class(es) {unknown}; {table.name} has {table.classes}")
        chosen = [c for c in table.classes if c in set(classes)]
        if not chosen:
            raise ValueError("empty class subset")
    frame = table.frame.drop(columns=[c for c in table.classes if c not in chosen])
    sub = SourceTable(table.name, table.task, chosen, table.root, frame, table.synthetic)
    if top_k is not None:
        chosen = most_frequent_classes(sub, int(top_k))
        frame = frame.drop(columns=[c for c in sub.classes if c not in chosen])
    if table.task == "multiclass":
        frame = frame[frame[chosen].sum(axis=1) > 0]
    return SourceTable(table.name, table.task, chosen, table.root, frame.reset_index(drop=True), table.synthetic)


# ----------------------------------------------------------------------------------------------------- splits

def _cut(cum: np.ndarray, target: float, lo: int, hi: int) -> int:
    """Number of leading groups whose cumulative size is closest to ``target``, clipped to ``lo..hi``."""
    i = int(np.argmin(np.abs(cum - target)))
    return min(max(i, lo), hi)


def split_patients(patient_ids: Sequence[str], val_frac: float, test_frac: float, seed: int) -> np.ndarray:
    """Patient-level train / val / test split (deterministic from ``seed``).

    Patients are shuffled (the permutation of the sorted unique ids depends only on the seed) and cut where the
    cumulative number of images is closest to ``test_frac`` and ``test_frac + val_frac`` of all images; every
    split gets at least one patient.

    Returns:
        ``(N,)`` array of 'train' / 'val' / 'test' per row.
    """
    if not (0 < val_frac < 1 and 0 < test_frac < 1 and val_frac + test_frac < 1):
        raise ValueError(f"need 0 < val_frac, test_frac and val_frac + test_frac < 1; got {val_frac}, {test_frac}")
    pids = np.asarray([str(p) for p in patient_ids])
    uniq, inverse, sizes = np.unique(pids, return_inverse=True, return_counts=True)
    if len(uniq) < 3:
        raise ValueError(f"need at least 3 patients for a train / val / test split, got {len(uniq)}")
    order = np.random.default_rng([1, seed]).permutation(len(uniq))
    cum = np.concatenate([[0], np.cumsum(sizes[order])])
    n = len(pids)
    n_test = _cut(cum, test_frac * n, 1, len(uniq) - 2)
    n_eval = _cut(cum, (test_frac + val_frac) * n, n_test + 1, len(uniq) - 1)
    group_split = np.full(len(uniq), "train", dtype=object)
    group_split[order[:n_test]] = "test"
    group_split[order[n_test:n_eval]] = "val"
    return group_split[inverse].astype(str)


def split_sites(patient_ids: Sequence[str], num_sites: int, seed: int,
                site_sizes: int | Sequence[int] | None = None) -> list[np.ndarray]:
    """Deal patients IID over ``num_sites`` disjoint sites, balancing image counts.

    Patients are shuffled with the seed, then taken largest first (ties in shuffled order), each going to the
    site with the fewest images so far, so sites differ by at most a few images. With
    ``site_sizes`` (one int for all sites, or one per site) each site keeps at most that many images (whole
    patients first, in shuffled order).

    Returns:
        per site, the sorted row positions (into ``patient_ids``).
    """
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    caps: list[int | None]
    if site_sizes is None:
        caps = [None] * num_sites
    elif isinstance(site_sizes, (int, np.integer)):
        caps = [int(site_sizes)] * num_sites
    else:
        caps = [int(c) for c in site_sizes]
        if len(caps) != num_sites:
            raise ValueError(f"site_sizes has {len(caps)} entries for {num_sites} sites")
    if any(c is not None and c < 1 for c in caps):
        raise ValueError(f"site sizes must be >= 1, got {site_sizes}")
    pids = np.asarray([str(p) for p in patient_ids])
    uniq, inverse, sizes = np.unique(pids, return_inverse=True, return_counts=True)
    if len(uniq) < num_sites:
        raise ValueError(f"{len(uniq)} training patients cannot fill {num_sites} sites")
    shuffled = np.random.default_rng([2, seed]).permutation(len(uniq))
    rank = np.empty(len(uniq), np.int64)
    rank[shuffled] = np.arange(len(uniq))
    order = np.lexsort((rank, -sizes))  # largest patients first, shuffled among equal sizes
    load = np.zeros(num_sites, np.int64)
    owner = np.empty(len(uniq), np.int64)
    for g in order:
        s = int(np.argmin(load))
        owner[g] = s
        load[s] += sizes[g]
    out = []
    for s, cap in enumerate(caps):
        idx = np.flatnonzero(owner[inverse] == s)
        idx = idx[np.lexsort((idx, rank[inverse[idx]]))]
        if cap is not None:
            if len(idx) < cap:
                warnings.warn(f"{site_name(s)} has only {len(idx)} training images (< site size {cap})")
            idx = idx[:cap]
        out.append(np.sort(idx))
    return out


# ---------------------------------------------------------------------------------------------------- prepare

def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _counts(labels: np.ndarray, mask: np.ndarray, classes: Sequence[str]) -> dict[str, int | None]:
    """Labelled positives per class (None where the class is not annotated)."""
    pos = (labels * mask).sum(axis=0)
    annotated = mask.any(axis=0) if len(mask) else np.zeros(len(classes), bool)
    return {c: (int(pos[j]) if annotated[j] else None) for j, c in enumerate(classes)}


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
        m = read_manifest(folder / file, classes, data_root=data_root, site=name, task=task,
                          require_annotated=bool(info["sites"].get(name, True)),
                          columns=(info.get("vocabularies") or {}).get(name))
        if name in info["sites"]:
            got = m.annotated_classes()
            if got != info["sites"][name]:
                raise RuntimeError(f"{name}: manifest annotates {got}, protocol says {info['sites'][name]}")
            annotated[name] = m.annotated
        patients[name] = set(m.patient_ids)
    check_coverage(annotated, classes)
    site_pat = set().union(*(patients[s] for s in info["sites"]))
    for a, b in (("val", "test"), ("val", None), ("test", None)):
        other = site_pat if b is None else patients[b]
        shared = patients[a] & other
        if shared:
            raise RuntimeError(f"patient(s) {sorted(shared)[:5]} appear in '{a}' and '{b or 'train'}'")


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
            trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
            return
        else:
            raise FileExistsError(f"{final} already exists (pass overwrite=True)")
    os.rename(tmp, final)


def prepare(source: str, source_root: str | os.PathLike | None, out_dir: str | os.PathLike, num_sites: int,
            protocol: str, seed: int = 0, val_frac: float = 0.1, test_frac: float = 0.2,
            site_sizes: int | Sequence[int] | None = None, classes: Sequence[str] | None = None,
            source_args: dict | None = None, top_k_classes: int | None = None, overwrite: bool = False,
            verbose: bool = True, vocabularies: dict | None = None, centralise: bool = False,
            **protocol_params: Any) -> Path:
    """Prepare a federated partial-label dataset; returns the output folder.

    Args:
        source: a name from ``fedpartial.data.sources.SOURCES``.
        source_root: the source's folder. ``None`` for generated sources (``ich_phantom``): the data are then
            generated inside the output folder (``<out_dir>/source``, ``data_root`` '.').
        out_dir: output folder (must not exist or be empty unless ``overwrite``; when the source lives inside it
            the manifests are added next to the images).
        num_sites: number of sites (``site-1`` .. ``site-N``).
        protocol: a name from ``fedpartial.data.protocols.PROTOCOLS``.
        seed: seed of the splits, the site assignment and randomised protocols.
        val_frac, test_frac: fractions of images (split by patient) for the shared val / test sets.
        site_sizes: cap on training images per site (one int, or one per site).
        classes: class subset (source order kept).
        source_args: keyword arguments for the source loader.
        top_k_classes: keep the k most frequent classes (after ``classes``).
        overwrite: replace an existing output folder.
        verbose: print the per-site count table.
        vocabularies: ``{site: vocabulary}``, a vocabulary being a name from
            ``fedpartial.data.vocabulary.VOCABULARIES`` or ``{global class: column name}``: those sites' manifests
            use these column names (the split of the paper's two-vocabulary experiment).
        centralise: pool every site's rows (with the labels its site annotates) into one site ``site-1``.
        **protocol_params: the protocol's parameter (``k``, ``s``, ``m`` or ``table``).

    Raises:
        ValueError / ManifestError: bad arguments, an impossible protocol, or a result that fails validation;
            nothing is left behind.
    """
    final = Path(out_dir).expanduser().resolve()
    root = None if source_root is None else Path(source_root).expanduser().resolve()
    inside = root is not None and _is_within(root, final)
    if not overwrite and (final / DATASET_JSON).exists():
        raise FileExistsError(f"{final} already holds a prepared dataset (pass overwrite=True)")
    if not overwrite and not inside and final.exists() and any(final.iterdir()):
        raise FileExistsError(f"{final} exists and is not empty (pass overwrite=True)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if root is None:
            root = tmp / "source"
        table = load_source(source, root, **(source_args or {}))
        table = subset_classes(table, classes, top_k_classes)
        base = final if inside else tmp  # folder the manifests' image paths are relative to, before publishing
        info = _build(table, tmp, base, source_root is None or inside, num_sites, protocol, seed, val_frac,
                      test_frac, site_sizes, source, source_args, protocol_params, vocabularies, centralise)
        _validate(tmp, info, base if (source_root is None or inside) else table.root.resolve())
        (tmp / DATASET_JSON).write_text(json.dumps(info, indent=2) + "\n")
        _publish(tmp, final, inside, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        synthetic = " (SYNTHETIC data)" if info["synthetic"] else ""
        print(f"prepared {final}{synthetic}: {source}, protocol {protocol} {protocol_params}, seed {seed}")
        print("labelled positives per class ('-' = not annotated):")
        print(format_counts(info))
    return final


def _build(table: SourceTable, tmp: Path, base: Path, local: bool, num_sites: int, protocol: str, seed: int,
           val_frac: float, test_frac: float, site_sizes, source: str, source_args, protocol_params,
           vocabularies: dict | None = None, centralise: bool = False) -> dict:
    """Split, assign, write the manifests into ``tmp``; returns the dataset.json content."""
    frame, classes = table.frame, list(table.classes)
    images = frame["image"].astype(str)
    if local:  # the images live inside the output folder: paths relative to it
        src = table.root.resolve()
        images = images.map(lambda p: (src / p).relative_to(base).as_posix())
    pids = frame["patient_id"].astype(str).to_numpy()
    labels = frame[classes].to_numpy(dtype=np.int64)
    split = split_patients(pids, val_frac, test_frac, seed)
    train_rows = np.flatnonzero(split == "train")
    per_site = assign(protocol, classes, num_sites, seed, **protocol_params)
    site_rows = [train_rows[r] for r in split_sites(pids[train_rows], num_sites, seed, site_sizes)]
    info: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "source": source, "task": table.task, "classes": classes,
        "data_root": "." if local else str(table.root.resolve()), "protocol": protocol,
        "protocol_params": protocol_params, "seed": seed, "num_sites": num_sites, "val_frac": val_frac,
        "test_frac": test_frac, "site_sizes": site_sizes, "source_args": source_args or {},
        "synthetic": bool(table.synthetic), "sites": {}, "files": {}, "sizes": {}, "counts": {},
    }
    def masked(rows, annotated):
        mask = np.zeros((len(rows), len(classes)), bool)
        mask[:, annotated] = True
        return mask

    parts = [(site_name(i), rows, "train", masked(rows, per_site[i])) for i, rows in enumerate(site_rows)]
    if centralise:  # one site holding every site's rows, each with its own site's labels
        parts = [(site_name(0), np.concatenate([p[1] for p in parts]), "train", np.concatenate([p[3] for p in parts]))]
        info["centralised_from"] = num_sites
    parts += [(s, rows, s, masked(rows, list(range(len(classes)))))
              for s in ("val", "test") for rows in [np.flatnonzero(split == s)]]
    renames = {site: resolve_vocabulary(v, classes) for site, v in (vocabularies or {}).items()}
    unknown = sorted(set(renames) - {p[0] for p in parts if p[2] == "train"})
    if unknown:
        raise ValueError(f"vocabularies name site(s) {unknown} that this split does not have")
    if renames:
        info["vocabularies"] = {site: invert(r) for site, r in renames.items()}
    for name, rows, split_name, mask in parts:
        columns = [renames.get(name, {}).get(c, c) for c in classes]
        write_manifest(tmp / f"{name}.csv", images.iloc[rows], labels[rows], mask, columns,
                       patient_ids=pids[rows], splits=[split_name] * len(rows))
        if split_name == "train":
            annotated = np.flatnonzero(mask.any(axis=0)) if len(mask) else []
            info["sites"][name] = [classes[j] for j in annotated]
        info["files"][name] = f"{name}.csv"
        info["sizes"][name] = int(len(rows))
        info["counts"][name] = _counts(labels[rows], mask, classes)
    return info


# ------------------------------------------------------------------------------------------ loading / caching

def load_prepared(out_dir: str | os.PathLike) -> PreparedDataset:
    """Read a folder written by :func:`prepare`."""
    folder = Path(out_dir).expanduser().resolve()
    meta = folder / DATASET_JSON
    if not meta.is_file():
        raise FileNotFoundError(f"{meta} not found: not a prepared dataset (run fedpartial-prepare)")
    info = json.loads(meta.read_text())
    data_root = Path(info["data_root"])
    data_root = data_root if data_root.is_absolute() else (folder / data_root).resolve()
    files = info["files"]
    return PreparedDataset(
        classes=list(info["classes"]), task=info["task"], data_root=data_root,
        sites={s: folder / files[s] for s in info["sites"]}, val=folder / files["val"],
        test=folder / files["test"], info=info, path=folder)


_NOT_HASHED = ("verbose", "overwrite")


def canonical_spec(spec: dict) -> dict:
    """The spec with ``root`` made absolute (so equal data give equal hashes whatever the working folder) and
    without the keys that do not change the data (``verbose``, ``overwrite``)."""
    spec = {k: v for k, v in spec.items() if k not in _NOT_HASHED}
    if "source_root" in spec and "root" not in spec:
        spec["root"] = spec.pop("source_root")
    for key in ("source", "num_sites", "protocol"):
        if key not in spec:
            raise ValueError(f"dataset spec lacks {key!r}: {spec}")
    if spec.get("root") is not None:
        spec["root"] = str(Path(spec["root"]).expanduser().resolve())
    return spec


def spec_hash(spec: dict, length: int = 12) -> str:
    """Short sha256 of the canonical JSON of the spec."""
    text = json.dumps(canonical_spec(spec), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def prepared_path(spec: dict, cache_dir: str | os.PathLike) -> Path:
    """Where :func:`ensure_prepared` keeps the split of ``spec``: ``cache_dir/<source>-<protocol>-<hash>``."""
    spec = canonical_spec(spec)
    return Path(cache_dir).expanduser().resolve() / f"{spec['source']}-{spec['protocol']}-{spec_hash(spec)}"


def ensure_prepared(spec: dict, cache_dir: str | os.PathLike, verbose: bool = True) -> Path:
    """Prepare on first use: ``cache_dir/<source>-<protocol>-<hash>``, reused when its dataset.json exists.

    Args:
        spec: ``{"source", "root", "num_sites", "protocol", "seed", ...}``: every other key is a
            :func:`prepare` keyword (``val_frac``, ``site_sizes``, ``k``, ``table``, ...). ``root`` may be
            omitted / None for generated sources.
        cache_dir: folder of prepared datasets.

    Concurrent callers (simulated clients starting together) serialise on a ``filelock.FileLock``; only the
    first prepares.
    """
    from filelock import FileLock

    verbose = bool(spec.get("verbose", verbose))
    spec = canonical_spec(spec)
    cache = Path(cache_dir).expanduser().resolve()
    out = prepared_path(spec, cache)
    if (out / DATASET_JSON).is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f".{out.name}.lock")):
        if (out / DATASET_JSON).is_file():
            return out
        kwargs = dict(spec)
        source, root = kwargs.pop("source"), kwargs.pop("root", None)
        prepare(source, root, out, overwrite=True, verbose=verbose, **kwargs)
    return out


# -------------------------------------------------------------------------------------------------------- CLI

def _parse_value(text: str) -> Any:
    """JSON value if it parses (numbers, true/false, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpartial-prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="ham10000, isic2018, nih_cxr14, rsna_ich, ich_phantom")
    p.add_argument("--root", default=None, help="source folder (omit for generated sources)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--sites", type=int, required=True, help="number of sites")
    p.add_argument("--protocol", required=True,
                   help="missing_k (--k), random_s (--s), table (--table), labeled_unlabeled (--m), full")
    p.add_argument("--k", type=int, help="missing_k: classes missing per site")
    p.add_argument("--s", type=int, help="random_s: classes per site")
    p.add_argument("--m", type=int, help="labeled_unlabeled: number of fully labelled sites")
    p.add_argument("--table", help="table: a named table (fedlsm_isic) or a JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--test-frac", type=float, default=0.2)
    p.add_argument("--site-size", type=int, nargs="+", help="cap on training images per site (one or per site)")
    p.add_argument("--classes", nargs="+", help="class subset (space or comma separated)")
    p.add_argument("--top-k-classes", type=int, help="keep the k most frequent classes")
    p.add_argument("--source-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="loader keyword, e.g. view=PA (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--vocabulary", action="append", default=[], metavar="SITES=VOCAB",
                   help="these sites' manifests use another vocabulary: site-3,site-4=chexpert (a name, or a JSON "
                        "{global class: column name}); repeatable")
    p.add_argument("--centralise", action="store_true", help="pool every site's rows into one site (central baseline)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``fedpartial-prepare``)."""
    args = build_parser().parse_args(argv)
    source_args = {}
    for item in args.source_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--source-arg expects KEY=VALUE, got {item!r}")
        source_args[key.strip()] = _parse_value(value)
    classes = None
    if args.classes:
        classes = [c for item in args.classes for c in item.split(",") if c]
    site_sizes = None
    if args.site_size:
        site_sizes = args.site_size[0] if len(args.site_size) == 1 else args.site_size
    params = {k: v for k, v in (("k", args.k), ("s", args.s), ("m", args.m), ("table", args.table))
              if v is not None}
    vocabularies = {}
    for item in args.vocabulary:
        sites, sep, vocab = item.partition("=")
        if not sep:
            raise SystemExit(f"--vocabulary expects SITES=VOCAB, got {item!r}")
        for site in sites.split(","):
            vocabularies[site.strip()] = _parse_value(vocab)
    prepare(args.source, args.root, args.out, args.sites, args.protocol, seed=args.seed, val_frac=args.val_frac,
            test_frac=args.test_frac, site_sizes=site_sizes, classes=classes, source_args=source_args or None,
            top_k_classes=args.top_k_classes, overwrite=args.overwrite, vocabularies=vocabularies or None,
            centralise=args.centralise, **params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
