"""Turn a source dataset into per-site manifests under a label protocol.

The command line ``fedpartial-prepare``: its options map onto :func:`fedpartial.data.prepare.prepare` (the
library a site runs; its docstring describes the output folder, the quality pass and the partitions); ``--store``
then builds the sites' image stores with :func:`fedpartial.data.store_cli.build_prepared_stores`, as
``fedpartial-store`` does. The layouts and commands of each release: ``docs/datasets.md``.

Example::

    fedpartial-prepare --source ham10000 --root ../shared/data/ham10000 --out data/ham_fedlsm \\
        --sites 5 --protocol table --table fedlsm_isic --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..processes import Interrupted, exit_status, interruptible
from .cache import os_error_line
from .catalog import DATASETS
from .manifest import ManifestError
from .partition import PARTITIONS
from .prepare import prepare
from .presets import PRESETS
from .sources.base import SourceError
from .store import StoreError
from .store_cli import build_prepared_stores, print_stores, store_dataset
from .vocabulary import VocabularyError


def _parse_value(text: str) -> Any:
    """JSON value if it parses (numbers, true/false, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedpartial-prepare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--source",
        action="append",
        required=True,
        help=", ".join(DATASETS) + ", csv (any label CSV), folder (one sub-folder per class); repeat "
        "--source / --root (and --sites) to federate several published sources",
    )
    p.add_argument(
        "--root", action="append", default=[], help="source folder (the label CSV for csv; omit for generated sources)"
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--sites",
        type=int,
        action="append",
        default=[],
        help="number of sites (one per --source when several; omit with --partition centre)",
    )
    p.add_argument(
        "--protocol",
        required=True,
        help="missing_k (--k), random_s (--s), table (--table), labeled_unlabeled (--m), full",
    )
    p.add_argument("--k", type=int, help="missing_k: classes missing per site")
    p.add_argument("--s", type=int, help="random_s: classes per site")
    p.add_argument("--m", type=int, help="labeled_unlabeled: number of fully labelled sites")
    p.add_argument("--table", help="table: a named table (fedlsm_isic) or a JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--test-frac", type=float, default=0.2)
    p.add_argument("--site-size", type=int, nargs="+", help="cap on training images per site (one or per site)")
    p.add_argument(
        "--classes",
        nargs="+",
        help="the federation's classes, in the job's order (space or comma separated), matched to the "
        "source's names exactly or case-insensitively; with --sites 1 (a site preparing its own "
        "export) a class the export lacks or leaves blank is not annotated here",
    )
    p.add_argument(
        "--task",
        choices=("multilabel", "multiclass"),
        help="the federation's task: a CSV export is read as such (otherwise task=auto says what it "
        "chose and why); other sources must be of it",
    )
    p.add_argument("--top-k-classes", type=int, help="keep the k most frequent classes")
    p.add_argument(
        "--source-arg",
        action="append",
        default=[],
        metavar="[SOURCE:|N:]KEY=VALUE",
        help="loader keyword, e.g. view=PA, uncertain=zeros, official_split=true (repeatable; prefix "
        "SOURCE: or N: (the N-th --source, from 1) to address one source of a federation)",
    )
    p.add_argument(
        "--partition",
        default="iid",
        choices=list(PARTITIONS),
        help="how training patients are dealt over sites (centre: one site per centre)",
    )
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (dirichlet / quantity)")
    p.add_argument("--exclude", help="images to leave out: a file (one name per line) or comma-separated names")
    p.add_argument("--drop-unreadable", action="store_true", help="leave unreadable images out instead of stopping")
    p.add_argument("--no-decode", action="store_true", help="skip the full decode of every image")
    p.add_argument(
        "--store",
        metavar="PREPROCESSING",
        help="then build the sites' image stores for the job's preprocessing (a dataset preset, "
        "PRESET:SIZE such as nih_cxr14:224, or SIZExCHANNELS such as 224x1), as fedpartial-store "
        "does: each image is decoded once, by the store build, which is then the decode check",
    )
    p.add_argument("--no-figure", action="store_true", help="do not save label_structure.png")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument(
        "--vocabulary",
        action="append",
        default=[],
        metavar="SITES=VOCAB",
        help="these sites' manifests use another vocabulary: site-3,site-4=chexpert (a name, or a JSON "
        "{global class: column name}); repeatable",
    )
    p.add_argument("--centralise", action="store_true", help="pool every site's rows into one site (central baseline)")
    return p


USER_ERRORS = (SourceError, ManifestError, VocabularyError, ValueError, FileExistsError, FileNotFoundError)


class UsageError(ValueError):
    """A command line that does not add up."""


