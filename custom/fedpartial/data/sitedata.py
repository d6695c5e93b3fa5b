"""A site's datasets: each split's images read from its image store (decoded once, uint8), viewed with any
augmentation the method asks for, converted to float on the training device.

The data layer reads one way: source (:mod:`.sources`, :mod:`.prepare`) -> manifest (:mod:`.manifest`) ->
image store (:mod:`.store`) -> site dataset (here) -> loader (:mod:`.batch_views`).

``dataset.cache`` (a job's dataset config):

- ``"store"`` (default) and ``"disk"``: the image store under the cache root (``dataset.cache_dir``, else
  ``$FEDPARTIAL_CACHE/stores``), memory-mapped: it survives job starts, and simulated sites opening the same
  validation / test store share its pages.
- ``"memory"``: the same store, copied into the process's memory once (uint8, a quarter of a float32 cache).
- ``"none"``: no store; every access decodes the file again, as the store would (:class:`~.store.DecodedImages`:
  the same uint8 values), nothing kept (tiny tests, ``fedpartial-predict``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .batch_views import BatchAugment, IndexDataset, ViewLoader, draw_views, gather
from .dataset import SOURCE_VIEW, ManifestDataset, StoreImages, make_loader
from .manifest import Manifest, ManifestError
from .settings import CACHE_MODES
from .store import DecodedImages, DecodeFailure, ImageStore, Preprocessing, ensure_store, release_free_heap

__all__ = ["SiteDatasets", "IndexDataset", "gather", "STORE_MODES"]
STORE_MODES = tuple(m for m in CACHE_MODES if m != "none")  # every cache mode but 'none' reads the image store


class StoreBatches:
    """Batches ``{"source": (B, c, S, S) uint8, "label", "mask", "index"}`` gathered from an image store in the
    order of ``order`` (a loader of index batches: the same order a loader over the dataset with the same seed
    gives). One fancy index per batch (no per-item Python work, no worker processes)."""

    def __init__(self, images, labels: torch.Tensor, mask: torch.Tensor, order, dataset=None):
        self.images, self.labels, self.mask, self.order = images, labels, mask, order
        self.dataset = dataset if dataset is not None else order.dataset

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        for idx in self.order:
            idx = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
            yield fetch_rows(self.images, self.labels, self.mask, idx)
        release_free_heap()  # the pass's batch arrays: back to the system, not kept as free heap


def fetch_rows(images, labels: torch.Tensor, mask: torch.Tensor, idx) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of a store (``ImageStore`` or uint8 array) as a host batch like :class:`StoreBatches`'."""
    idx = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
    if isinstance(images, (ImageStore, DecodedImages)):
        src = images.batch(idx.numpy())
    else:
        src = np.asarray(images)[idx.numpy()]
    return {
        "source": torch.from_numpy(src),
        "label": labels.index_select(0, idx),
        "mask": mask.index_select(0, idx),
        "index": idx.clone(),
    }


