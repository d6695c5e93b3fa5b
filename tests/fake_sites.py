"""The fake sites the method tests (and ``benchmarks/gpu_check.py``) train on, written once.

- :class:`FakeData`: in-memory images, labels and mask behind the methods of ``SiteDatasets`` a trainer uses (a
  non-``eval`` view adds a little noise);
- :func:`fake_site`: a :class:`~fedpartial.methods.SiteContext` over such data (each test file makes its own images
  and labels: the signal its method needs);
- :func:`manifest_site`: a site over real PNG files through the real pipeline (a written manifest, read back,
  ``SiteDatasets``), as a job's site reads its data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedpartial.data.manifest import read_manifest, write_manifest
from fedpartial.data.sitedata import SiteDatasets
from fedpartial.methods import SiteContext


class FakeDataset(torch.utils.data.Dataset):
    def __init__(self, images, labels, mask, views):
        self.images, self.labels, self.mask, self.views = images, labels, mask, dict(views)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        item = {}
        for key, kind in self.views.items():
            img = self.images[i]
            item[key] = img if kind == "eval" else img + 0.05 * torch.randn_like(img)
        item.update(label=self.labels[i].clone(), mask=self.mask[i].clone(), index=torch.tensor(i, dtype=torch.int64))
        return item


class FakeData:
    """The methods of SiteDatasets a trainer uses."""

    def __init__(self, images, labels, mask):
        self.images, self.labels, self.mask = images, labels, mask

    def dataset(self, split, views):
        return FakeDataset(self.images, self.labels, self.mask, views)

    def train_loader(self, views, batch_size, shuffle=True, seed=0, drop_last=False, **_):
        g = torch.Generator().manual_seed(int(seed))
        return torch.utils.data.DataLoader(
            self.dataset("train", views), batch_size=batch_size, shuffle=shuffle, generator=g, drop_last=drop_last
        )

    def fetcher(self, views, seed, batched=False, device="cpu", on_device="off"):
        ds = self.dataset("train", views)
        return lambda idx: torch.utils.data.default_collate([ds[int(i)] for i in idx])


def fake_site(
    name: str,
    task: str,
    annotated,
    images: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    model: torch.nn.Module,
    train: dict,
    seed: int = 0,
    tmp: Path | None = None,
) -> SiteContext:
    """A site context over ``images`` ``(N, 3, S, S)``, ``labels`` and ``mask`` ``(N, C)`` (labels already 0 where
    not annotated), on the CPU, classes ``c0 .. c{C-1}``."""
    return SiteContext(
        site=name,
        task=task,
        classes=[f"c{i}" for i in range(labels.shape[1])],
        annotated=np.asarray(annotated, bool),
        model=model,
        data=FakeData(images, labels, mask),
        device=torch.device("cpu"),
        state_dir=tmp or Path("."),
        train=train,
        seed=seed,
    )


def manifest_site(
    root: Path,
    k: int,
    n: int,
    task: str,
    annotated: np.ndarray,
    ds: dict,
    model: torch.nn.Module,
    train: dict,
    state_dir: Path,
    n_val: int = 4,
    device: str = "cpu",
) -> SiteContext:
    """A site ``site-{k+1}`` over the PNG files ``k*n .. k*n+n-1`` of ``root`` (the last ``n_val`` for validation),
    through a written manifest: multi-label rows positive with probability 0.4, single-label rows of a random class
    (a row whose class the site does not annotate is unlabelled)."""
    C = len(ds["classes"])
    rng = np.random.default_rng(k)
    labels = (rng.random((n, C)) < 0.4).astype(float) if task == "multilabel" else np.eye(C)[rng.integers(0, C, n)]
    mask = np.repeat(np.asarray(annotated)[None], n, 0)
    rel = [f"{k * n + i}.png" for i in range(n)]
    path = root / f"site{k}_{task}.csv"
    write_manifest(path, rel, labels * mask, mask, ds["classes"], splits=["train"] * (n - n_val) + ["val"] * n_val)
    full = read_manifest(path, ds["classes"], data_root=root, task=task, require_annotated=False)
    data = SiteDatasets({"train": full.subset("train"), "val": full.subset("val")}, ds)
    state_dir.mkdir(parents=True, exist_ok=True)
    return SiteContext(
        site=f"site-{k + 1}",
        task=task,
        classes=list(ds["classes"]),
        annotated=annotated,
        model=model,
        data=data,
        device=torch.device(device),
        state_dir=state_dir,
        seed=k,
        train=train,
    )
