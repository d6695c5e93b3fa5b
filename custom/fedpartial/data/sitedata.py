"""A site's datasets: decoded once (cached), then viewed with any augmentation the method asks for."""

from __future__ import annotations

from pathlib import Path

import torch

from .batch_views import BatchAugment, ViewLoader, draw_views
from .dataset import SOURCE_VIEW, ManifestDataset, make_dataset, make_loader
from .manifest import Manifest


class SiteDatasets:
    """Cached datasets over a site's manifests (``train`` and optionally ``val`` / ``test``).

    ``dataset`` is the resolved dataset config (image_size, channels, mean, std, ct_windows, cache).
    Images are decoded and resized once per split (``cache``: 'memory' by default, 'disk' to survive process
    restarts); every view (eval / weak / strong) is drawn on top of the cached tensors.
    """

    def __init__(self, manifests: dict[str, Manifest], dataset: dict, cache_dir: str | Path | None = None,
                 num_workers: int = 0):
        self.manifests, self.cfg = manifests, dataset
        self.cache_dir, self.num_workers = cache_dir, num_workers
        self._base: dict[str, ManifestDataset] = {}
        self._resident: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def dataset(self, split: str, views: dict[str, str]) -> ManifestDataset:
        if split not in self._base:
            c = self.cfg
            self._base[split] = make_dataset(
                self.manifests[split], int(c["image_size"]), int(c["channels"]), c.get("mean"), c.get("std"),
                c.get("ct_windows"), views={"image": "eval"}, cache=c.get("cache", "memory"),
                cache_dir=self.cache_dir, num_workers=self.num_workers)
        return self._base[split].with_views(views)

    def train_loader(self, views: dict[str, str], batch_size: int, shuffle: bool = True, seed: int = 0,
                     drop_last: bool = False, batched: bool = False, device: torch.device | str = "cpu",
                     pin_memory: bool = False, on_device: str = "off"):
        """A loader over the training images with the given views (key -> 'eval' / 'weak' / 'strong').

        ``batched``: the views are drawn per batch on ``device`` (:class:`~.batch_views.ViewLoader`: same kinds
        and parameter ranges, vectorised); otherwise per sample by the MONAI pipelines in the loader.
        ``on_device`` ('auto' / 'on' / 'off', batched only): batches gathered from the training images kept on
        ``device`` (:meth:`resident`), in the order the loader would give."""
        if not batched:
            return make_loader(self.dataset("train", views), batch_size, shuffle, seed, drop_last=drop_last,
                               num_workers=self.num_workers)
        loader = make_loader(self.dataset("train", SOURCE_VIEW), batch_size, shuffle, seed, drop_last=drop_last,
                             num_workers=self.num_workers)
        data, order = self.resident("train", device, on_device), None
        if data is not None:  # the same index batches, without the images
            order = make_loader(IndexDataset(len(loader.dataset)), batch_size, shuffle, seed, drop_last=drop_last)
        return ViewLoader(loader, views, BatchAugment(self.cfg.get("mean"), self.cfg.get("std")), seed, device,
                          pin_memory, order=order, resident=data)

    def resident(self, split: str, device: torch.device | str, mode: str = "auto") -> dict | None:
        """The split's decoded images, labels, mask and row indices as tensors on ``device`` (built once, kept
        for the site's life), or None: ``mode`` 'off'; 'auto' off a GPU, with loader workers, without the
        in-memory cache, or when the images would take more than a quarter of the GPU's free memory or a tenth of
        all of it (several simulated sites may share one GPU)."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"train.data_on_device must be 'auto', 'on' or 'off', got {mode!r}")
        device = torch.device(device)
        key = (split, str(device))
        if mode == "off":
            return None
        if key in self._resident:
            return self._resident[key]
        ds = self.dataset(split, SOURCE_VIEW)
        c = self.cfg
        if mode == "auto":
            if device.type != "cuda" or self.num_workers > 0 or c.get("cache", "memory") != "memory":
                return None
            need = len(ds) * int(c["channels"]) * int(c["image_size"]) ** 2 * 4
            free, total = torch.cuda.mem_get_info(device)
            if need > 0.25 * free or need > 0.1 * total:  # simulated sites may share the GPU: each takes little
                return None
        images = torch.stack([ds.cached_image(i) for i in range(len(ds))]) if len(ds) else torch.zeros(0)
        self._resident[key] = {"source": images.to(device), "label": ds.labels.to(device),
                               "mask": ds.mask.to(device), "index": torch.arange(len(ds), device=device)}
        return self._resident[key]

    def eval_loader(self, split: str, batch_size: int = 128):
        return make_loader(self.dataset(split, {"image": "eval"}), batch_size, False, 0,
                           num_workers=self.num_workers)

    def fetcher(self, views: dict[str, str], seed: int, batched: bool = False, device: torch.device | str = "cpu",
                on_device: str = "off"):
        """``fetch(indices (B,)) -> device batch`` of chosen training rows with the given views, for methods that
        pick their own samples (FedLSM's pools); the views are reproducible from ``seed``. ``on_device``: as
        :meth:`train_loader` (batched only)."""
        if batched:
            ds, augment = self.dataset("train", SOURCE_VIEW), BatchAugment(self.cfg.get("mean"), self.cfg.get("std"))
            gen = torch.Generator().manual_seed(int(seed))
            data = self.resident("train", device, on_device)
            if data is not None:
                return lambda idx: draw_views(gather(data, idx), views, augment, gen, device)
            return lambda idx: draw_views(torch.utils.data.default_collate([ds[int(i)] for i in idx]), views,
                                          augment, gen, device)
        ds = self.dataset("train", views).set_random_state(seed=int(seed))
        return lambda idx: {k: v.to(device) if torch.is_tensor(v) else v
                            for k, v in torch.utils.data.default_collate([ds[int(i)] for i in idx]).items()}


class IndexDataset(torch.utils.data.Dataset):
    """Items ``0 .. n-1`` themselves: a loader over it gives the index batches (and order) a loader with the same
    arguments gives over any dataset of ``n`` items."""

    def __init__(self, n: int):
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def gather(data: dict[str, torch.Tensor], indices) -> dict[str, torch.Tensor]:
    """The rows ``indices`` (host ints / ``(B,)`` tensor) of every tensor of a :meth:`SiteDatasets.resident` split,
    as a batch like the loader's (``source``, ``label``, ``mask``, ``index``), on the tensors' device."""
    device = data["index"].device
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).to(device, non_blocking=True)
    return {k: v.index_select(0, idx) for k, v in data.items()}
