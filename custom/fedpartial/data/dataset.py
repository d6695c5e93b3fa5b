"""Torch datasets over a site :class:`~fedpartial.data.manifest.Manifest`, with decoded images cached.

The deterministic part (decode + resize, :func:`~fedpartial.data.transforms.preprocess_transforms`) runs once
per image and is cached in memory (MONAI ``CacheDataset``) or on disk (MONAI ``PersistentDataset``, survives
process restarts); the random views (:func:`~fedpartial.data.transforms.view_transforms`) are applied on top at
every access. :meth:`ManifestDataset.with_views` gives another set of views over the same cache.

Items are dicts::

    {<view key>: float32 (channels, S, S), ..., "label": float32 (C,), "mask": bool (C,), "index": int64 ()}

or, with the views ``SOURCE_VIEW``, ``{"source": (channels, S, S) in [0, 1], "label", "mask", "index"}`` for
views drawn per batch (:mod:`fedpartial.data.batch_views`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader as TorchDataLoader

from .batch_views import BatchAugment
from .manifest import Manifest
from .transforms import ImageLoadError, Window, plain_tensors, preprocess_transforms, view_transforms

MONAI_CACHES = ("memory", "disk", "none")  # make_dataset's MONAI caches (a site reads the image store: dataset.cache)
SOURCE_KEY = "source"  # items of a source-only dataset: the cached (channels, S, S) image in [0, 1], unnormalised
SOURCE_VIEW = {SOURCE_KEY: "source"}
EVAL_VIEW = {"image": "eval"}  # normalise only: drawn in plain torch (no MONAI import), the same numbers
RESERVED_KEYS = ("label", "mask", "index")
_CACHE_VERSION = 1  # bump when preprocessing changes so old disk caches are not reused


def _root_load_error(e: BaseException) -> BaseException:
    """The ImageLoadError behind MONAI's 'applying transform ...' RuntimeError chain (or ``e`` itself)."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ImageLoadError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return e


class ManifestDataset(torch.utils.data.Dataset):
    """Views of cached preprocessed images + labels of a manifest (build it with :func:`make_dataset`).

    Args:
        manifest: the site manifest (rows = items).
        base: a MONAI dataset over ``[{"image": path}, ...]`` returning ``{"image": (channels, S, S)}``.
        views: output key -> augmentation kind ('eval' / 'weak' / 'strong').
        image_size, channels, mean, std: passed to :func:`view_transforms`.
    """

    def __init__(
        self,
        manifest: Manifest,
        base: torch.utils.data.Dataset,
        views: Mapping[str, str],
        image_size: int,
        channels: int,
        mean: Sequence[float] | None,
        std: Sequence[float] | None,
    ):
        bad = [k for k in views if k in RESERVED_KEYS]
        if bad:
            raise ValueError(f"view keys {bad} clash with item keys {RESERVED_KEYS}")
        self.manifest, self.base, self.views = manifest, base, dict(views)
        self.image_size, self.channels = image_size, channels
        self.mean = None if mean is None else list(mean)
        self.std = None if std is None else list(std)
        self.labels = torch.as_tensor(manifest.labels, dtype=torch.float32)
        self.mask = torch.as_tensor(manifest.mask, dtype=torch.bool)
        self._normalise = BatchAugment(self.mean, self.std)  # the eval view in plain torch
        self._view_tf = None  # built on first per-sample use (MONAI imported then; batched views never need it)
        self._random_state: dict | None = None

    @property
    def view_tf(self):
        """The per-sample MONAI view pipeline (None for :data:`SOURCE_VIEW`), built on first use."""
        if self._view_tf is None and self.views != SOURCE_VIEW:
            self._view_tf = view_transforms(self.views, self.image_size, self.mean, self.std, channels=self.channels)
            if self._random_state is not None:
                self._view_tf.set_random_state(**self._random_state)
        return self._view_tf

    def __len__(self) -> int:
        return len(self.manifest)

    def cached_image(self, index: int) -> torch.Tensor:
        """The preprocessed ``(channels, S, S)`` image in [0, 1] (shared with the cache: do not modify)."""
        try:
            return self.base[index]["image"]
        except Exception as e:
            root = _root_load_error(e)
            if root is e:
                raise
            raise root from e

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.views == SOURCE_VIEW:  # the cached image itself; the views are drawn per batch (batch_views)
            stored = getattr(self.base, "stored", None)  # the image store: uint8, its own channels
            item = {SOURCE_KEY: stored(index) if stored is not None else self.cached_image(index)}
        elif self.views == EVAL_VIEW and "monai" not in sys.modules:  # normalise only (augment_transforms' "eval")
            x = self.cached_image(index).clone()
            item = {"image": self._normalise.normalise(x[None])[0].contiguous()}
        else:
            with plain_tensors():  # no MetaTensor bookkeeping: same numbers, faster
                item = self.view_tf({"image": self.cached_image(index).clone()})  # clone: some transforms work in place
        item["label"] = self.labels[index].clone()
        item["mask"] = self.mask[index].clone()
        item["index"] = torch.tensor(index, dtype=torch.int64)
        return item

    def with_views(self, views: Mapping[str, str]) -> "ManifestDataset":
        """A dataset over the same cache (no new decoding) with other views, e.g. ``{"image": "eval"}``."""
        return ManifestDataset(self.manifest, self.base, views, self.image_size, self.channels, self.mean, self.std)

    def set_random_state(self, seed: int | None = None, state=None) -> "ManifestDataset":
        """Seed the view augmentations (called by MONAI's DataLoader / worker_init_fn)."""
        if self._view_tf is not None:
            self._view_tf.set_random_state(seed=seed, state=state)
        elif self.views != SOURCE_VIEW:
            self._random_state = {"seed": seed, "state": state}
        return self