def index_batches(n: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False):
    """A loader of the row-index batches ``(B,)`` in the order :func:`~.dataset.make_loader` gives with the same
    arguments (the same seeded ``RandomSampler``), without MONAI or worker processes."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return torch.utils.data.DataLoader(
        IndexDataset(n), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, generator=g
    )


class SiteDatasets:
    """Datasets over a site's manifests (``train`` and optionally ``val`` / ``test``).

    ``dataset`` is the resolved dataset config (image_size, channels, mean, std, ct_windows, cache, cache_dir).
    ``log_fn``: where build progress goes (``k / N`` lines; a tqdm bar on a terminal when None).
    """

    def __init__(
        self,
        manifests: dict[str, Manifest],
        dataset: dict,
        cache_dir: str | Path | None = None,
        num_workers: int = 0,
        log_fn: Callable[[str], None] | None = None,
    ):
        self.manifests, self.cfg = manifests, dataset
        self.cache_dir, self.num_workers, self.log_fn = cache_dir, num_workers, log_fn
        self.mode = dataset.get("cache", "store")
        if self.mode not in (*STORE_MODES, "none"):
            raise ValueError(f"dataset 'cache' must be one of {(*STORE_MODES, 'none')}, got {self.mode!r}")
        self.channels = int(dataset["channels"])
        self._stores: dict[str, ImageStore] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._base: dict[str, ManifestDataset] = {}
        self._resident: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------------- stores
    @property
    def uses_store(self) -> bool:
        """Whether the splits are kept in an image store (every mode but ``none``, which decodes as one would)."""
        return self.mode in STORE_MODES

    def store_name(self, split: str) -> str:
        m = self.manifests[split]
        stem = Path(m.file).stem if m.file else split
        return stem if stem == split else f"{stem}-{split}"

    def store(self, split: str, budget_s: float | None = None) -> ImageStore:
        """The split's image store, opened (no decoding when it is current) or built; a decoding failure is a
        :class:`ManifestError` at the row's manifest line."""
        if split not in self._stores and not self.uses_store:
            m = self.manifests[split]
            self._stores[split] = DecodedImages(m.paths, Preprocessing.of(self.cfg))
        if split not in self._stores:
            m = self.manifests[split]
            try:
                self._stores[split] = ensure_store(
                    m.paths,
                    Preprocessing.of(self.cfg),
                    self.cfg.get("cache_dir") or self.cache_dir,
                    self.store_name(split),
                    m.labels,
                    m.mask,
                    log_fn=self.log_fn,
                    budget_s=budget_s,
                )
            except DecodeFailure as e:
                row, msg = e.failures[0]
                more = f" ({len(e.failures) - 1} more undecodable image(s))" if len(e.failures) > 1 else ""
                raise ManifestError(
                    f"image {Path(m.paths[row]).name} cannot be decoded: {msg}{more}",
                    m.site or None,
                    m.file or None,
                    m.lines[row] if m.lines else None,
                ) from None
        return self._stores[split]

    def open_stores(self, budget_s: float | None = None) -> dict[str, ImageStore]:
        """Open (or build within ``budget_s`` seconds in all) every split's store; nothing without a store."""
        import time

        if not self.uses_store:
            return {}
        t0 = time.monotonic()
        for split in self.manifests:
            left = None if budget_s is None else max(0.0, budget_s - (time.monotonic() - t0))
            self.store(split, left)
        release_free_heap()  # the index reads of the checks
        return dict(self._stores)

    def images(self, split: str):
        """The split's stored images: the store (memory-mapped) or, with ``cache: memory``, a copy in memory."""
        store = self.store(split)
        if self.mode != "memory":
            return store
        if split not in self._arrays:
            self._arrays[split] = np.array(store.images)
        return self._arrays[split]

    # ----------------------------------------------------------------------------------------------- datasets
    def dataset(self, split: str, views: dict[str, str]) -> ManifestDataset:
        if split not in self._base:
            c = self.cfg
            m = self.manifests[split]
            self._base[split] = ManifestDataset(
                m,
                StoreImages(self.images(split), self.channels),
                {"image": "eval"},
                int(c["image_size"]),
                self.channels,
                c.get("mean"),
                c.get("std"),
            )
        return self._base[split].with_views(views)

    def _augment(self) -> BatchAugment:
        return BatchAugment(self.cfg.get("mean"), self.cfg.get("std"), self.channels)

    def _batches(self, split: str, batch_size: int, shuffle: bool, seed: int, drop_last: bool):
        """Host batches of stored images (uint8) in the order a seeded loader gives."""
        ds = self.dataset(split, SOURCE_VIEW)
        order = index_batches(len(ds), batch_size, shuffle, seed, drop_last)
        return StoreBatches(self.images(split), ds.labels, ds.mask, order, dataset=ds)

    def train_loader(
        self,
        views: dict[str, str],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batched: bool = False,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        on_device: str = "off",
    ):
        """A loader over the training images with the given views (key -> 'eval' / 'weak' / 'strong').

        ``batched``: the views are drawn per batch on ``device`` (:class:`~.batch_views.ViewLoader`: same kinds
        and parameter ranges, vectorised; the batch crosses as uint8 and becomes float there); otherwise per
        sample by the MONAI pipelines in the loader. ``on_device`` ('auto' / 'on' / 'off', batched only): batches
        gathered from the training images kept on ``device`` (:meth:`resident`), in the order the loader would
        give."""
        if not batched:
            return make_loader(
                self.dataset("train", views),
                batch_size,
                shuffle,
                seed,
                drop_last=drop_last,
                num_workers=self.num_workers,
            )
        loader = self._batches("train", batch_size, shuffle, seed, drop_last)
        data, order = self.resident("train", device, on_device), None
        if data is not None:  # the same index batches, without the images
            order = index_batches(len(loader.dataset), batch_size, shuffle, seed, drop_last)
        return ViewLoader(loader, views, self._augment(), seed, device, pin_memory, order=order, resident=data)

    def resident(self, split: str, device: torch.device | str, mode: str = "auto") -> dict | None:
        """The split's stored images (uint8, as stored), labels, mask and row indices as tensors on ``device``
        (built once, kept for the site's life), or None: ``mode`` 'off'; 'auto' off a GPU, with loader workers,
        without the image store, or when the images would take more than a quarter of the GPU's free memory or a
        tenth of all of it (several simulated sites may share one GPU). Copied to the device in slices straight
        from the store: no second host copy of the split."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"train.data_on_device must be 'auto', 'on' or 'off', got {mode!r}")
        device = torch.device(device)
        key = (split, str(device))
        if mode == "off":
            return None
        if key in self._resident:
            return self._resident[key]
        ds = self.dataset(split, SOURCE_VIEW)
        if mode == "auto":
            if device.type != "cuda" or self.num_workers > 0 or not self.uses_store:
                return None
            store = self.store(split)
            need = len(ds) * store.channels * store.image_size**2  # uint8
            free, total = torch.cuda.mem_get_info(device)
            if need > 0.25 * free or need > 0.1 * total:  # simulated sites may share the GPU: each takes little
                return None
        src = self.images(split)
        arr = src.images if isinstance(src, (ImageStore, DecodedImages)) else src
        images = torch.empty(tuple(arr.shape), dtype=torch.uint8, device=device)
        for a in range(0, len(arr), 1024):
            images[a : a + 1024] = torch.from_numpy(np.array(arr[a : a + 1024])).to(device)
        self._resident[key] = {
            "source": images,
            "label": ds.labels.to(device),
            "mask": ds.mask.to(device),
            "index": torch.arange(len(ds), device=device),
        }
        return self._resident[key]

    def eval_loader(self, split: str, batch_size: int = 128, device: torch.device | str = "cpu"):
        """The split in order, ``{"image": (B, channels, S, S) float32 normalised, "label", "mask", "index"}`` on
        ``device``: read from the store in batches of ``batch_size``, converted and normalised on ``device``."""
        return ViewLoader(
            self._batches(split, batch_size, False, 0, False), {"image": "eval"}, self._augment(), 0, device
        )

    def fetcher(
        self,
        views: dict[str, str],
        seed: int,
        batched: bool = False,
        device: torch.device | str = "cpu",
        on_device: str = "off",
    ):
        """``fetch(indices (B,), keys=None) -> device batch`` of chosen training rows with the given views, for
        methods that pick their own samples (FedLSM's pools); the views are reproducible from ``seed``.
        ``keys``: only these of the views in the batch (None: all); the others are drawn all the same, so the
        later batches' views do not depend on it (batched views draw only their random numbers, no image work;
        per-sample views are made and left out). ``on_device``: as :meth:`train_loader` (batched only)."""
        if batched:
            ds, augment = self.dataset("train", SOURCE_VIEW), self._augment()
            gen = torch.Generator().manual_seed(int(seed))
            data = self.resident("train", device, on_device)
            if data is not None:
                return lambda idx, keys=None: draw_views(gather(data, idx), views, augment, gen, device, keys=keys)
            images = self.images("train")
            return lambda idx, keys=None: draw_views(
                fetch_rows(images, ds.labels, ds.mask, idx), views, augment, gen, device, keys=keys
            )
        ds = self.dataset("train", views).set_random_state(seed=int(seed))

        def fetch(idx, keys=None):
            batch = torch.utils.data.default_collate([ds[int(i)] for i in idx])
            return {
                k: v.to(device) if torch.is_tensor(v) else v
                for k, v in batch.items()
                if keys is None or k not in views or k in keys
            }

        return fetch
