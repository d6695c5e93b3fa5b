"""Where the benchmark scripts import the CT reading of the RSNA ICH slices from; it lives in
:mod:`fedpartial.data.dicom` (the RSNA loader is :mod:`fedpartial.data.catalog.ich.loader`)."""

from __future__ import annotations

from ..dicom import apply_windows, read_dicom_hu

__all__ = ["apply_windows", "read_dicom_hu"]
