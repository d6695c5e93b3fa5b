"""Training's image decoding: one image file -> the ``(channels, S, S)`` uint8 an image store holds
(:func:`decode_resized`: decoded once, turned upright, 16-bit scaled by its significant bits, resized by Pillow),
with the DICOM display pipeline it calls (:func:`dicom_pixels`: a CT slice -> Hounsfield units -> CT windows, the
usual 3-window input of RSNA ICH classifiers: brain, subdural, bone; a radiograph (CR / DX / MG ...) -> its
Modality LUT, its VOI LUT or window, MONOCHROME1 inverted).

A standalone module: it imports the standard library, NumPy, Pillow and (when a DICOM file is read) pydicom only,
nothing of this package. ``fedpartial.data.store`` and ``fedpartial.data.dicom`` import these names from here, and
``fedpartial-export`` copies this file whole, byte for byte, as the head of an exported bundle's
``scripts/image_io.py``: the bundle decodes each image exactly as the sites' image stores did.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

FORMAT = "fedpartial-image-store"
VERSION = 3  # 2: EXIF orientation applied, 16-bit images scaled by their significant bits; 3: DICOM by the
# standard (VOI LUT, MONOCHROME1, the RSNA ICH repair only for that release), 16-bit colour PNG / TIFF at full depth
RESIZE_FILTERS = {
    "area": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
MAX_PIXELS_ENV = "FEDPARTIAL_MAX_PIXELS"
DEFAULT_MAX_PIXELS = 40_000_000  # 6,300 x 6,300; Pillow's own warning comes at 89.5 M, its error at 179 M

CT_STORAGE_UIDS = (
    "1.2.840.10008.5.1.4.1.1.2",  # CT Image Storage
    "1.2.840.10008.5.1.4.1.1.2.1",  # Enhanced CT Image Storage
    "1.2.840.10008.5.1.4.1.1.2.2",  # Legacy Converted Enhanced CT Image Storage
)
XRAY_MODALITIES = ("CR", "DX", "MG", "RG", "IO", "PX")  # projection radiography: computed, digital, mammography, ...


# ---------------------------------------------------------------------------------------------------------- DICOM


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


def apply_windows(hu: np.ndarray, windows: Sequence[tuple[float, float]]) -> np.ndarray:
    """``(H, W)`` HU -> ``(len(windows), H, W)`` float32 in [0, 1]; each window is ``(center, width)`` (the ICH
    catalog's ``CT_WINDOWS``, brain 40/80, subdural 80/200 and bone 600/2800, give the usual 3 channels:
    :func:`fedpartial.data.dicom.apply_windows` takes them by default).
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


# ------------------------------------------------------------------------------------------------ any image file


@dataclass(frozen=True)
class Preprocessing:
    """What a store is built for: images resized to ``image_size`` (``resize_mode``: area / bilinear / bicubic /
    nearest), DICOM through ``ct_windows`` (one channel each), and the job's ``channels`` (1: stored grayscale;
    more: each image's own channels, a grayscale image stays 1 channel)."""

    image_size: int
    channels: int
    ct_windows: tuple[tuple[float, float], ...] | None = None
    resize_mode: str = "area"

    @classmethod
    def of(cls, cfg: dict) -> "Preprocessing":
        """From a resolved dataset config (``image_size``, ``channels``, ``ct_windows``, ``resize_mode``)."""
        w = cfg.get("ct_windows")
        return cls(
            int(cfg["image_size"]),
            int(cfg["channels"]),
            tuple((float(a), float(b)) for a, b in w) if w else None,
            str(cfg.get("resize_mode", "area")),
        )

    def key(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "size": self.image_size,
            "gray": self.channels == 1,
            "windows": [list(w) for w in self.ct_windows] if self.ct_windows else None,
            "resize": self.resize_mode,
        }


def is_dicom(path: str | os.PathLike) -> bool:
    """True for a ``.dcm`` file or any file with the DICOM magic ``DICM`` at byte 128 (the one test of the bundle:
    the store's decoding, the MONAI pipelines and the exported bundle's runtime)."""
    if str(path).lower().endswith(".dcm"):
        return True
    with open(path, "rb") as f:
        head = f.read(132)
    return len(head) == 132 and head[128:] == b"DICM"


