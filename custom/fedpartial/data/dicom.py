"""DICOM pixels as the standard says to show them, in [0, 1]: a CT slice -> Hounsfield units -> CT windows (the
usual 3-window input of RSNA ICH classifiers: brain, subdural, bone); a radiograph (CR / DX / MG ...) -> its
Modality LUT, its VOI LUT or window, MONOCHROME1 inverted. Plain NumPy (pydicom imported when a file is read).

The functions live in :mod:`fedpartial.data.decode` (training's image decoding, the file ``fedpartial-export``
copies whole into an exported bundle's ``scripts/image_io.py``); this module names them for their callers, and
gives :func:`apply_windows` the ICH catalog's CT windows as its default (the standalone module imports no
catalog).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import decode
from .catalog.ich import CT_WINDOWS as DEFAULT_WINDOWS  # brain, subdural, bone
from .decode import (  # noqa: F401 - the DICOM part of training's decoding, imported from here by its callers
    CT_STORAGE_UIDS,
    XRAY_MODALITIES,
    dicom_channels,
    dicom_kind,
    dicom_pixels,
    first_value,
    is_rsna_ich_wrapped,
    modality_values,
    pydicom_luts,
    read_dicom,
    read_dicom_hu,
)


def apply_windows(hu: np.ndarray, windows: Sequence[tuple[float, float]] = DEFAULT_WINDOWS) -> np.ndarray:
    """:func:`fedpartial.data.decode.apply_windows` with the ICH catalog's windows by default: ``(H, W)`` HU ->
    ``(3, H, W)`` float32 in [0, 1], brain (40/80), subdural (80/200) and bone (600/2800)."""
    return decode.apply_windows(hu, windows)