def _source_args(items: Sequence[str], names: Sequence[str]) -> list[dict]:
    """``[SOURCE:|N:]KEY=VALUE`` items -> each ``--source``'s keywords: unprefixed for every source, ``SOURCE:``
    for the sources of that name, ``N:`` for the N-th ``--source`` (from 1; two sources of one name)."""
    common: dict = {}
    by_name: dict[str, dict] = {}
    by_index: dict[int, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--source-arg expects KEY=VALUE, got {item!r}")
        target, colon, key = key.rpartition(":")
        target = target.strip()
        if not colon:
            common[key.strip()] = _parse_value(value)
        elif target.isdigit():
            if not 1 <= int(target) <= len(names):
                raise UsageError(f"--source-arg {item!r} names source {target}, but there are {len(names)} --source")
            by_index.setdefault(int(target), {})[key.strip()] = _parse_value(value)
        elif target in names:
            by_name.setdefault(target, {})[key.strip()] = _parse_value(value)
        else:
            raise UsageError(
                f"--source-arg {item!r} names source {target!r}, which is not one of {list(names)} "
                f"(nor a number 1-{len(names)})"
            )
    return [{**common, **by_name.get(n, {}), **by_index.get(i, {})} for i, n in enumerate(names, 1)]


def _run(args: argparse.Namespace) -> Path:
    names = list(args.source)
    per_source = _source_args(args.source_arg, names)
    classes = None
    if args.classes:
        classes = [c for item in args.classes for c in item.split(",") if c]
    site_sizes = None
    if args.site_size:
        site_sizes = args.site_size[0] if len(args.site_size) == 1 else args.site_size
    params = {k: v for k, v in (("k", args.k), ("s", args.s), ("m", args.m), ("table", args.table)) if v is not None}
    vocabularies = {}
    for item in args.vocabulary:
        sites, sep, vocab = item.partition("=")
        if not sep:
            raise UsageError(f"--vocabulary expects SITES=VOCAB, got {item!r}")
        for site in sites.split(","):
            vocabularies[site.strip()] = _parse_value(vocab)
    common = dict(
        seed=args.seed,
        val_frac=args.val_frac,
        test_frac=args.test_frac,
        site_sizes=site_sizes,
        classes=classes,
        overwrite=args.overwrite,
        vocabularies=vocabularies or None,
        centralise=args.centralise,
        partition=args.partition,
        alpha=args.alpha,
        exclude=args.exclude,
        drop_unreadable=args.drop_unreadable,
        decode_images=not args.no_decode,
        figure=not args.no_figure,
        task=args.task,
        **params,
    )
    if len(names) == 1:
        if len(args.root) > 1 or len(args.sites) > 1:
            raise UsageError("one --source takes one --root and one --sites")
        sites = args.sites[0] if args.sites else None
        if sites is None and args.partition != "centre":
            raise UsageError("--sites is required (except with --partition centre)")
        args_one = per_source[0]
        return prepare(
            names[0],
            args.root[0] if args.root else None,
            args.out,
            sites,
            args.protocol,
            source_args=args_one or None,
            top_k_classes=args.top_k_classes,
            **common,
        )
    if len(args.root) != len(names) or len(args.sites) not in (0, len(names)):
        raise UsageError(f"{len(names)} --source need {len(names)} --root and as many --sites (one per source)")
    if args.top_k_classes:
        raise UsageError("--top-k-classes works on one source; give the federation's classes with --classes")
    sources = [
        {"source": n, "root": r, "num_sites": args.sites[i] if args.sites else 1, "source_args": per_source[i]}
        for i, (n, r) in enumerate(zip(names, args.root))
    ]
    return prepare(None, None, args.out, None, args.protocol, sources=sources, **common)


def _store_settings(spec: str) -> dict:
    """``--store`` -> the dataset settings of the stores (:func:`~fedpartial.data.store_cli.store_dataset`):
    ``PRESET`` (the preset's), ``PRESET:SIZE`` (the preset's channels, windows and resize mode at the job's size)
    or ``SIZExCHANNELS`` (those image settings only)."""
    preset, colon, at = spec.partition(":")
    if preset in PRESETS and (not colon or at.isdigit()):
        return store_dataset(preset=preset, image_size=int(at) if colon else None)
    size, x, channels = spec.lower().partition("x")
    if x and size.isdigit() and channels.isdigit():
        return store_dataset(image_size=int(size), channels=int(channels))
    raise UsageError(
        f"--store expects a dataset preset, PRESET:SIZE (e.g. nih_cxr14:224) or SIZExCHANNELS (e.g. "
        f"224x1), got {spec!r} (presets: {', '.join(sorted(PRESETS))})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``fedpartial-prepare``): a user error is one line on stderr (with a hint) and exit 2,
    without a traceback (``FEDPARTIAL_DEBUG=1`` shows it). With ``--store``, the stores are built after the
    manifests (:func:`fedpartial.data.store_cli.build_prepared_stores`), the images decoded there only."""
    args = build_parser().parse_args(argv)
    try:
        with interruptible():
            return _main(args)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: nothing half-written is left as done
        print(
            f"fedpartial-prepare: stopped ({'Ctrl-C' if not isinstance(e, Interrupted) else e}); an output "
            "folder is only ever replaced whole, so it holds the previous result or this one; run the same "
            "command again (a store build goes on from its kept chunks)",
            file=sys.stderr,
        )
        return exit_status(e)


def _main(args) -> int:
    try:
        if args.store:
            store = _store_settings(args.store)
            if args.drop_unreadable:
                raise UsageError(
                    "--drop-unreadable needs the decode pass: leave out --store, then run "
                    "fedpartial-store on the prepared folder"
                )
            args.no_decode = True  # the store build decodes every image, and names an unreadable one
        out = _run(args)
        if args.store:
            print_stores(build_prepared_stores(out, store, log_fn=None if sys.stderr.isatty() else print))
    except (*USER_ERRORS, StoreError, OSError) as e:
        if os.environ.get("FEDPARTIAL_DEBUG"):
            raise

        text = os_error_line(e) if isinstance(e, OSError) else " ".join(str(e).split())
        print(f"fedpartial-prepare: error: {text}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