def open_image(path: str):
    """``PIL.Image.open(path)`` refusing, from the header and before any pixel is decoded, an image of more than
    ``$FEDPARTIAL_MAX_PIXELS`` pixels (default 40 M: every radiograph, mammogram and dermoscopy image fits; a
    17 KB palette PNG of 12,000 x 12,000 would take 1.7 GB to decode). ``ValueError`` naming the file."""
    import warnings

    try:
        limit = int(os.environ.get(MAX_PIXELS_ENV) or DEFAULT_MAX_PIXELS)
    except ValueError:
        raise ValueError(f"{MAX_PIXELS_ENV}={os.environ[MAX_PIXELS_ENV]!r} is not a whole number") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
    except Image.DecompressionBombError:
        im = None
    if im is None or im.size[0] * im.size[1] > limit:
        size = "" if im is None else f"{im.size[0]:,} x {im.size[1]:,} = {im.size[0] * im.size[1]:,} pixels, "
        if im is not None:
            im.close()
        raise ValueError(
            f"{path}: {size or 'far '}above the limit of {limit:,} pixels per image (set {MAX_PIXELS_ENV} to raise it)"
        )
    return im


def png_significant_bits(path: str) -> int | None:
    """The significant bits a PNG's ``sBIT`` chunk declares (the largest over its channels), or None (no chunk, not
    a PNG). Reads the chunk headers before the image data only; Pillow does not read this chunk."""
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return None
        while True:
            head = f.read(8)
            if len(head) < 8:
                return None
            length, kind = int.from_bytes(head[:4], "big"), head[4:]
            if kind in (b"IDAT", b"IEND"):
                return None
            if kind == b"sBIT":
                data = f.read(length)
                return max(data) if data else None
            f.seek(length + 4, 1)  # the chunk and its CRC


def significant_bits(arr, path: str) -> tuple[int, bool]:
    """``(bits, declared)``: the significant bits of an integer image of more than 8 bits (``arr``: its pixels,
    grey or colour): those its PNG ``sBIT`` chunk declares (``declared`` True), else the image's own depth, the
    smallest of 8, 10, 12, 14 and 16 bits that holds its largest value (``declared`` False)."""
    bits = png_significant_bits(path)
    if bits and bits <= 16:
        return int(bits), True
    top = int(arr.max(initial=0))
    return next(b for b in (8, 10, 12, 14, 16) if top < 2**b), False


def sixteen_bit_scale(arr, path: str) -> float:
    """The full-scale value of an integer image of more than 8 bits (``arr``: its pixels): ``2**b - 1`` for the
    bits ``b`` its PNG ``sBIT`` chunk declares, else for the image's own depth, the smallest of 8, 10, 12, 14 and
    16 bits that holds its largest value (a PACS export writes 12-bit values into 16-bit PNGs; divided by 65,535 its
    4,096 grey levels became about 13 of 255). A dark 16-bit image without ``sBIT`` is thus stretched to its
    depth's range: export ``sBIT`` (e.g. ``pydicom``'s bits stored) to keep it (:func:`significant_bits`)."""
    return float(2 ** significant_bits(arr, path)[0] - 1)


def low_byte_tiles(im) -> list | None:
    """For an opened image of 16 bits per colour sample (a 16-bit RGB / RGBA PNG or TIFF: Pillow has no 16-bit
    colour mode and decodes each sample to its high byte, so 12-bit values 0..4,095 become 0..15), its tiles
    set to decode each sample's low byte instead (the same decoder and unfiltering, the other byte of each
    sample unpacked); None for any other image."""
    if im.mode not in ("RGB", "RGBA") or not im.tile:
        return None
    swap = {"B": "L", "L": "B", "N": "B" if sys.byteorder == "little" else "L"}
    tiles = []
    for t in im.tile:
        args = t[3]
        raw = args if isinstance(args, str) else args[0] if isinstance(args, tuple) and args else None
        if not isinstance(raw, str) or raw[-4:-1] != ";16" or raw[-1] not in swap:
            return None
        raw = raw[:-1] + swap[raw[-1]]
        args = raw if isinstance(args, str) else (raw, *args[1:])
        tiles.append(t._replace(args=args) if hasattr(t, "_replace") else (t[0], t[1], t[2], args))
    return tiles


def deep_colour(im, path: str):
    """``(H, W, 3)`` uint16 of a 16-bit-per-sample colour image (:func:`low_byte_tiles`; ``im``: the file opened,
    nothing decoded yet) turned upright (:func:`upright`): its high bytes decoded as Pillow does, its low bytes
    from the file opened again; None for any other image (``im`` untouched)."""
    tiles = low_byte_tiles(im)
    if tiles is None:
        return None
    high = np.asarray(upright(im))[..., :3].astype(np.uint16)
    with open_image(path) as again:
        again.tile = tiles
        low = np.asarray(upright(again))[..., :3]
    return (high << 8) | low


