"""The ``dataset`` section of a job, typed and checked like every other section: :class:`DatasetOptions` (the
section's keys after its preset is merged in) and the three option groups of its ``prepare`` sub-section
(:class:`SplitOptions`, :class:`LabelOptions`, :class:`ImageOptions`, also :func:`fedpartial.data.prepare.prepare`'s
keywords and ``fedpartial-prepare``'s options).

:func:`check_dataset` is what every reader of a ``dataset`` section goes through
(:func:`fedpartial.data.presets.resolve_dataset`: ``job.py``, the exported job's sites and server, predict, the
statistics job): an unknown or misspelt key, a value of the wrong type or an impossible one is one
:class:`~fedpartial.options.OptionError` line naming the key (with a did-you-mean), before anything starts.
Light on purpose (the standard library and :mod:`fedpartial.options`): a site's run time imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Literal, get_args

from ..options import OptionError, build, check_known, opt, option_names

CacheMode = Literal["store", "disk", "memory", "none"]  # how the site keeps decoded images (fedpartial.data.sitedata)
CACHE_MODES = get_args(CacheMode)
ResizeMode = Literal["area", "bilinear", "bicubic", "nearest"]  # the filters of fedpartial.data.decode.RESIZE_FILTERS
RESIZE_MODES = get_args(ResizeMode)
PROTOCOL_ARGS = {"missing_k": ("k",), "random_s": ("s",), "table": ("table",), "labeled_unlabeled": ("m",), "full": ()}
"""Each annotation protocol's parameters (:data:`fedpartial.data.protocols.PROTOCOLS`, which checks them)."""
PROTOCOL_PARAMS = tuple(dict.fromkeys(p for params in PROTOCOL_ARGS.values() for p in params))
SPEC_KEYS = ("source", "root", "num_sites", "protocol", "source_args", "sources", "refresh", "verbose", "overwrite")
"""The keys of a ``prepare`` section besides the option groups' and the protocol's (fedpartial.data.prepare's
``ensure_prepared``: the source, its folder, the sites, the protocol, the loader's arguments, a federation of
sources, and three that do not change the data)."""


@dataclass(frozen=True)
class SplitOptions:
    """How the rows become the shared validation / test sets and the sites' training sets."""

    seed: int = opt(0, "seed of the splits, the site assignment and the randomised protocols")
    val_frac: float = opt(
        0.1,
        "fraction of the images (split by patient) for the shared validation set (the publisher's split replaces "
        "it where the loader read one: --source-arg official_split=true)",
    )
    test_frac: float = opt(0.2, "fraction of the images (split by patient) for the shared test set")
    site_sizes: int | list[int] | None = opt(None, "cap on training images per site (one int, or one per site; iid)")
    partition: Literal["iid", "centre", "dirichlet", "quantity"] = opt(
        "iid", "how training rows are dealt to the sites (fedpartial.data.partition)"
    )
    alpha: float = opt(0.5, "the Dirichlet concentration of the dirichlet and quantity partitions")


@dataclass(frozen=True)
class LabelOptions:
    """Which classes the federation has, of which task, named how at which site."""

    classes: list[str] | None = opt(
        None,
        "the federation's classes (vocabulary), in the job's order, matched to the source's class names exactly "
        "or case-insensitively; with num_sites 1 (a site preparing its own export alone) a class the source lacks "
        "or leaves blank is not annotated here; with sources, the global class list",
    )
    top_k_classes: int | None = opt(None, "keep the k most frequent classes (after classes)")
    task: Literal["multilabel", "multiclass"] | None = opt(
        None,
        "the federation's task: a CSV export is read as such (its task=auto says what it chose and why "
        "otherwise); any other source must be of this task",
    )
    vocabularies: dict | None = opt(
        None,
        "{site: vocabulary}, a vocabulary being a name of fedpartial.data.vocabulary.VOCABULARIES or {global "
        "class: column name}: those sites' manifests use these column names",
    )
    centralise: bool = opt(False, "pool every site's rows (with the labels its site annotates) into site-1")


@dataclass(frozen=True)
class ImageOptions:
    """Which images are read, and how."""

    exclude: str | os.PathLike | list[str] | None = opt(
        None, "image names / ids / relative paths to leave out (a file, one per line, or a list)"
    )
    decode_images: bool = opt(True, "fully decode every image once (cached by path, size and mtime)")
    drop_unreadable: bool = opt(False, "leave unreadable images out (reported) instead of stopping")


OPTION_GROUPS = (SplitOptions, LabelOptions, ImageOptions)


