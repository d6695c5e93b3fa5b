"""Random views drawn per batch (fedpartial.data.batch_views): the same operations as the MONAI pipelines for
given parameters, the same parameter ranges and probabilities, the same distribution of views, reproducible
from a seed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.transforms import AdjustContrast, Affine, Flip, GaussianSmooth, MedianSmooth
from scipy import stats

from fedpartial.data.batch_views import (
    BatchAugment,
    adjust_contrast,
    affine_theta,
    flip,
    gaussian_blur,
    median3,
    sample_affine,
    warp,
)
from fedpartial.data.transforms import KINDS, augment_transforms, plain_tensors
from fedpartial.data.views import VIEWS, ViewParams

WEAK_AFFINE, STRONG_AFFINE = VIEWS["weak"].affine, VIEWS["strong"].affine
NOISE_STD = VIEWS["strong"].noise_std


@pytest.mark.parametrize(
    "angle,tx,ty,sx,sy",
    [(0.3, 0, 0, 1, 1), (0, 2, 0, 1, 1), (0, 0, -3, 1, 1), (0, 0, 0, 1.1, 0.9), (-0.2, 1.5, -2, 1.05, 0.95)],
)
def test_warp_equals_monai_affine_for_the_same_parameters(angle, tx, ty, sx, sy):
    x = torch.rand(1, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    theta = affine_theta(torch.tensor([angle]), torch.tensor([[tx / 16, ty / 16]]), torch.tensor([[sx, sy]]))
    ref = Affine(
        rotate_params=angle,
        translate_params=(ty, tx),
        scale_params=(sy, sx),
        mode="bilinear",
        padding_mode="zeros",
        image_only=True,
    )(x[0])
    assert torch.allclose(warp(x, theta.float())[0], torch.as_tensor(ref), atol=1e-5)


def test_filters_equal_monai_per_sample():
    x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    assert torch.equal(median3(x), torch.stack([torch.as_tensor(MedianSmooth(radius=1)(v)) for v in x]))
    ties = torch.randint(0, 3, (2, 1, 9, 7), generator=torch.Generator().manual_seed(2)).float()  # many equal values
    assert torch.equal(median3(ties), torch.stack([torch.as_tensor(MedianSmooth(radius=1)(v)) for v in ties]))
    sigma = torch.tensor([[0.3, 0.8], [1.0, 0.1]])  # (x, y); MONAI's sigma is (rows, columns)
    ref = torch.stack([torch.as_tensor(GaussianSmooth(sigma=(float(s[1]), float(s[0])))(v)) for v, s in zip(x, sigma)])
    assert torch.allclose(gaussian_blur(x, sigma), ref, atol=1e-6)
    gamma = torch.tensor([0.8, 1.25])
    ref = torch.stack([torch.as_tensor(AdjustContrast(gamma=float(g))(v)) for v, g in zip(x, gamma)])
    assert torch.allclose(adjust_contrast(x, gamma), ref, atol=1e-6)


def test_affine_parameters_have_the_pipelines_ranges_and_probabilities():
    gen = torch.Generator().manual_seed(0)
    n = 20000
    weak = sample_affine(n, WEAK_AFFINE, gen)
    assert stats.kstest(weak["angle"].numpy(), stats.uniform(-math.radians(10), math.radians(20)).cdf).pvalue > 1e-3
    for axis in (0, 1):
        assert stats.kstest(weak["shift"][:, axis].numpy(), stats.uniform(-0.02, 0.04).cdf).pvalue > 1e-3
    assert torch.all(weak["scale"] == 1)
    strong = sample_affine(n, STRONG_AFFINE, gen)
    identity = (strong["angle"] == 0) & (strong["shift"] == 0).all(1) & (strong["scale"] == 1).all(1)
    assert stats.binomtest(int(identity.sum()), n, 0.15).pvalue > 1e-3  # the affine is drawn with p = 0.85
    drawn = ~identity
    assert strong["angle"][drawn].abs().max() <= math.radians(15) and strong["shift"][drawn].abs().max() <= 0.1
    assert stats.kstest(strong["scale"][drawn, 0].numpy(), stats.uniform(0.9, 0.2).cdf).pvalue > 1e-3


def _views(kind: str, image: torch.Tensor, n: int, batched: bool) -> torch.Tensor:
    if batched:
        return BatchAugment()(image.expand(n, *image.shape).clone(), kind, torch.Generator().manual_seed(3))
    tf = augment_transforms(kind, image.shape[-1])
    tf.set_random_state(seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # MONAI's per-sample transforms are many times slower with several threads
    try:
        with plain_tensors():
            return torch.stack([torch.as_tensor(tf({"image": image.clone()})["image"]) for _ in range(n)])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["flip", "weak", "strong"])
def test_batched_views_have_the_distribution_of_the_monai_views(kind):
    """300 views of one image, batched against MONAI per sample: the same distribution of how far a view moves
    from the image and of its brightness (two-sample KS), and the same mean view."""
    g = torch.Generator().manual_seed(0)
    image = torch.zeros(1, 24, 24)
    image[:, 4:12, 6:20] = 1.0  # an off-centre bright block: flips, shifts and rotations all move it
    image += 0.1 * torch.rand(1, 24, 24, generator=g)
    a, b = _views(kind, image, 300, True), _views(kind, image, 300, False)
    moved = lambda v: (v - image).abs().mean((1, 2, 3))  # noqa: E731
    for stat in (moved, lambda v: v.mean((1, 2, 3))):
        assert stats.ks_2samp(stat(a).numpy(), stat(b).numpy()).pvalue > 1e-3
    assert (a.mean(0) - b.mean(0)).abs().mean() < 0.02
    assert moved(a).std() > 0.005  # the views do vary


def test_views_are_reproducible_from_the_seed_and_differ_per_sample():
    x = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    aug = BatchAugment(mean=[0.5] * 3, std=[0.25] * 3)
    one = aug(x, "strong", torch.Generator().manual_seed(11))
    assert torch.equal(one, aug(x, "strong", torch.Generator().manual_seed(11)))
    assert not torch.equal(one, aug(x, "strong", torch.Generator().manual_seed(12)))
    same = aug(x[:1].expand(8, -1, -1, -1).clone(), "weak", torch.Generator().manual_seed(11))
    assert len({tuple(v.flatten()[:50].tolist()) for v in same}) == 8  # one image, eight different views
    assert torch.allclose(aug(x, "eval", torch.Generator()), (x - 0.5) / 0.25)  # eval: normalisation only
    with pytest.raises(ValueError, match="augmentation kind"):
        aug(x, "medium", torch.Generator())


def test_flip_view_is_monais_horizontal_flip_with_probability_one_half():
    """The "flip" kind (FedLSM's weak view): for a given draw the same operation as MONAI's horizontal flip
    (``Flip(spatial_axis=1)`` on ``(C, H, W)``), nothing else; flipped with probability 0.5, per sample; the same
    seed gives the same views; both pipelines know the kind."""
    x = torch.rand(6, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([torch.as_tensor(Flip(spatial_axis=1)(v)) for v in x])
    assert torch.equal(flip(x, torch.ones(6, dtype=torch.bool), 3), ref)
    # by hand on a 1 x 1 x 3 row: [1, 2, 3] -> [3, 2, 1]
    row = torch.tensor([[[[1.0, 2.0, 3.0]]]])
    assert flip(row, torch.tensor([True]), 3).flatten().tolist() == [3.0, 2.0, 1.0]
    aug = BatchAugment(mean=[0.5, 0.5], std=[0.25, 0.25])
    n = 4000
    big = torch.rand(n, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    views = aug(big, "flip", torch.Generator().manual_seed(7))
    norm = (big - 0.5) / 0.25
    kept = (views == norm).flatten(1).all(1)
    flipped = (views == norm.flip(3)).flatten(1).all(1)
    assert bool((kept | flipped).all())  # every view is the image or its mirror: no rotation, shift or noise
    assert stats.binomtest(int(flipped.sum()), n, 0.5).pvalue > 1e-3
    assert torch.equal(views, aug(big, "flip", torch.Generator().manual_seed(7)))  # reproducible from the seed
    assert not torch.equal(views, aug(big, "flip", torch.Generator().manual_seed(8)))
    assert "flip" in KINDS
    tf = augment_transforms("flip", 8)
    tf.set_random_state(seed=0)
    with plain_tensors():
        outs = [torch.as_tensor(tf({"image": x[0].clone()})["image"]) for _ in range(200)]
    m_flipped = sum(bool(torch.equal(o, ref[0])) for o in outs)
    assert all(torch.equal(o, x[0]) or torch.equal(o, ref[0]) for o in outs)
    assert stats.binomtest(m_flipped, 200, 0.5).pvalue > 1e-3


def test_strong_view_noise_is_drawn_on_the_device_with_the_old_distribution():
    """The Gaussian noise of the strong view comes from a generator of the training device seeded from the view's
    generator (no full-batch host draw and copy). The RNG order changed, so the numbers differ from the former
    host draw (``torch.randn`` of the whole batch on the CPU, x 0.03); their distribution does not: two-sample KS
    against the former draw, std 0.03, and the same seed gives the same noise."""
    from fedpartial.data.batch_views import gaussian_noise

    shape = (8, 3, 32, 32)
    new = gaussian_noise(shape, 123, "cpu", torch.float32) * NOISE_STD
    assert torch.equal(new, gaussian_noise(shape, 123, "cpu", torch.float32) * NOISE_STD)
    assert not torch.equal(new, gaussian_noise(shape, 124, "cpu", torch.float32) * NOISE_STD)
    old = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * NOISE_STD  # the former host-side draw
    assert stats.ks_2samp(new.flatten().numpy(), old.flatten().numpy()).pvalue > 1e-3
    assert abs(float(new.std()) - NOISE_STD) < 1e-3 and abs(float(new.mean())) < 1e-3
    # inside the strong view: the samples given noise differ from the image by that noise only (x in (0.2, 0.8):
    # the clip to [0, 1] never acts), and the others by no noise
    x = 0.2 + 0.6 * torch.rand(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    out = BatchAugment._filter(x, VIEWS["strong"], torch.Generator().manual_seed(3))
    diff = (out - x).flatten(1)
    noisy = [d for d in diff if d.abs().max() > 0 and stats.kstest(d.numpy(), "norm", (0, NOISE_STD)).pvalue > 1e-3]
    assert 5 <= len(noisy) <= 30  # p = 0.7 / 3 of 64 samples, about 15


def test_prefetching_view_loader_gives_the_same_batches_and_stops_when_left_early():
    """``ViewLoader(prefetch=2)`` collates ahead in a background thread: the same batches, in the same order, with
    the same views (bit for bit) as without; leaving the loop early ends the thread; a loader error reaches the
    consumer."""
    import threading

    from fedpartial.data.batch_views import ViewLoader

    data = [
        {"source": torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(i)), "index": torch.tensor(i)}
        for i in range(40)
    ]
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    views = {"image": "strong", "image_2": "weak"}

    def run(prefetch):
        loader.generator.manual_seed(1)
        return list(ViewLoader(loader, views, BatchAugment(), seed=5, prefetch=prefetch))

    plain, ahead = run(0), run(2)
    assert len(plain) == len(ahead) == 5
    for a, b in zip(plain, ahead):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = threading.active_count()
    it = iter(ViewLoader(loader, views, BatchAugment(), seed=5, prefetch=2))
    next(it)
    it.close()  # what leaving a for loop early does
    assert threading.active_count() == before

    class Broken:
        dataset = data

        def __len__(self):
            return 1

        def __iter__(self):
            raise OSError("unreadable batch")

    with pytest.raises(OSError, match="unreadable batch"):
        list(ViewLoader(Broken(), views, BatchAugment(), seed=5, prefetch=2))


def test_batches_gathered_on_the_device_equal_the_loaders(tmp_path):
    """``train.data_on_device: on`` gathers each batch from the site's images kept on the training device: the
    same batches (images, labels, mask, indices), order and views, bit for bit, as the loader over the cache,
    for shuffled and in-order loaders, a dropped last batch, several views; the fetcher (FedLSM's pools) too.
    'off' keeps nothing on the device; 'auto' keeps nothing on a CPU."""
    from PIL import Image

    from fedpartial.data.manifest import read_manifest, write_manifest
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.sitedata import SiteDatasets

    ds = resolve_dataset({"preset": "ich_phantom", "image_size": 16})
    classes = ds["classes"]
    rng = np.random.default_rng(0)
    n = 37
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    labels = (rng.random((n, len(classes))) < 0.4).astype(float)
    mask = np.repeat((np.arange(len(classes)) < 3)[None], n, 0)
    write_manifest(tmp_path / "m.csv", [f"{i}.png" for i in range(n)], labels * mask, mask, classes)
    site = SiteDatasets(
        {"train": read_manifest(tmp_path / "m.csv", classes, data_root=tmp_path, task="multilabel")}, ds
    )
    for seed, bs, shuffle, drop in ((0, 8, True, False), (3, 5, True, True), (1, 16, False, False)):
        for views in ({"image": "weak"}, {"image": "strong", "image_2": "flip"}):
            off = list(site.train_loader(views, bs, shuffle, seed, drop, batched=True, on_device="off"))
            on = list(site.train_loader(views, bs, shuffle, seed, drop, batched=True, on_device="on"))
            assert len(off) == len(on) == (n // bs if drop else math.ceil(n / bs))
            for a, b in zip(off, on):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [4, 0, 36, 4]
    a = site.fetcher({"image": "strong"}, 7, batched=True, on_device="off")(rows)
    b = site.fetcher({"image": "strong"}, 7, batched=True, on_device="on")(rows)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert b["index"].tolist() == rows
    fresh = SiteDatasets(site.manifests, ds)
    assert fresh.resident("train", "cpu", "off") is None and fresh.resident("train", "cpu", "auto") is None
    with pytest.raises(ValueError, match="data_on_device"):
        fresh.resident("train", "cpu", "always")


@pytest.mark.parametrize("kind", ["flip", "weak", "strong"])
def test_both_view_pipelines_draw_from_the_one_table(kind, monkeypatch):
    """Each view kind's parameters live in one table (``fedpartial.data.views.VIEWS``): with the kind set to
    "nothing random" there, the per-sample MONAI pipeline and the batched views both give the eval view (a pipeline
    with its own copy of the parameters would still flip, warp, filter); with the table's own values both change
    the image."""
    x = torch.rand(16, 1, 24, 24, generator=torch.Generator().manual_seed(3))
    batched = BatchAugment()
    mono = augment_transforms(kind, 24, keys=["image"])

    def per_sample(pipeline):
        return torch.stack([pipeline({"image": im.clone()})["image"] for im in x])

    assert not torch.allclose(batched(x, kind, torch.Generator().manual_seed(0)), x)
    assert not torch.allclose(per_sample(mono), x)
    monkeypatch.setitem(VIEWS, kind, ViewParams())
    assert torch.equal(batched(x, kind, torch.Generator().manual_seed(0)), x)
    assert torch.allclose(per_sample(augment_transforms(kind, 24, keys=["image"])), x)


SITE_PROCESS = """
import json, sys
import torch
import fedpartial.fl.executor  # what NVFlare imports to start a site
from fedpartial.data.dataset import make_loader
from fedpartial.data.manifest import read_manifest
from fedpartial.data.presets import resolve_dataset
from fedpartial.data.sitedata import SiteDatasets

root, classes = sys.argv[1], json.loads(sys.argv[2])
NORM = {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.6, 0.7]}
ds = resolve_dataset({"preset": "ich_phantom", "image_size": 16, "cache_dir": root + "/cache", **NORM})
site = SiteDatasets({"train": read_manifest(root + "/m.csv", classes, data_root=root, task="multilabel")}, ds)
batches = list(make_loader(site.dataset("train", {"image": "eval"}), 8, shuffle=True, seed=4))
batches += list(site.train_loader({"image": "weak"}, 8, True, 4, batched=True))
batches += list(site.eval_loader("train", 8))
torch.save(batches, root + "/batches.pt")
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"monai", "pandas", "matplotlib"})))
"""


def test_a_site_reading_the_image_store_never_imports_monai_and_its_eval_view_is_monais(tmp_path):
    """A site process that reads the image store (the default) imports neither MONAI nor pandas: each costs a site
    seconds of CPU at start-up (``benchmarks/import_cost.py``). Its eval view (normalise only) and seeded loader,
    drawn there without MONAI, give the batches MONAI's pipeline and DataLoader give, bit for bit."""
    import json
    import subprocess
    import sys

    from PIL import Image

    from fedpartial.data.dataset import make_loader
    from fedpartial.data.manifest import read_manifest, write_manifest
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.sitedata import SiteDatasets

    NORM = {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.6, 0.7]}  # per channel, as in SITE_PROCESS
    ds = resolve_dataset({"preset": "ich_phantom", "image_size": 16, "cache_dir": str(tmp_path / "cache"), **NORM})
    classes, rng, n = ds["classes"], np.random.default_rng(1), 21
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    labels = (rng.random((n, len(classes))) < 0.4).astype(float)
    write_manifest(tmp_path / "m.csv", [f"{i}.png" for i in range(n)], labels, np.ones_like(labels, bool), classes)
    out = subprocess.run(
        [sys.executable, "-c", SITE_PROCESS, str(tmp_path), json.dumps(classes)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []  # no MONAI, pandas or matplotlib at the site
    site = SiteDatasets(
        {"train": read_manifest(tmp_path / "m.csv", classes, data_root=tmp_path, task="multilabel")}, ds
    )
    with plain_tensors():  # this process has MONAI: its eval pipeline and DataLoader
        ref = list(make_loader(site.dataset("train", {"image": "eval"}), 8, shuffle=True, seed=4))
    assert type(make_loader(site.dataset("train", {"image": "eval"}), 8, True, 4)).__module__.startswith("monai")
    ref += list(site.train_loader({"image": "weak"}, 8, True, 4, batched=True))
    ref += list(site.eval_loader("train", 8))
    got = torch.load(tmp_path / "batches.pt", weights_only=True)
    assert len(got) == len(ref) == 3 * 3
    for a, b in zip(got, ref):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(got[0]["image"], got[3]["image"][: len(got[0]["image"])])  # eval is not the weak view


def test_a_view_left_out_draws_its_numbers_all_the_same(tmp_path):
    """``BatchAugment.draw`` takes from the generator exactly what a view of that kind takes (same numbers, same
    order, no image work), so a fetch that leaves a view out (``keys``: FedLSM's mixed samples need no strong
    view) gives the views it keeps, and every later batch's views, bit for bit as a fetch of every view; the
    per-sample fetcher leaves the view out of its batch too."""
    from PIL import Image

    from fedpartial.data.manifest import read_manifest, write_manifest
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.sitedata import SiteDatasets

    aug = BatchAugment(mean=[0.5] * 3, std=[0.25] * 3)
    x = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    for kind in KINDS:
        made, drawn = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
        aug(x, kind, made)
        params = aug.draw(len(x), kind, drawn)
        assert torch.equal(made.get_state(), drawn.get_state()), kind
        assert set(params) <= {"vflip", "hflip", "affine", "filter", "intensity"}
    assert aug.draw(6, "eval", torch.Generator()) == {}

    ds = resolve_dataset({"preset": "ich_phantom", "image_size": 16})
    classes = ds["classes"]
    rng = np.random.default_rng(1)
    n = 12
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    mask = np.repeat((np.arange(len(classes)) < 3)[None], n, 0)
    labels = (rng.random((n, len(classes))) < 0.4).astype(float) * mask
    write_manifest(tmp_path / "m.csv", [f"{i}.png" for i in range(n)], labels, mask, classes)
    site = SiteDatasets(
        {"train": read_manifest(tmp_path / "m.csv", classes, data_root=tmp_path, task="multilabel")}, ds
    )
    views = {"weak": "flip", "strong": "strong"}
    for on_device in ("off", "on"):
        every = site.fetcher(views, 7, batched=True, on_device=on_device)
        some = site.fetcher(views, 7, batched=True, on_device=on_device)
        a1, a2, a3 = every([0, 5, 3]), every([1, 2]), every([4, 11, 6, 7])
        b1, b2, b3 = some([0, 5, 3]), some([1, 2], keys=("weak",)), some([4, 11, 6, 7])
        assert "strong" not in b2 and torch.equal(a2["weak"], b2["weak"]) and torch.equal(a2["label"], b2["label"])
        for a, b in ((a1, b1), (a3, b3)):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    per_sample = site.fetcher(views, 7)([1, 2], keys=("weak",))
    assert set(per_sample) == {"weak", "label", "mask", "index"} and per_sample["weak"].shape == (2, 3, 16, 16)


def test_the_view_kind_is_defined_once():
    """Every method types its view options with ``ViewKind``, whose values are the kinds of ``VIEWS``; no method
    spells its own list of kinds."""
    import ast
    from typing import get_args

    from fedpartial.data.views import KINDS, ViewKind

    assert get_args(ViewKind) == KINDS
    methods = Path(__file__).resolve().parents[1] / "custom" / "fedpartial" / "methods"
    for path in methods.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
                values = {getattr(e, "value", None) for e in getattr(node.slice, "elts", [node.slice])}
                assert not values & set(KINDS), f"{path.name}: a Literal of view kinds {values}; use ViewKind"
