"""CT slices: a DICOM file -> Hounsfield units -> CT windows in [0, 1] (the usual 3-window input of RSNA ICH
classifiers: brain, subdural, bone). Plain NumPy (pydicom imported when a file is read)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .catalog.ich import CT_WINDOWS as DEFAULT_WINDOWS  # brain, subdural, bone


def first_value(value, default: float) -> float:
    """A DICOM numeric value that may be absent, empty or a MultiValue -> its first element as float."""
    if value is None or value == "":
        return float(default)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # list, tuple, pydicom MultiValue
        return float(value[0]) if len(value) else float(default)
    return float(value)


def read_dicom_hu(path: str | os.PathLike) -> np.ndarray:
    """One CT slice in Hounsfield units: ``(H, W)`` float32 = pixel * RescaleSlope + RescaleIntercept.

    Missing slope / intercept count as 1 / 0; MultiValue tags use their first value. The ~1% of RSNA slices
    stored as unsigned 12-bit with a wrong intercept (PixelRepresentation 0, intercept > -100) are repaired
    as is customary for this data set (values shifted by 1000 modulo 4096, intercept -1000).
    """
    import pydicom

    try:
        ds = pydicom.dcmread(str(path))
        px = ds.pixel_array
    except Exception as e:  # pydicom raises many types (InvalidDicomError, AttributeError, decoder errors)
        raise ValueError(f"cannot read DICOM pixels from '{path}': {e}") from e
    if px.ndim != 2:
        raise ValueError(f"DICOM '{path}': expected a single 2-D slice, got pixel array of shape {px.shape}")
    slope = first_value(ds.get("RescaleSlope"), 1.0)
    intercept = first_value(ds.get("RescaleIntercept"), 0.0)
    px = px.astype(np.int32)
    if int(ds.get("PixelRepresentation", 1)) == 0 and int(ds.get("BitsStored", 16)) == 12 and intercept > -100:
        px = px + 1000
        px[px >= 4096] -= 4096
        intercept = -1000.0
    return (px.astype(np.float32) * np.float32(slope) + np.float32(intercept)).astype(np.float32)


def apply_windows(hu: np.ndarray, windows: Sequence[tuple[float, float]] = DEFAULT_WINDOWS) -> np.ndarray:
    """``(H, W)`` HU -> ``(len(windows), H, W)`` float32 in [0, 1]; each window is ``(center, width)``.

    The default gives the 3 channels brain (40/80), subdural (80/200) and bone (600/2800).
    """
    hu = np.asarray(hu, dtype=np.float32)
    if hu.ndim != 2:
        raise ValueError(f"apply_windows: expected an (H, W) array, got shape {hu.shape}")
    out = np.empty((len(windows), *hu.shape), dtype=np.float32)
    for k, (center, width) in enumerate(windows):
        if width <= 0:
            raise ValueError(f"apply_windows: window {k} has non-positive width {width}")
        lo = center - width / 2.0
        out[k] = np.clip((hu - np.float32(lo)) / np.float32(width), 0.0, 1.0)
    return out
