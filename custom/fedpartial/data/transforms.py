"""Image loading and augmentation pipelines (MONAI dictionary transforms).

Every pipeline works on a dict whose ``"image"`` entry is first a file path, then a channel-first float32 tensor
``(channels, H, W)``. Pipelines are split in two so that decoding is done once and cached:

- :func:`preprocess_transforms` (deterministic, cacheable): path -> decode (PNG/JPG/DICOM) -> ``(channels, H, W)``
  in [0, 1] -> resize -> ``(channels, S, S)`` float32 ``torch.Tensor`` (S = ``image_size``).
- :func:`augment_transforms` (random, never cached): ``(channels, S, S)`` -> augmented + normalised, same shape.

:func:`view_transforms` turns one cached image into several independently augmented views
(``{"image": "weak", "image_2": "weak"}``, ``{"image": "weak", "image_strong": "strong"}``, ...).
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .dicom import dicom_pixels, read_dicom_hu  # noqa: F401 - read_dicom_hu: HU, read from here too
from .store import deep_colour, is_dicom, open_image, significant_bits, upright  # the store's decoding of a file
from .views import KINDS, view_params  # noqa: F401 - KINDS: the view kinds, also read from here

if TYPE_CHECKING:  # annotations only: MONAI is imported where a pipeline is built (below)
    from monai.transforms import Compose

# MONAI is imported where a pipeline is built, not with this module: importing MONAI imports all of it (and the
# optional packages it finds: scikit-learn, matplotlib, tensorboard, mlflow), which a site process that only
# reads its manifests or the server does not need (benchmarks/import_cost.py)

Window = tuple[float, float]  # (center, width) in HU


class ImageLoadError(OSError):
    """An image that is missing or cannot be decoded; the message names the file."""


# ----------------------------------------------------------------------------------------------------------- decoding


def check_image_header(path: str | os.PathLike) -> None:
    """Cheap decodability check used by the data check (no pixel decoding): PIL ``verify()`` (reads the chunks and
    checks a PNG's CRCs, so a truncated PNG fails) or the DICOM header read by pydicom plus the length of an
    uncompressed pixel-data element against Rows x Columns x SamplesPerPixel x BitsAllocated.

    Raises:
        ImageLoadError: why the file is not a readable image (the message names the path as given).
    """
    try:
        if is_dicom(path):
            import pydicom

            ds = pydicom.dcmread(str(path), force=True)
            for tag in ("Rows", "Columns", "PixelData"):
                if tag not in ds:
                    raise ValueError(f"DICOM without {tag}")
            ts = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
            if ts is None or not ts.is_compressed:
                need = (
                    int(ds.Rows)
                    * int(ds.Columns)
                    * int(ds.get("SamplesPerPixel", 1))
                    * int(ds.get("NumberOfFrames", 1) or 1)
                    * int(ds.get("BitsAllocated", 16))
                    // 8
                )
                if len(ds.PixelData) < need:
                    raise ValueError(f"pixel data has {len(ds.PixelData)} bytes, the header needs {need} (truncated)")
        else:
            with open_image(path) as im:  # the pixel limit from the header, then the file's checksums
                im.verify()
    except ImageLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL / pydicom raise many types
        raise ImageLoadError(f"not a readable image: {path} ({type(e).__name__}: {e})") from None


def _minmax(x: np.ndarray) -> np.ndarray:
    lo, hi = float(x.min()), float(x.max())
    return ((x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)).astype(np.float32)


def _read_pil(path: str, info: dict | None = None) -> np.ndarray:
    """PNG/JPG/... -> ``(1 or 3, H, W)`` float32 in [0, 1]: 8-bit / 255, deeper integer images (grey, or a 16-bit
    colour PNG / TIFF at its full depth: :func:`~fedpartial.data.store.deep_colour`) by their significant bits
    (:func:`~fedpartial.data.store.significant_bits`, recorded in ``info`` as ``bits`` / ``declared``), other:
    min-max."""
    with open_image(path) as im:
        arr = deep_colour(im, path)
        if arr is None:
            im = upright(im)
            if im.mode in ("1", "LA"):
                im = im.convert("L")
            elif im.mode not in ("L", "RGB") and not im.mode.startswith("I") and im.mode != "F":
                im = im.convert("RGB")  # P, PA, RGBA, CMYK, YCbCr, ... (alpha dropped)
            arr = np.asarray(im)
    if arr.dtype == np.uint8:
        x = arr.astype(np.float32) / 255.0
    elif arr.dtype == np.uint16 or (arr.dtype.kind in "iu" and arr.max(initial=0) <= 65535 and arr.min(initial=0) >= 0):
        bits, declared = significant_bits(arr, path)
        if info is not None:
            info.update(bits=bits, declared=declared)
        x = arr.astype(np.float32) / np.float32(2**bits - 1)
    else:
        x = _minmax(arr.astype(np.float32))
    return x[None] if x.ndim == 2 else np.ascontiguousarray(x.transpose(2, 0, 1))


def _match_channels(x: np.ndarray, channels: int, path: str) -> np.ndarray:
    """``(c, H, W)`` -> ``(channels, H, W)``: 1 -> n repeats, n -> 1 averages."""
    c = x.shape[0]
    if c == channels:
        return x
    if c == 1:
        return np.repeat(x, channels, axis=0)
    if channels == 1:
        return x.mean(axis=0, keepdims=True)
    raise ImageLoadError(f"{path}: cannot turn a {c}-channel image into {channels} channels")


def read_image(
    path: str | os.PathLike, channels: int, ct_windows: Sequence[Window] | None = None, info: dict | None = None
) -> np.ndarray:
    """Decode one image file to ``(channels, H, W)`` float32 in [0, 1], the pixels the image store holds before
    its resize.

    DICOM (``.dcm`` or DICM magic): :func:`~fedpartial.data.dicom.dicom_pixels` (CT: HU, then the CT windows
    stacked as channels when ``ct_windows`` is given, else min-max scaled; a radiograph through its VOI LUT,
    MONOCHROME1 inverted). PNG/JPG/other PIL formats: gray or RGB scaled to [0, 1] (deeper than 8 bits: by their
    significant bits, which ``info``, when given, receives as ``bits`` and ``declared`` (by an ``sBIT`` chunk);
    a DICOM's decoding steps it receives as ``steps``).
    Gray -> ``channels`` repeats the channel; RGB -> 1 channel averages.

    Raises:
        ImageLoadError: the file is missing or cannot be decoded (the message names the file).
    """
    path = str(path)
    if not Path(path).is_file():
        raise ImageLoadError(f"image not found: {path}")
    try:
        x = dicom_pixels(path, ct_windows, info) if is_dicom(path) else _read_pil(path, info)
    except ImageLoadError:
        raise
    except Exception as e:  # PIL / pydicom raise many types
        raise ImageLoadError(f"cannot read image {path}: {type(e).__name__}: {e}") from e
    return _match_channels(x, channels, path)


_LOADER_CLASS = None


def _load_image_anyd_class():
    """The MONAI ``MapTransform`` of :func:`LoadImageAnyd`, defined on first use (MONAI imported then)."""
    global _LOADER_CLASS
    if _LOADER_CLASS is not None:
        return _LOADER_CLASS
    from monai.transforms import MapTransform

    class LoadImageAnydTransform(MapTransform):
        """Path -> ``(channels, H, W)`` float32 tensor in [0, 1] (PNG/JPG gray or RGB, DICOM with optional CT windows).

        Args:
            keys: keys whose values are file paths.
            channels: output channels (1 = gray, 3 = RGB; CT: usually ``len(ct_windows)``).
            ct_windows: DICOM only: ``[(center, width), ...]`` in HU, one output channel each (then matched to
                ``channels`` like a gray/RGB image); None = min-max scaled HU.
        """

        def __init__(
            self, keys, channels: int, ct_windows: Sequence[Window] | None = None, allow_missing_keys: bool = False
        ) -> None:
            super().__init__(keys, allow_missing_keys)
            self.channels = int(channels)
            self.ct_windows = [tuple(map(float, w)) for w in ct_windows] if ct_windows else None

        def __call__(self, data: Mapping[Hashable, object]) -> dict:
            d = dict(data)
            for key in self.key_iterator(d):
                d[key] = torch.from_numpy(read_image(d[key], self.channels, self.ct_windows))
            return d

    LoadImageAnydTransform.__qualname__ = "LoadImageAnydTransform"  # picklable (DataLoader worker processes):
    _LOADER_CLASS = LoadImageAnydTransform  # found again through the module __getattr__
    return _LOADER_CLASS


def __getattr__(name: str):
    if name == "LoadImageAnydTransform":
        return _load_image_anyd_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def LoadImageAnyd(keys, channels: int, ct_windows: Sequence[Window] | None = None, allow_missing_keys: bool = False):
    """Path -> ``(channels, H, W)`` float32 tensor in [0, 1] (a MONAI dictionary transform; see
    :func:`read_image`)."""
    return _load_image_anyd_class()(keys, channels, ct_windows, allow_missing_keys)


# --------------------------------------------------------------------------------------------------------- pipelines


@contextmanager
def plain_tensors() -> Iterator[None]:
    """Run MONAI transforms without ``MetaTensor`` bookkeeping (the views need no affine history or inverse).

    Same outputs, same random draws, less time per view (``benchmarks/local_round_speed.py --views
    per_sample``). MONAI's flag is process-global: restored on exit.
    """
    from monai.data import get_track_meta, set_track_meta

    previous = get_track_meta()
    set_track_meta(False)
    try:
        yield
    finally:
        set_track_meta(previous)


def _clip01(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(0.0, 1.0)


def _normalise(keys, channels: int | None, mean: Sequence[float] | None, std: Sequence[float] | None) -> list:
    """NormalizeIntensityd with per-channel ``(x - mean[c]) / std[c]``; ``[]`` when both are None."""
    if mean is None and std is None:
        return []
    from monai.transforms import NormalizeIntensityd

    n = len(mean if mean is not None else std)
    mean = [0.0] * n if mean is None else [float(m) for m in mean]
    std = [1.0] * n if std is None else [float(s) for s in std]
    if len(mean) != len(std) or (channels is not None and len(mean) != channels):
        raise ValueError(f"mean {mean} / std {std} must have one value per channel ({channels})")
    return [NormalizeIntensityd(keys, subtrahend=mean, divisor=std, channel_wise=True)]


def preprocess_transforms(
    image_size: int,
    channels: int,
    ct_windows: Sequence[Window] | None = None,
    keys: Sequence[str] = ("image",),
    resize_mode: str = "area",
) -> Compose:
    """Deterministic, cacheable part: path -> ``(channels, image_size, image_size)`` float32 tensor in [0, 1]."""
    from monai.transforms import Compose, EnsureTyped, Resized

    return Compose(
        [
            LoadImageAnyd(keys, channels, ct_windows),
            Resized(keys, spatial_size=(image_size, image_size), mode=resize_mode),
            EnsureTyped(keys, data_type="tensor", dtype=torch.float32, track_meta=False),
        ]
    )


def augment_transforms(
    kind: str,
    image_size: int,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    keys: Sequence[str] = ("image",),
    channels: int | None = None,
) -> Compose:
    """Random part, on ``(C, S, S)`` tensors in [0, 1]; output same shape, float32, normalised: the view ``kind``
    of :data:`fedpartial.data.views.VIEWS` (the table the batched views read too) as MONAI transforms."""
    p = view_params(kind)
    from monai.transforms import (
        Compose,
        EnsureTyped,
        Identityd,
        Lambdad,
        MedianSmoothd,
        OneOf,
        RandAdjustContrastd,
        RandAffined,
        RandFlipd,
        RandGaussianNoised,
        RandGaussianSmoothd,
        RandScaleIntensityd,
    )

    keys = list(keys)
    norm = [
        *_normalise(keys, channels, mean, std),
        EnsureTyped(keys, data_type="tensor", dtype=torch.float32, track_meta=False),
    ]  # plain tensors out
    steps = []
    if p.vflip:
        steps.append(RandFlipd(keys, prob=p.vflip, spatial_axis=0))
    if p.hflip:
        steps.append(RandFlipd(keys, prob=p.hflip, spatial_axis=1))
    if p.affine is not None:
        t = p.affine.translate * image_size
        scale = {"scale_range": (p.affine.scale, p.affine.scale)} if p.affine.scale else {}
        steps.append(
            RandAffined(
                keys,
                prob=p.affine.prob,
                rotate_range=(math.radians(p.affine.rotate_deg),),
                translate_range=(t, t),
                mode="bilinear",
                padding_mode="zeros",
                **scale,
            )
        )
    if p.p_filter:
        sigma = p.blur_sigma
        steps.append(
            OneOf(
                [
                    MedianSmoothd(keys, radius=1),
                    RandGaussianSmoothd(keys, sigma_x=sigma, sigma_y=sigma, prob=1.0),
                    RandGaussianNoised(keys, prob=1.0, mean=0.0, std=p.noise_std),
                    Identityd(keys),
                ],
                weights=[p.p_filter / 3] * 3 + [1 - p.p_filter],
            )
        )
    if p.p_intensity:
        steps.append(
            OneOf(
                [
                    Compose(
                        [
                            RandScaleIntensityd(keys, factors=p.brightness, prob=1.0),
                            RandAdjustContrastd(keys, gamma=p.gamma, prob=1.0),
                        ]
                    ),
                    Identityd(keys),
                ],
                weights=[p.p_intensity, 1 - p.p_intensity],
            )
        )
    if p.clipped:
        steps.append(Lambdad(keys, _clip01))
    return Compose([*steps, *norm])


def build_transforms(
    kind: str,
    image_size: int,
    channels: int,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    ct_windows: Sequence[Window] | None = None,
    cached_only: bool = False,
    keys: Sequence[str] = ("image",),
) -> Compose:
    """Full pipeline path -> ``(channels, image_size, image_size)`` float32: preprocess + augment(kind).

    ``cached_only=True`` returns only the deterministic (cacheable) preprocessing part.
    """
    from monai.transforms import Compose

    pre = preprocess_transforms(image_size, channels, ct_windows, keys)
    if cached_only:
        return pre
    return Compose([*pre.transforms, *augment_transforms(kind, image_size, mean, std, keys, channels).transforms])


def view_transforms(
    views: Mapping[str, str],
    image_size: int,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    source_key: str = "image",
    channels: int | None = None,
) -> Compose:
    """One cached image -> several independently augmented views.

    ``views`` maps output key -> kind, e.g. ``{"image": "weak", "image_2": "weak"}``: the source
    ``(C, S, S)`` tensor under ``source_key`` is copied to each key (CopyItemsd), then every key gets its own
    pipeline instance (independent random draws). The source key is dropped unless it is itself a view.
    """
    if not views:
        raise ValueError("views must name at least one output key")
    from monai.transforms import Compose, CopyItemsd, DeleteItemsd

    extra = [k for k in views if k != source_key]
    steps: list = [CopyItemsd(source_key, times=len(extra), names=extra)] if extra else []
    if source_key not in views:
        steps.append(DeleteItemsd(source_key))
    for key, kind in views.items():
        steps.extend(augment_transforms(kind, image_size, mean, std, (key,), channels).transforms)
    return Compose(steps)
