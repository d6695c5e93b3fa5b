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
                     pin_memory: bool = False):
        """A loader over the training images with the given views (key -> 'eval' / 'weak' / 'strong').

        ``batched``: the views are drawn per batch on ``device`` (:class:`~.batch_views.ViewLoader`: same kinds
        and parameter ranges, vectorised); otherwise per sample by the MONAI pipelines in the loader."""
        if not batched:
            return make_loader(self.dataset("train", views), batch_size, shuffle, seed, drop_last=drop_last,
                               num_workers=self.num_workers)
        loader = make_loader(self.dataset("train", SOURCE_VIEW), batch_size, shuffle, seed, drop_last=drop_last,
                             num_workers=self.num_workers)
        return ViewLoader(loader, views, BatchAugment(self.cfg.get("mean"), self.cfg.get("std")), seed, device,
                          pin_memory)

    def eval_loader(self, split: str, batch_size: int = 128):
        return make_loader(self.dataset(split, {"image": "eval"}), batch_size, False, 0,
                           num_workers=self.num_workers)

    def fetcher(self, views: dict[str, str], seed: int, batched: bool = False, device: torch.device | str = "cpu"):
        """``fetch(indices (B,)) -> device batch`` of chosen training rows with the given views, for methods that
        pick their own samples (FedLSM's pools); the views are reproducible from ``seed``."""
        if batched:
            ds, augment = self.dataset("train", SOURCE_VIEW), BatchAugment(self.cfg.get("mean"), self.cfg.get("std"))
            gen = torch.Generator().manual_seed(int(seed))
            return lambda idx: draw_views(torch.utils.data.default_collate([ds[int(i)] for i in idx]), views,
                                          augment, gen, device)
        ds = self.dataset("train", views).set_random_state(seed=int(seed))
        return lambda idx: {k: v.to(device) if torch.is_tensor(v) else v
                            for k, v in torch.utils.data.default_collate([ds[int(i)] for i in idx]).items()}
