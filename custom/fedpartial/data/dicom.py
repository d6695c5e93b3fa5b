"""DICOM pixels as the standard says to show them, in [0, 1]: a CT slice -> Hounsfield units -> CT windows (the
usual 3-window input of RSNA ICH classifiers: brain, subdural, bone); a radiograph (CR / DX / MG ...) -> its
Modality LUT, its VOI LUT or window, MONOCHROME1 inverted. Plain NumPy (pydicom imported when a file is read).

``fedpartial-export`` copies these functions (with the image store's decoder) into an exported bundle's
``scripts/image_io.py``: they use NumPy, pydicom and this module's constants only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .catalog.ich import CT_WINDOWS as DEFAULT_WINDOWS  # brain, subdural, bone

CT_STORAGE_UIDS = (
    "1.2.840.10008.5.1.4.1.1.2",  # CT Image Storage
    "1.2.840.10008.5.1.4.1.1.2.1",  # Enhanced CT Image Storage
    "1.2.840.10008.5.1.4.1.1.2.2",  # Legacy Converted Enhanced CT Image Storage
)
XRAY_MODALITIES = ("CR", "DX", "MG", "RG", "IO", "PX")  # projection radiography: computed, digital, mammography, ...


def first_value(value, default: float) -> float:
    """A DICOM numeric value that may be absent, empty or a MultiValue -> its first element as float."""
    if value is None or value == "":
        return float(default)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):  # list, tuple, pydicom MultiValue
        return float(value[0]) if len(value) else float(default)
    return float(value)


def pydicom_luts():
    """pydicom's own ``(apply_modality_lut, apply_voi_lut)``: ``pydicom.pixels`` (pydicom 3), else
    ``pydicom.pixel_data_handlers.util`` (pydicom 2)."""
    try:
        from pydicom.pixels import apply_modality_lut, apply_voi_lut
    except ImportError:  # pydicom < 3
        from pydicom.pixel_data_handlers.util import apply_modality_lut, apply_voi_lut
    return apply_modality_lut, apply_voi_lut


def read_dicom(path: str | os.PathLike, header_only: bool = False):
    """``(dataset, stored pixel array)`` of one DICOM file (``header_only``: ``(dataset, None)``, no pixel read).

    Raises:
        ValueError: not a readable DICOM file or pixel data (the message names the file).
    """
    import pydicom

    try:
        ds = pydicom.dcmread(str(path), stop_before_pixels=header_only)
        return ds, None if header_only else ds.pixel_array
    except Exception as e:  # pydicom raises many types (InvalidDicomError, AttributeError, decoder errors)
        raise ValueError(f"cannot read DICOM pixels from '{path}': {e}") from e


def dicom_kind(ds) -> str:
    """``"CT"`` (Modality CT, or no Modality and a CT SOP class), ``"XR"`` (a projection radiograph:
    :data:`XRAY_MODALITIES`, or no Modality at all and not CT) or ``"other"`` (MR, US, OT, ...)."""
    modality = str(ds.get("Modality", "") or "").strip().upper()
    if modality == "CT" or (not modality and str(ds.get("SOPClassUID", "")) in CT_STORAGE_UIDS):
        return "CT"
    return "XR" if modality in XRAY_MODALITIES or not modality else "other"


def is_rsna_ich_wrapped(ds) -> bool:
    """True for a slice of the RSNA Intracranial Hemorrhage release (Kaggle 2019) stored with its known fault:
    unsigned 12-bit values with a wrong intercept (about 1% of the slices; the values are shifted by 1000 modulo
    4096 and the intercept is -1000). Recognised from the release's own tags, never from the bit depth alone:
    Modality CT, the release's anonymised SOP Instance UID ``ID_<hex>`` (a DICOM UID holds only digits and
    dots, so no other file has it), Pixel Representation 0, Bits Stored 12 and a Rescale Intercept not below
    -100 (the community's test for the faulty slices)."""
    return (
        str(ds.get("Modality", "") or "").strip().upper() == "CT"
        and str(ds.get("SOPInstanceUID", "") or "").startswith("ID_")
        and int(ds.get("PixelRepresentation", 0) or 0) == 0
        and int(ds.get("BitsStored", 0) or 0) == 12
        and first_value(ds.get("RescaleIntercept"), 0.0) > -100
    )


def modality_values(ds, px: np.ndarray, steps: list | None = None) -> tuple[np.ndarray, float, float]:
    """Stored values -> the Modality LUT's output (HU for CT) as float64, with the range ``(lo, hi)`` those
    values may take: the Bits Stored / Pixel Representation range through Rescale Slope / Intercept, or
    ``[0, 2**bits - 1]`` for a Modality LUT Sequence (pydicom's convention, the one its windowing uses).

    pydicom's ``apply_modality_lut`` does the work; a MultiValue or a lone slope / intercept is first made the
    single value the standard means (missing: slope 1, intercept 0), and the RSNA ICH release's faulty slices
    (:func:`is_rsna_ich_wrapped`) are repaired first (``steps``, when given, receives ``"rsna repair"``). ``ds``
    is changed in memory accordingly."""
    apply_modality_lut, _ = pydicom_luts()
    bits = int(ds.get("BitsStored") or ds.get("BitsAllocated") or 16)
    signed = int(ds.get("PixelRepresentation", 0) or 0) == 1
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    px = np.asarray(px)
    if ds.get("ModalityLUTSequence"):
        item = ds.ModalityLUTSequence[0]
        descriptor = [int(v) for v in item.LUTDescriptor]
        if descriptor[2] not in (8, 16):  # pydicom reads only 8 / 16 bits; 9..15-bit entries fit in 16
            item.LUTDescriptor = [descriptor[0], descriptor[1], 16]
        x = np.asarray(apply_modality_lut(px, ds), dtype=np.float64)
        item.LUTDescriptor = descriptor
        return x, 0.0, float(2 ** descriptor[2] - 1)
    if is_rsna_ich_wrapped(ds):
        if steps is not None:
            steps.append("rsna repair")
        px = px.astype(np.int32) + 1000
        px[px >= 4096] -= 4096
        ds.RescaleIntercept = -1000.0
    if "RescaleSlope" in ds or "RescaleIntercept" in ds:
        ds.RescaleSlope = first_value(ds.get("RescaleSlope"), 1.0)
        ds.RescaleIntercept = first_value(ds.get("RescaleIntercept"), 0.0)
        slope, intercept = float(ds.RescaleSlope), float(ds.RescaleIntercept)
        lo, hi = sorted((lo * slope + intercept, hi * slope + intercept))
    return np.asarray(apply_modality_lut(px, ds), dtype=np.float64), float(lo), float(hi)


def read_dicom_hu(path: str | os.PathLike) -> np.ndarray:
    """One CT slice in Hounsfield units: ``(H, W)`` float32, the stored values through the Modality LUT
    (:func:`modality_values`: Rescale Slope / Intercept, missing = 1 / 0, MultiValue tags by their first value,
    or a Modality LUT Sequence). The RSNA ICH release's faulty slices are repaired as is customary for that data
    set (values shifted by 1000 modulo 4096, intercept -1000), and only they (:func:`is_rsna_ich_wrapped`)."""
    ds, px = read_dicom(path)
    if px.ndim != 2:
        raise ValueError(f"DICOM '{path}': expected a single 2-D slice, got pixel array of shape {px.shape}")
    return modality_values(ds, px)[0].astype(np.float32)


def dicom_channels(path: str | os.PathLike, ct_windows: Sequence[tuple[float, float]] | None = None) -> int:
    """The channels :func:`dicom_pixels` gives for this file, from its header only: one per CT window for a CT
    slice when windows are given, 3 for a colour image (RGB, YBR, palette), else 1."""
    ds, _ = read_dicom(path, header_only=True)
    if ct_windows and dicom_kind(ds) == "CT":
        return len(ct_windows)
    pi = str(ds.get("PhotometricInterpretation", "") or "").strip().upper()
    return 3 if int(ds.get("SamplesPerPixel", 1) or 1) == 3 or pi == "PALETTE COLOR" else 1


def dicom_pixels(
    path: str | os.PathLike, ct_windows: Sequence[tuple[float, float]] | None = None, info: dict | None = None
) -> np.ndarray:
    """One DICOM image -> ``(c, H, W)`` float32 in [0, 1], as the standard's display pipeline shows it.

    - Grey: the stored values through the Modality LUT (:func:`modality_values`; HU for CT), then
      - CT (:func:`dicom_kind`): the CT windows (:func:`apply_windows`, one channel each) when ``ct_windows``
        is given, else min-max scaled HU. Photometric Interpretation is not applied: HU are physical values
        and the windows show bone bright;
      - a radiograph (CR / DX / MG / RG / IO / PX, or no Modality and not CT): its VOI LUT Sequence or Window
        Center / Width (the first) through pydicom's ``apply_voi_lut``, where present; MONOCHROME1 inverted
        (``lo + hi - x``: a MONOCHROME1 file stores bone dark); scaled to [0, 1] by the range the values may
        take after the LUTs: a VOI LUT Sequence's output bits, a window's output range (pydicom's: the stored
        range through the rescale), and without either the range Bits Stored allows through the rescale
        (a 12-bit radiograph is scaled by 4,095, its brightest values stay brightest). The range, not the
        image's own min-max: images of one device keep one scale, and a file's few extreme pixels (a burned-in
        marker) do not set its contrast. A file that uses far fewer bits than it declares looks dark;
      - any other modality (MR, US, ...): MONOCHROME1 inverted, min-max scaled (no common scale).
    - Colour (RGB, YBR as pydicom converts it to RGB, a palette through its colour LUT): 3 channels scaled by
      the range of their bits.

    ``info``, when given, receives under ``steps`` what was done beyond the rescale: ``"rsna repair"``,
    ``"voi lut"``, ``"window"``, ``"monochrome1 inverted"`` (the data-quality report counts them).

    Raises:
        ValueError: unreadable, or not one 2-D image (a multi-frame file).
    """
    steps: list = [] if info is None else info.setdefault("steps", [])
    ds, px = read_dicom(path)
    pi = str(ds.get("PhotometricInterpretation", "MONOCHROME2") or "MONOCHROME2").strip().upper()
    bits = int(ds.get("BitsStored") or ds.get("BitsAllocated") or 8)
    if pi == "PALETTE COLOR" and px.ndim == 2:
        try:
            from pydicom.pixels import apply_color_lut
        except ImportError:  # pydicom < 3
            from pydicom.pixel_data_handlers.util import apply_color_lut
        px = apply_color_lut(px, ds)
        bits = int(ds.RedPaletteColorLookupTableDescriptor[2])
    elif px.ndim == 3 and px.shape[-1] == 3 and pi.startswith("YBR"):
        import pydicom

        if int(pydicom.__version__.split(".")[0]) < 3:  # pydicom 3 gives RGB already
            try:
                from pydicom.pixel_data_handlers.util import convert_color_space
            except ImportError:
                from pydicom.pixels import convert_color_space
            px = convert_color_space(px, pi, "RGB")
    if px.ndim == 3 and px.shape[-1] == 3:
        x = px.astype(np.float32) / np.float32(2**bits - 1)
        return np.ascontiguousarray(np.clip(x, 0.0, 1.0).transpose(2, 0, 1))
    if px.ndim != 2:
        raise ValueError(f"DICOM '{path}': expected a single 2-D image, got pixel array of shape {px.shape}")
    kind = dicom_kind(ds)
    x, lo, hi = modality_values(ds, px, steps)
    if kind == "CT":
        x = x.astype(np.float32)
        if ct_windows:
            return apply_windows(x, ct_windows)
        a, b = float(x.min()), float(x.max())
        return ((x - a) / (b - a) if b > a else np.zeros_like(x)).astype(np.float32)[None]
    if kind == "XR":
        _, apply_voi_lut = pydicom_luts()
        voi = ds.get("VOILUTSequence")
        if voi and voi[0].get("LUTDescriptor") is not None and voi[0].get("LUTData") is not None:
            x = np.asarray(apply_voi_lut(np.rint(x).astype(np.int64), ds), dtype=np.float64)
            lo, hi = 0.0, float(2 ** int(voi[0].LUTDescriptor[2]) - 1)
            steps.append("voi lut")
        elif ds.get("WindowCenter") is not None and ds.get("WindowWidth") is not None:
            x = np.asarray(apply_voi_lut(x, ds), dtype=np.float64)  # output range: the modality range
            steps.append("window")
    if pi == "MONOCHROME1":
        x = lo + hi - x
        steps.append("monochrome1 inverted")
    if kind != "XR":
        lo, hi = float(x.min()), float(x.max())
    if hi <= lo:
        return np.zeros((1, *x.shape), np.float32)
    return np.clip((x - lo) / (hi - lo), 0.0, 1.0).astype(np.float32)[None]


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