def _disk_cache_dir(
    cache_dir: str | os.PathLike, image_size: int, channels: int, ct_windows: Sequence[Window] | None, resize_mode: str
) -> Path:
    """A sub-folder keyed by the preprocessing settings, so changed settings never read stale tensors."""
    key = json.dumps(
        {
            "v": _CACHE_VERSION,
            "size": image_size,
            "channels": channels,
            "resize": resize_mode,
            "windows": [list(map(float, w)) for w in ct_windows] if ct_windows else None,
        },
        sort_keys=True,
    )
    d = Path(cache_dir) / f"pre_{image_size}px_{channels}ch_{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def make_dataset(
    manifest: Manifest,
    image_size: int,
    channels: int,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    ct_windows: Sequence[Window] | None = None,
    views: Mapping[str, str] | None = None,
    monai_cache: str = "memory",
    cache_dir: str | os.PathLike | None = None,
    num_workers: int = 0,
    resize_mode: str = "area",
) -> ManifestDataset:
    """Dataset over ``manifest`` with items ``{view keys: (channels, S, S) float32, label, mask, index}``.

    Args:
        views: output key -> kind, default ``{"image": "eval"}``.
        monai_cache: 'memory' (CacheDataset, all images decoded now with ``num_workers`` threads), 'disk'
            (PersistentDataset under ``cache_dir``, decoded on first access, reused by later processes) or 'none'
            (not the dataset configuration's ``cache``, which names where a site keeps its image store).
        resize_mode: MONAI ``Resized`` mode ('area' suits downscaling, 'bilinear' upscaling).

    Raises:
        ImageLoadError: an image is missing or unreadable (names the file); for 'memory' already here.
    """
    if monai_cache not in MONAI_CACHES:
        raise ValueError(f"monai_cache must be one of {MONAI_CACHES}, got {monai_cache!r}")
    from monai.data import CacheDataset, PersistentDataset  # imported where used (see fedpartial.data.transforms)
    from monai.data import Dataset as MonaiDataset

    pre = preprocess_transforms(image_size, channels, ct_windows, resize_mode=resize_mode)
    data = [{"image": p} for p in manifest.paths]
    try:
        if monai_cache == "memory":
            base = CacheDataset(
                data, pre, cache_rate=1.0, num_workers=max(1, num_workers), progress=False, copy_cache=False
            )
        elif monai_cache == "disk":
            if cache_dir is None:
                raise ValueError("monai_cache='disk' needs a cache_dir")
            base = PersistentDataset(
                data, pre, cache_dir=_disk_cache_dir(cache_dir, image_size, channels, ct_windows, resize_mode)
            )
        else:
            base = MonaiDataset(data, pre)
    except Exception as e:
        root = _root_load_error(e)
        if root is e:
            raise
        raise root from e
    return ManifestDataset(manifest, base, views or {"image": "eval"}, image_size, channels, mean, std)


def make_loader(
    dataset: torch.utils.data.Dataset,
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool = False,
    num_workers: int = 0,
) -> TorchDataLoader:
    """A DataLoader with a seeded generator: the same ``seed`` gives the same order and, through MONAI's
    seeding of the dataset's random transforms (also in worker processes), the same augmentations (MONAI's
    DataLoader where the dataset may hold MONAI transforms, else torch's: the same batches).
    Use a different seed per round / epoch series to get fresh draws."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    loader = TorchDataLoader
    if "monai" in sys.modules:  # MONAI's DataLoader seeds MONAI's random transforms (also in worker processes)
        from monai.data import DataLoader as loader
    # A process that never imported MONAI holds no MONAI transform (the image store's datasets with the batched
    # device views), and there MONAI's DataLoader is torch's: its extra steps touch only MONAI objects, and the
    # generator it draws from is put back. Importing MONAI for it would slow every site's start
    # (``python benchmarks/import_cost.py`` measures it).
    return loader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=g,
        persistent_workers=False,
    )


class StoreImages(torch.utils.data.Dataset):
    """A base dataset (as :func:`make_dataset`'s MONAI ones) over an image store
    (:class:`~fedpartial.data.store.ImageStore`): ``{"image": (channels, S, S) float32 in [0, 1]}`` per item for
    the per-sample pipelines, and :meth:`stored` (``(c, S, S)`` uint8 as stored) for the batched views.

    ``source``: the :class:`~fedpartial.data.store.ImageStore` (its memory map, opened again in each process that
    unpickles it) or an ``(N, c, S, S)`` uint8 array (a copy in memory)."""

    def __init__(self, source, channels: int):
        self.source, self.channels = source, int(channels)

    @property
    def images(self):
        return getattr(self.source, "images", self.source)

    def __len__(self) -> int:
        return len(self.images)

    def stored(self, index: int) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(np.array(self.images[index]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = self.stored(index).float().div_(255.0)
        if x.shape[0] != self.channels:
            x = x.expand(self.channels, -1, -1).contiguous()
        return {"image": x}
