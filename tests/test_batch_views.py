"""Random views drawn per batch (fedpartial.data.batch_views): the same operations as the MONAI pipelines for
given parameters, the same parameter ranges and probabilities, the same distribution of views, reproducible
from a seed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from monai.transforms import Affine, AdjustContrast, GaussianSmooth, MedianSmooth
from scipy import stats

from fedpartial.data.batch_views import (STRONG_AFFINE, WEAK_AFFINE, BatchAugment, adjust_contrast, affine_theta,
                                         gaussian_blur, median3, sample_affine, warp)
from fedpartial.data.transforms import augment_transforms, plain_tensors


@pytest.mark.parametrize("angle,tx,ty,sx,sy", [(0.3, 0, 0, 1, 1), (0, 2, 0, 1, 1), (0, 0, -3, 1, 1),
                                               (0, 0, 0, 1.1, 0.9), (-0.2, 1.5, -2, 1.05, 0.95)])
def test_warp_equals_monai_affine_for_the_same_parameters(angle, tx, ty, sx, sy):
    x = torch.rand(1, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    theta = affine_theta(torch.tensor([angle]), torch.tensor([[tx / 16, ty / 16]]), torch.tensor([[sx, sy]]))
    ref = Affine(rotate_params=angle, translate_params=(ty, tx), scale_params=(sy, sx), mode="bilinear",
                 padding_mode="zeros", image_only=True)(x[0])
    assert torch.allclose(warp(x, theta.float())[0], torch.as_tensor(ref), atol=1e-5)


def test_filters_equal_monai_per_sample():
    x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    assert torch.equal(median3(x), torch.stack([torch.as_tensor(MedianSmooth(radius=1)(v)) for v in x]))
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


@pytest.mark.parametrize("kind", ["weak", "strong"])
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
