"""The image decoder an exported bundle runs: training's own decoding functions (the image store's
:func:`~fedpartial.data.store.decode_resized` and the helpers it calls, :mod:`fedpartial.data.dicom`) copied as
source text into the bundle's ``scripts/image_io.py`` (:func:`fedpartial.tools.export.runtime_source`). A module of
its own, light to import (no torch, no MONAI), so the copy can be checked against the functions it copies."""

from __future__ import annotations

import inspect
import re

from ..data import dicom, store

DECODER_FUNCTIONS = (  # copied into the bundle's scripts/image_io.py, in this order
    dicom.first_value,
    dicom.pydicom_luts,
    dicom.read_dicom,
    dicom.dicom_kind,
    dicom.is_rsna_ich_wrapped,
    dicom.modality_values,
    dicom.read_dicom_hu,
    dicom.dicom_channels,
    dicom.dicom_pixels,
    dicom.apply_windows,
    store.Preprocessing,
    store.is_dicom,
    store.open_image,
    store.png_significant_bits,
    store.significant_bits,
    store.sixteen_bit_scale,
    store.low_byte_tiles,
    store.deep_colour,
    store.upright,
    store.native_channels,
    store.stored_channels,
    store._resize_float,
    store.decode_resized,
)

DICOM_IMPORT = re.compile(r"^ *from \.dicom import [^\n]*\n", re.M)  # in the store's functions: same module in the copy


def decoder_source() -> str:
    """Training's image decoding as standalone source: the image store's :func:`~fedpartial.data.store.
    decode_resized` (decode once, resize, uint8: what every site's store holds) with the helpers it calls and
    ``fedpartial.data.dicom`` (the DICOM display pipeline, HU, CT windows), copied verbatim (their relative imports
    of ``.dicom`` dropped: the copy holds those functions in the same module). Imports NumPy, Pillow and (when a
    DICOM file is read) pydicom only."""
    parts = [
        "import os",
        "import sys",
        "from collections.abc import Sequence",
        "from dataclasses import dataclass",
        "",
        "import numpy as np",
        "from PIL import Image, ImageOps",
        "",
        f"FORMAT = {store.FORMAT!r}",
        f"VERSION = {store.VERSION!r}",
        f"MAX_PIXELS_ENV = {store.MAX_PIXELS_ENV!r}",
        f"DEFAULT_MAX_PIXELS = {store.DEFAULT_MAX_PIXELS!r}",
        f"DEFAULT_WINDOWS = {dicom.DEFAULT_WINDOWS!r}",
        f"CT_STORAGE_UIDS = {dicom.CT_STORAGE_UIDS!r}",
        f"XRAY_MODALITIES = {dicom.XRAY_MODALITIES!r}",
        "RESIZE_FILTERS = {"
        + ", ".join(f"{k!r}: Image.Resampling.{v.name}" for k, v in store.RESIZE_FILTERS.items())
        + "}",
        "",
        "",
    ]
    for obj in DECODER_FUNCTIONS:
        src = inspect.getsource(obj).rstrip() + "\n"
        if obj in (store.decode_resized, store.native_channels) and not DICOM_IMPORT.search(src):
            raise RuntimeError(f"{obj.__name__} no longer imports the DICOM helpers as the export expects")
        parts += [DICOM_IMPORT.sub("", src).rstrip(), "", ""]
    return "\n".join(parts).rstrip() + "\n"
