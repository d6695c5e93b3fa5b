"""The random views of a training image, as one table both view pipelines read: the per-sample MONAI pipelines of
:func:`fedpartial.data.transforms.augment_transforms` (``train.views: per_sample``) and the batched device views of
:mod:`fedpartial.data.batch_views` (``batched``, the default). A parameter changed here changes both;
``tests/test_batch_views.py`` checks that each pipeline draws from this table.

- ``"eval"``: normalise only.
- ``"flip"`` (FedLSM's weak view: "weak augmentation refered to horizontal flip"): horizontal flip p=0.5.
- ``"weak"`` (FedMLP / FedIRM): horizontal flip p=0.5; affine p=1: rotation U(-10, 10) deg, translation
  U(-2, 2) % of the side per axis; bilinear, zero padding.
- ``"strong"`` (FedLSM): vertical and horizontal flips p=0.5 each; affine p=0.85: rotation U(-15, 15) deg,
  translation U(-10, 10) %, scale 1 + U(-0.1, 0.1) per axis; one of {3x3 median, Gaussian blur sigma U(0.1, 1)
  per axis, Gaussian noise std 0.03} with p=0.7 in all; brightness (x (1 + U(-0.2, 0.2))) then contrast (gamma
  U(0.8, 1.25) on the image's min-max range) together p=0.75; clip to [0, 1].
- ``"ssl"`` (the self-supervised warm start, :mod:`fedpartial.methods.selfsup`; two of these per image): horizontal
  flip p=0.5; affine p=1: rotation U(-15, 15) deg, translation U(-15, 15) %, scale 1 + U(-0.3, 0.3) per axis (a
  random crop and zoom); one filter as ``strong`` with p=0.5; brightness U(-0.4, 0.4) then contrast gamma
  U(0.7, 1.4) together p=0.8; clip to [0, 1]. Every step acts on all channels alike, so a gray X-ray stays gray and
  the CT windows of one slice move together; no colour jitter (a dermoscopy image keeps its hues).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AffineRanges:
    """Ranges of a random affine: rotation in degrees, translation as a fraction of the side, scale +- fraction."""

    prob: float
    rotate_deg: float
    translate: float
    scale: float = 0.0


@dataclass(frozen=True)
class ViewParams:
    """One view kind: flip probabilities, the affine (None: none), the filter and intensity steps (probability 0:
    none) with their ranges. A view with a filter or an intensity step is clipped to [0, 1] after them."""

    vflip: float = 0.0
    hflip: float = 0.0
    affine: AffineRanges | None = None
    p_filter: float = 0.0  # one of {3x3 median, Gaussian blur, Gaussian noise}, equally likely
    blur_sigma: tuple[float, float] = (0.1, 1.0)
    noise_std: float = 0.03
    p_intensity: float = 0.0  # brightness then contrast
    brightness: float = 0.2  # x (1 + U(-b, b))
    gamma: tuple[float, float] = (0.8, 1.25)

    @property
    def clipped(self) -> bool:
        return self.p_filter > 0 or self.p_intensity > 0


VIEWS: dict[str, ViewParams] = {
    "eval": ViewParams(),
    "flip": ViewParams(hflip=0.5),
    "weak": ViewParams(hflip=0.5, affine=AffineRanges(prob=1.0, rotate_deg=10.0, translate=0.02)),
    "strong": ViewParams(
        vflip=0.5,
        hflip=0.5,
        affine=AffineRanges(prob=0.85, rotate_deg=15.0, translate=0.10, scale=0.10),
        p_filter=0.7,
        p_intensity=0.75,
    ),
    "ssl": ViewParams(
        hflip=0.5,
        affine=AffineRanges(prob=1.0, rotate_deg=15.0, translate=0.15, scale=0.30),
        p_filter=0.5,
        p_intensity=0.8,
        brightness=0.4,
        gamma=(0.7, 1.4),
    ),
}
ViewKind = Literal["eval", "flip", "weak", "strong", "ssl"]
"""A view kind, as a method's options type it (checked against :data:`VIEWS` by ``tests/test_batch_views.py``)."""
KINDS = tuple(VIEWS)
"""The view kinds of both pipelines."""


def view_params(kind: str) -> ViewParams:
    """The parameters of a view kind; an unknown kind is a ``ValueError`` naming the kinds."""
    if kind not in VIEWS:
        raise ValueError(f"augmentation kind must be one of {KINDS}, got {kind!r}")
    return VIEWS[kind]
