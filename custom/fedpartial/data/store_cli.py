"""``fedpartial-store``: build the image stores of a prepared folder or of a site's manifests before a job.

A job opens its stores in seconds when they exist (``docs/datasets.md``, "Image store"); building them takes
the decoding of every image once (every core). An existing store has every chunk checked against its checksum
(a job checks a sample): the chunks that changed on disk are named and their rows decoded again. Run it before the job at a real site (the stores of its
``fedpartial_data.json`` manifests) or for a simulated split (a ``fedpartial-prepare`` folder: every site's
training rows, the validation and test sets)::

    fedpartial-store data/nih_prepared --preset nih_cxr14 --image-size 224
    fedpartial-store --site-config local/fedpartial_data.json --dataset nih_cxr14 --preset nih_cxr14

The stores go under ``$FEDPARTIAL_CACHE/stores`` (``--cache-dir`` or the dataset's ``cache_dir`` otherwise),
where the job looks for them: same images + same preprocessing = same folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..processes import Interrupted, exit_status, interruptible
from .cache import os_error_line
from .manifest import RESERVED_COLS, Manifest, ManifestError, read_manifest
from .prepared import load_prepared
from .presets import resolve_dataset
from .settings import RESIZE_MODES
from .site_files import read_site_config
from .store import ImageStore, Preprocessing, StoreError, corrupt_chunks, store_folder


def prepared_manifests(folder: str | os.PathLike, task: str | None = None) -> dict[str, dict[str, Manifest]]:
    """``{site: {split: manifest}}`` of a ``fedpartial-prepare`` folder as the simulator's sites read them (each
    site its training rows, and the shared validation and test sets)."""
    p = load_prepared(folder)
    vocab = p.info.get("vocabularies") or {}
    out: dict[str, dict[str, Manifest]] = {}
    shared = {
        s: read_manifest(
            getattr(p, s), p.classes, data_root=p.data_root, site="shared", task=p.task, require_annotated=False
        )
        for s in ("val", "test")
    }
    for site, file in p.sites.items():
        m = read_manifest(
            file,
            p.classes,
            data_root=p.data_root,
            site=site,
            task=task or p.task,
            require_annotated=False,
            columns=vocab.get(site),
        )
        out[site] = {"train": m.subset("train"), **shared}
    return out


def build_all(
    manifests: dict[str, dict[str, Manifest]],
    dataset: dict,
    workers: int | None = None,
    log_fn: Callable[[str], None] | None = None,
) -> dict[str, ImageStore]:
    """Open or build the store of every (site, split) manifest (a set shared by several sites once), every
    chunk of an existing store checked first (:func:`repair`). Returns ``{"<site>/<split>": store}``."""
    from .sitedata import SiteDatasets  # imported where used: loads torch

    out: dict[str, ImageStore] = {}
    checked: set[Path] = set()
    for site, splits in manifests.items():
        data = SiteDatasets(splits, dataset, log_fn=log_fn)
        for split in splits:
            if data.uses_store:
                repair(data, split, checked)
            out[f"{site}/{split}"] = data.store(split)
    return out


def repair(data, split: str, checked: set[Path]) -> None:
    """Check every chunk of the split's existing store (the folder a job opens); the chunks that changed on disk
    since the build are named and marked to be decoded again, which :meth:`SiteDatasets.store` then does (their
    rows only). A job checks a sample of chunks when it opens a store, and names this tool when one is corrupt."""
    from filelock import FileLock

    m = data.manifests[split]
    folder = store_folder(
        m.paths, Preprocessing.of(data.cfg), data.cfg.get("cache_dir") or data.cache_dir, data.store_name(split)
    )
    if folder in checked or not (folder / "store.json").is_file():
        return
    checked.add(folder)
    with FileLock(str(folder) + ".lock"):
        bad = corrupt_chunks(folder, redo=True)
    if bad:
        rows = ", ".join(f"{a}..{b}" for a, b in bad)
        print(
            f"image store {folder}: rows {rows} do not match their checksum (changed on disk since the build): "
            f"decoding {'them' if len(bad) > 1 else 'those rows'} again",
            flush=True,
        )


def _header_classes(file: Path) -> list[str]:
    """The class columns of a manifest's header (everything but image / patient_id / split), for a store built
    without a preset (the labels only annotate the store's index)."""
    import csv

    with open(file, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return [h.strip() for h in header if h.strip() and h.strip() not in RESERVED_COLS]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedpartial-store",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prepared", nargs="?", help="a fedpartial-prepare output folder")
    p.add_argument("--site-config", help="a site's fedpartial_data.json (with --dataset)")
    p.add_argument("--dataset", help="the dataset entry of --site-config")
    p.add_argument("--preset", help="dataset preset giving image size, channels and CT windows (e.g. nih_cxr14)")
    p.add_argument("--image-size", type=int, help="the job's image size (overrides the preset)")
    p.add_argument("--channels", type=int, help="the job's input channels (overrides the preset)")
    p.add_argument("--resize-mode", choices=RESIZE_MODES, help="default: area")
    p.add_argument("--cache-dir", help="store folder (default: $FEDPARTIAL_CACHE/stores)")
    p.add_argument("--workers", type=int, help="decoding processes (default: every core)")
    return p


def store_dataset(
    preset: str | None = None,
    image_size: int | None = None,
    channels: int | None = None,
    resize_mode: str | None = None,
    cache_dir: str | None = None,
) -> dict:
    """The dataset settings the stores are built for: a preset's (its classes, image size, channels, CT windows),
    the given values overriding it; without a preset, ``image_size`` and ``channels`` are needed (no classes: the
    labels only annotate the store's index)."""
    cfg: dict = {"preset": preset} if preset else {"name": "store", "task": "multilabel", "classes": []}
    for key, value in (
        ("image_size", image_size),
        ("channels", channels),
        ("resize_mode", resize_mode),
        ("cache_dir", cache_dir),
    ):
        if value is not None:
            cfg[key] = value
    if not preset and (image_size is None or channels is None):
        raise ValueError("give --preset or both --image-size and --channels")
    return resolve_dataset(cfg) if preset else cfg  # no preset: no classes, only the image settings above


def build_prepared_stores(
    prepared: str | os.PathLike,
    dataset: dict,
    workers: int | None = None,
    log_fn: Callable[[str], None] | None = None,
) -> dict[str, ImageStore]:
    """Open or build the stores of a ``fedpartial-prepare`` folder (every site's training rows, the shared
    validation and test sets) for ``dataset`` (:func:`store_dataset`), labelled with the folder's classes;
    ``fedpartial-store PREPARED`` and ``fedpartial-prepare --store``. Returns ``{"<site>/<split>": store}``."""
    manifests = prepared_manifests(prepared)
    return build_all(manifests, {**dataset, "classes": load_prepared(prepared).classes}, workers, log_fn=log_fn)


def site_manifests(site_config: str | os.PathLike, name: str | None, dataset: dict) -> dict[str, dict[str, Manifest]]:
    """``{"local": {split: manifest}}`` of a site's ``fedpartial_data.json`` entry ``name``."""
    sd = read_site_config("local", name, Path(site_config))
    classes = dataset["classes"] or _header_classes(sd.train)
    read = dict(data_root=sd.data_root, site="local", task=dataset["task"], require_annotated=False, **sd.vocabulary)
    full = read_manifest(sd.train, classes, **read)
    splits = {"train": full.subset("train")}
    for s in ("val", "test"):
        path = getattr(sd, s)
        if path is not None:
            splits[s] = read_manifest(path, classes, **read)
    return {"local": splits}


def print_stores(stores: dict[str, ImageStore]) -> None:
    """One line per store folder: its images, their shape and the (site, split) sets it holds."""
    seen: dict[Path, list[str]] = {}
    for name, s in stores.items():
        seen.setdefault(s.folder, []).append(name)
    for folder, names in seen.items():
        s = stores[names[0]]
        print(f"{folder}: {len(s)} images {s.channels} x {s.image_size} x {s.image_size} uint8 ({', '.join(names)})")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with interruptible():
            return _main(args)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the pool is stopped, the finished chunks kept
        print(
            f"fedpartial-store: stopped ({'Ctrl-C' if not isinstance(e, Interrupted) else e}); run the same "
            "command again to go on from the kept chunks",
            file=sys.stderr,
        )
        return exit_status(e)


def _main(args) -> int:
    try:
        ds = store_dataset(args.preset, args.image_size, args.channels, args.resize_mode, args.cache_dir)
        log_fn = None if sys.stderr.isatty() else print
        if args.site_config:
            manifests = site_manifests(args.site_config, args.dataset or ds.get("name"), ds)
            stores = build_all(manifests, ds, args.workers, log_fn=log_fn)
        elif args.prepared:
            stores = build_prepared_stores(args.prepared, ds, args.workers, log_fn=log_fn)
        else:
            raise ValueError("give a prepared folder or --site-config")
    except (StoreError, ManifestError, ValueError, OSError) as e:
        text = os_error_line(e) if isinstance(e, OSError) else " ".join(str(e).split())
        print(f"fedpartial-store: error: {text}", file=sys.stderr)
        return 2
    print_stores(stores)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