def upright(im):
    """The image as it is meant to be seen: its EXIF orientation applied (a phone's or camera's JPEG stores the
    sensor's rows and a tag that says how to turn them), else the image itself."""
    try:
        turned = im.getexif().get(0x0112, 1) not in (None, 1)
    except Exception:  # noqa: BLE001 - a damaged EXIF block: the pixels as stored
        turned = False
    return ImageOps.exif_transpose(im) if turned else im


def native_channels(path: str, prep: Preprocessing) -> int:
    """The channels an image has before any matching (1 gray, 3 colour, one per CT window for a CT slice when the
    job has them); reads the header only."""
    if is_dicom(path):
        return dicom_channels(path, prep.ct_windows)
    with open_image(path) as im:
        return 1 if im.mode in ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F") else 3


def stored_channels(native: int, prep: Preprocessing) -> int:
    """An image's stored channels: 1 for a grayscale job or a grayscale image, else the job's."""
    return 1 if prep.channels == 1 or native == 1 else prep.channels


def _resize_float(x: np.ndarray, size: int, flt) -> np.ndarray:
    """``(c, H, W)`` float in [0, 1] -> ``(c, S, S)`` uint8 (per channel through Pillow's float mode)."""
    out = [np.asarray(Image.fromarray(np.ascontiguousarray(ch, np.float32), "F").resize((size, size), flt)) for ch in x]
    return np.clip(np.rint(np.stack(out) * 255.0), 0, 255).astype(np.uint8)


def decode_resized(path: str | os.PathLike, prep: Preprocessing, channels: int) -> np.ndarray:
    """One image file -> ``(channels, S, S)`` uint8: decoded once (a JPEG at the smallest DCT scale that still
    covers ``S``, ``Image.draft``), turned upright by its EXIF orientation (:func:`upright`), resized with
    ``prep.resize_mode`` (area = box filter), 8-bit values kept, deeper integer images, grey or colour (a 16-bit
    RGB PNG at its full depth, :func:`deep_colour`), scaled by their significant bits (:func:`sixteen_bit_scale`),
    float min-max scaled, to [0, 255]; DICOM as :func:`dicom_pixels` shows it (CT through
    ``prep.ct_windows``; a radiograph through its VOI LUT, MONOCHROME1 inverted). Gray -> more channels
    repeats, colour -> 1 channel is the luma (ITU-R 601-2).

    Raises:
        OSError / ValueError: the file is missing or cannot be decoded.
    """
    path = str(path)
    size, flt = prep.image_size, RESIZE_FILTERS[prep.resize_mode]
    if is_dicom(path):
        out = _resize_float(dicom_pixels(path, prep.ct_windows), size, flt)
    else:
        with open_image(path) as im:
            deep = deep_colour(im, path)
            if deep is not None:
                x = deep.astype(np.float32) / np.float32(sixteen_bit_scale(deep, path))
                out = _resize_float(x.transpose(2, 0, 1), size, flt)
            else:
                if im.format == "JPEG":
                    im.draft("L" if channels == 1 else "RGB", (size, size))
                im = upright(im)
                mode = im.mode
                if mode in ("I", "I;16", "I;16B", "I;16L", "F"):
                    arr = np.asarray(im).astype(np.float32)
                    if mode != "F" and arr.min(initial=0) >= 0 and arr.max(initial=0) <= 65535:
                        arr = arr / sixteen_bit_scale(arr, path)
                    else:
                        lo, hi = float(arr.min()), float(arr.max())
                        arr = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
                    out = _resize_float(arr[None], size, flt)
                else:
                    if (channels == 1 and mode != "L") or mode in ("1", "LA"):
                        im = im.convert("L")
                    if im.mode not in ("L", "RGB"):
                        im = im.convert("RGB")
                    a = np.asarray(im.resize((size, size), flt))
                    out = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    c = out.shape[0]
    if c == channels:
        return np.ascontiguousarray(out)
    if c == 1:
        return np.repeat(out, channels, axis=0)
    if channels == 1:  # a colour image (or several CT windows) in a gray store: luma / mean
        return (
            np.rint(out.astype(np.float32).mean(0, keepdims=True)).astype(np.uint8)
            if c != 3
            else np.asarray(Image.fromarray(out.transpose(1, 2, 0)).convert("L"))[None]
        )
    raise ValueError(f"cannot store a {c}-channel image in a {channels}-channel store")