def prepare_options(
    settings: dict,
    split: SplitOptions | None = None,
    labels: LabelOptions | None = None,
    images: ImageOptions | None = None,
    where: str = "prepare",
) -> tuple[SplitOptions, LabelOptions, ImageOptions, dict]:
    """Flat settings (a job's ``dataset.prepare`` keys, :func:`prepare`'s keywords) -> the three option groups
    (each key overriding the given group's value, type-checked: :func:`fedpartial.options.build`) and the
    protocol's parameters (every other key: ``k``, ``s``, ``m``, ``table``; checked by the protocol)."""
    groups = [g if g is not None else cls() for g, cls in zip((split, labels, images), OPTION_GROUPS)]
    rest = dict(settings)
    for i, cls in enumerate(OPTION_GROUPS):
        mine = {k: rest.pop(k) for k in list(rest) if k in option_names(cls)}
        if mine:
            current = {f.name: getattr(groups[i], f.name) for f in fields(cls)}
            groups[i] = build(cls, {**current, **mine}, where)
    return groups[0], groups[1], groups[2], rest


def prepare_keys() -> set[str]:
    """Every key a ``dataset.prepare`` section may hold."""
    return set(SPEC_KEYS) | set(PROTOCOL_PARAMS) | option_names(*OPTION_GROUPS)


def check_prepare(spec: dict, where: str) -> None:
    """A ``dataset.prepare`` section's keys (unknown: one line with the closest valid key) and the option groups'
    value types (:func:`prepare_options`); the protocol checks its parameter itself when it runs."""
    check_known(spec, prepare_keys(), where)
    prepare_options({k: v for k, v in spec.items() if k not in SPEC_KEYS and k not in PROTOCOL_PARAMS}, where=where)
    n = spec.get("num_sites")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise OptionError(f"{where}.prepare: option 'num_sites' must be a positive integer, got {n!r}")


@dataclass(frozen=True)
class DatasetOptions:
    """A job's ``dataset`` section after its preset is merged in (:func:`fedpartial.data.presets.resolve_dataset`)."""

    name: str = opt("", "the dataset's name (the preset's; results and the data check name it)")
    task: Literal["multilabel", "multiclass"] = opt("multilabel", "multi-label (sigmoid) or multi-class (softmax)")
    classes: list[str] = opt(None, "the federation's classes, in the model's output order")
    channels: Literal[1, 3] = opt(1, "image channels the model sees: 1 (grey) or 3 (RGB)")
    image_size: int = opt(64, "images are resized to image_size x image_size pixels")
    ct_windows: list | None = opt(None, "CT windows [[centre, width], ...], one channel each (DICOM CT only)")
    mean: list[float] | None = opt(None, "per-channel mean the images are normalised with (0-1 scale)")
    std: list[float] | None = opt(None, "per-channel standard deviation (0-1 scale)")
    resize_mode: ResizeMode = opt("area", "the resampling filter")
    cache: CacheMode = opt(
        "store", "how a site keeps decoded images: its image store (read from disk or held in memory) or none"
    )
    cache_dir: str | None = opt(None, "the folder of the site's image stores and prepared data")
    prepare: dict | None = opt(None, "how the simulated split is made (fedpartial-prepare's options)")
    prepared: str | None = opt(None, "a fedpartial-prepare folder: simulated site-<i> trains on its site-<i>.csv")
    site_data: dict | None = opt(None, "{site: folder}: each simulated site's own fedpartial-prepare --sites 1 folder")
    require_site_config: bool = opt(False, "a site must name its data in its local dataset config")


def check_dataset(full: dict, where: str = "dataset") -> dict:
    """``full`` (a merged ``dataset`` section) checked: every key known, every value of its type and possible;
    returns it unchanged. Raises :class:`~fedpartial.options.OptionError` (one line naming the key)."""
    values = dict(full)
    build(DatasetOptions, values, where)
    if not values["classes"] or len(set(values["classes"])) != len(values["classes"]):
        raise OptionError(f"{where}: option 'classes' must name distinct classes, got {values['classes']!r}")
    if values["image_size"] < 8:
        raise OptionError(f"{where}: option 'image_size' must be at least 8 pixels, got {values['image_size']!r}")
    channels = values["channels"]
    for key in ("mean", "std"):
        v = values.get(key)
        if v is not None and len(v) != channels:
            raise OptionError(f"{where}: option {key!r} needs one value per channel ({channels}), got {v!r}")
    if values.get("std") is not None and min(values["std"]) <= 0:
        raise OptionError(f"{where}: option 'std' must be positive, got {values['std']!r}")
    for w in values.get("ct_windows") or []:
        if not isinstance(w, (list, tuple)) or len(w) != 2 or not all(isinstance(x, (int, float)) for x in w):
            raise OptionError(f"{where}: option 'ct_windows' must be [[centre, width], ...], got {w!r}")
        if w[1] <= 0:
            raise OptionError(f"{where}: option 'ct_windows' has a window of width {w[1]!r} (must be > 0)")
    if values.get("prepare") is not None:  # "job 'x' 'dataset'" -> "job 'x' 'dataset.prepare'"
        check_prepare(values["prepare"], where[:-1] + ".prepare'" if where.endswith("'") else f"{where}.prepare")
    return full
