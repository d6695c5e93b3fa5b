"""DICOM pixels by the standard: the Modality LUT, a radiograph's VOI LUT or window, MONOCHROME1 inverted, CT in
Hounsfield units, the RSNA ICH repair only for that release; the same pixels in the image store, the per-sample
decoder and an exported bundle. Tiny files written with pydicom, values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pydicom")

from pydicom.dataset import Dataset, FileDataset, FileMetaDataset  # noqa: E402
from pydicom.sequence import Sequence  # noqa: E402
from pydicom.uid import ExplicitVRLittleEndian, generate_uid  # noqa: E402

from fedpartial.data.dicom import dicom_channels, dicom_pixels, read_dicom_hu  # noqa: E402
from fedpartial.data.store import Preprocessing, decode_resized, ensure_store  # noqa: E402
from fedpartial.data.transforms import read_image  # noqa: E402

CT_STORAGE, DX_STORAGE = "1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.5.1.4.1.1.1"
STORED_12 = np.array([[0, 1, 100, 1000], [1536, 1537, 2048, 2559], [2560, 3000, 3500, 4000], [4094, 4095, 4095, 7]])


def write_dicom(path, px, modality="DX", photometric="MONOCHROME2", bits=12, signed=False, **tags):
    """A one-frame DICOM file (explicit VR little endian) of ``px`` with ``bits`` stored; ``tags``: more elements
    (``modality=None``: no Modality element)."""
    px = np.asarray(px)
    meta = FileMetaDataset()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.MediaStorageSOPClassUID = CT_STORAGE if modality == "CT" else DX_STORAGE
    meta.MediaStorageSOPInstanceUID = generate_uid()
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    if modality:
        ds.Modality = modality
    colour = px.ndim == 3
    ds.SamplesPerPixel, ds.PhotometricInterpretation = (3 if colour else 1), photometric
    if colour:
        ds.PlanarConfiguration = 0
    ds.Rows, ds.Columns = px.shape[:2]
    ds.BitsAllocated = 8 if bits <= 8 else 16
    ds.BitsStored, ds.HighBit, ds.PixelRepresentation = bits, bits - 1, int(signed)
    for key, value in tags.items():
        setattr(ds, key, value)
    dtype = {8: "u1", 16: "<i2" if signed else "<u2"}[ds.BitsAllocated]
    ds.PixelData = np.ascontiguousarray(px, dtype=dtype).tobytes()
    ds.save_as(str(path), enforce_file_format=True)
    return path


def lut_item(descriptor, data) -> Dataset:
    """A LUT item (VOI or Modality LUT Sequence) with its descriptor and data as US."""
    item = Dataset()
    item.add_new(0x00283002, "US", list(descriptor))  # LUT Descriptor: entries, first value mapped, bits
    item.add_new(0x00283006, "US", list(data))  # LUT Data
    return item


def test_a_12_bit_radiograph_without_rescale_keeps_its_brightest_values_brightest(tmp_path):
    """An unsigned DX of 12 bits stored and no Rescale tags: scaled by the 4,095 its bits allow; the RSNA ICH
    repair (+1000 modulo 4096) must not wrap its brightest quarter to black."""
    want = STORED_12 / 4095.0
    for modality in ("DX", "CR", None):  # no Modality element: not CT, read as a radiograph
        f = write_dicom(tmp_path / f"{modality}.dcm", STORED_12, modality=modality)
        np.testing.assert_allclose(dicom_pixels(f)[0], want, atol=1e-6)
        np.testing.assert_allclose(read_image(f, 1)[0], want, atol=1e-6)
        np.testing.assert_array_equal(decode_resized(f, Preprocessing(4, 1), 1)[0], np.rint(want * 255))
        np.testing.assert_array_equal(read_dicom_hu(f), STORED_12)  # the Modality LUT: identity
    assert dicom_pixels(f)[0, 3, 1] == 1.0 and dicom_pixels(f)[0, 0, 0] == 0.0
    # with a rescale (slope 2, intercept -100): the range the 12 bits allow goes through it too
    f = write_dicom(tmp_path / "rescaled.dcm", STORED_12, RescaleSlope=2, RescaleIntercept=-100)
    np.testing.assert_allclose(dicom_pixels(f)[0], ((STORED_12 * 2 - 100) + 100) / (4095 * 2), atol=1e-6)


def test_monochrome1_is_inverted(tmp_path):
    """MONOCHROME1 stores bone dark: ``max - x`` over the range the values may take (here 12 bits)."""
    f = write_dicom(tmp_path / "m1.dcm", STORED_12, photometric="MONOCHROME1")
    np.testing.assert_allclose(dicom_pixels(f)[0], (4095 - STORED_12) / 4095.0, atol=1e-6)
    # 16 bits stored, unsigned: over 0..65,535
    px16 = np.array([[0, 65535], [30000, 1]])
    f = write_dicom(tmp_path / "m1_16.dcm", px16, photometric="MONOCHROME1", bits=16)
    np.testing.assert_allclose(dicom_pixels(f)[0], (65535 - px16) / 65535.0, atol=1e-6)


def test_a_window_center_and_width_are_applied(tmp_path):
    """Window Center 2048 / Width 1024 (LINEAR, PS3.3 C.11.2.1.2): x <= c - 0.5 - (w - 1) / 2 -> 0,
    x > c - 0.5 + (w - 1) / 2 -> 1, between ((x - (c - 0.5)) / (w - 1) + 0.5); the first of several windows."""
    c, w = 2048.0, 1024.0
    x = STORED_12.astype(np.float64)
    want = np.clip((x - (c - 0.5)) / (w - 1) + 0.5, 0.0, 1.0)
    want[x <= c - 0.5 - (w - 1) / 2] = 0.0
    want[x > c - 0.5 + (w - 1) / 2] = 1.0
    assert want[1, 0] == 0.0 and 0.0 < want[1, 1] < want[1, 2] < 1.0 and want[1, 3] == 1.0  # 1536 | 1537, 2048 | 2559
    f = write_dicom(tmp_path / "win.dcm", STORED_12, WindowCenter=[c, 500], WindowWidth=[w, 100])
    np.testing.assert_allclose(dicom_pixels(f)[0], want, atol=1e-6)
    np.testing.assert_allclose(read_image(f, 1)[0], want, atol=1e-6)
    # MONOCHROME1 with the same window: the windowed values inverted
    f = write_dicom(tmp_path / "win1.dcm", STORED_12, photometric="MONOCHROME1", WindowCenter=c, WindowWidth=w)
    np.testing.assert_allclose(dicom_pixels(f)[0], 1.0 - want, atol=1e-6)


def test_a_voi_lut_sequence_is_applied(tmp_path):
    """A VOI LUT of 4 entries from stored value 100, 8 bits: below 100 the first entry, above 103 the last;
    scaled by the LUT's 8 bits (255)."""
    px = np.array([[0, 99, 100, 101], [102, 103, 104, 4095]])
    lut = [10, 50, 200, 255]
    f = write_dicom(
        tmp_path / "voi.dcm", px, VOILUTSequence=Sequence([lut_item((4, 100, 8), lut)]), WindowCenter=9, WindowWidth=2
    )
    want = np.array([[10, 10, 10, 50], [200, 255, 255, 255]]) / 255.0  # the LUT wins over the window
    np.testing.assert_allclose(dicom_pixels(f)[0], want, atol=1e-6)


def test_a_modality_lut_sequence_maps_the_stored_values(tmp_path):
    """A Modality LUT Sequence (16-bit output) instead of a rescale: the radiograph is scaled by its 65,535."""
    px = np.array([[0, 1], [2, 9]])
    f = write_dicom(tmp_path / "mlut.dcm", px, ModalityLUTSequence=Sequence([lut_item((3, 0, 16), [0, 1000, 65535])]))
    np.testing.assert_array_equal(read_dicom_hu(f), [[0, 1000], [65535, 65535]])
    np.testing.assert_allclose(dicom_pixels(f)[0], [[0, 1000 / 65535], [1, 1]], atol=1e-6)


def test_signed_ct_with_rescale_gives_hounsfield_units_and_its_windows(tmp_path):
    px = np.array([[-1000, -12, 0, 8], [20, 32, 300, 1200]])
    hu = px * 2.0 - 1024.0
    f = write_dicom(tmp_path / "ct.dcm", px, "CT", bits=16, signed=True, RescaleSlope=2, RescaleIntercept=-1024)
    np.testing.assert_array_equal(read_dicom_hu(f), hu)
    windows = [(40.0, 80.0), (600.0, 2800.0)]
    want = np.stack([np.clip((hu - (c - w / 2)) / w, 0, 1) for c, w in windows])
    assert dicom_channels(f, windows) == 2 and dicom_channels(f) == 1
    np.testing.assert_allclose(dicom_pixels(f, windows), want, atol=1e-6)
    np.testing.assert_allclose(read_image(f, 2, windows), want, atol=1e-6)
    np.testing.assert_allclose(dicom_pixels(f)[0], (hu - hu.min()) / (hu.max() - hu.min()), atol=1e-6)  # no windows
    # a MONOCHROME1 CT is not inverted: Hounsfield units are physical values, the windows show bone bright
    f = write_dicom(tmp_path / "ct1.dcm", px, "CT", "MONOCHROME1", 16, True, RescaleSlope=2, RescaleIntercept=-1024)
    np.testing.assert_allclose(dicom_pixels(f, windows), want, atol=1e-6)
    # an unsigned 12-bit CT of another source (intercept 0): its values as stored, never wrapped
    f = write_dicom(tmp_path / "ct12.dcm", STORED_12, "CT", RescaleSlope=1, RescaleIntercept=0)
    np.testing.assert_array_equal(read_dicom_hu(f), STORED_12)


@pytest.mark.filterwarnings("ignore:Invalid value for VR UI")  # the release's ID_<hex> identifiers are no UIDs
def test_the_rsna_release_layout_is_repaired_and_only_that_release(tmp_path):
    """The RSNA ICH release's faulty slices (CT, SOP Instance UID ID_<hex>, unsigned 12-bit, intercept above
    -100) are shifted by 1000 modulo 4096 with intercept -1000, as is customary for that data set; the same
    layout under a real UID, or in a radiograph, is read as stored."""
    px = np.array([[3096, 40, 0, 4095], [3000, 3095, 3097, 1024]])
    want = ((px + 1000) % 4096) - 1000.0  # 3096 -> -1000 HU (air), 40 -> 40 HU (brain), 4095 -> -1 HU
    rsna = dict(RescaleSlope=1, RescaleIntercept=0, WindowCenter=[40, 40], WindowWidth=[80, 80])
    f = write_dicom(tmp_path / "ID_0123abcde.dcm", px, "CT", **rsna)
    import pydicom

    ds = pydicom.dcmread(f)
    ds.SOPInstanceUID = "ID_0123abcde"  # the release's anonymised identifiers
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.PatientID = "ID_30ea2b02d4", "ID_0ab5820b2a", "ID_f15c0eee"
    ds.save_as(f, enforce_file_format=True)
    np.testing.assert_array_equal(read_dicom_hu(f), want)
    np.testing.assert_allclose(dicom_pixels(f, [(40, 80)])[0], np.clip((want - 0) / 80, 0, 1), atol=1e-6)
    other = write_dicom(tmp_path / "other.dcm", px, "CT", **rsna)  # a real UID: another CT
    np.testing.assert_array_equal(read_dicom_hu(other), px)
    dx = write_dicom(tmp_path / "dx.dcm", px, "DX", RescaleSlope=1, RescaleIntercept=0)
    np.testing.assert_array_equal(read_dicom_hu(dx), px)
    np.testing.assert_allclose(dicom_pixels(dx)[0], px / 4095.0, atol=1e-6)


def test_a_colour_dicom_decodes_as_colour(tmp_path):
    rgb = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [128, 64, 32]]], np.uint8)
    f = write_dicom(tmp_path / "rgb.dcm", rgb, "XC", "RGB", bits=8)
    assert dicom_channels(f) == 3
    np.testing.assert_allclose(dicom_pixels(f), rgb.transpose(2, 0, 1) / 255.0, atol=1e-6)
    np.testing.assert_allclose(read_image(f, 3), rgb.transpose(2, 0, 1) / 255.0, atol=1e-6)
    assert decode_resized(f, Preprocessing(2, 3), 3).tolist() == rgb.transpose(2, 0, 1).tolist()


def test_the_store_read_image_and_the_bundle_give_the_same_pixels_of_a_monochrome1_radiograph(tmp_path):
    import importlib.util
    import sys

    from fedpartial.data import decode

    rng = np.random.default_rng(0)
    px = rng.integers(0, 4096, (8, 8))
    px[0, :2] = 0, 4095
    f = write_dicom(tmp_path / "m1.dcm", px, photometric="MONOCHROME1")
    want = np.rint((4095 - px) / 4095.0 * 255).astype(np.uint8)[None]
    prep = Preprocessing(8, 1, None, "area")  # the file's own size: no resize
    store = ensure_store([str(f)], prep, root=tmp_path / "stores", name="m1")
    np.testing.assert_array_equal(store.batch([0])[0], want)
    np.testing.assert_array_equal(np.rint(read_image(f, 1) * 255), want)
    # the head of the bundle's scripts/image_io.py: training's decoding module, copied whole
    spec = importlib.util.spec_from_file_location("bundle_image_io", decode.__file__)
    bundle = sys.modules["bundle_image_io"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(bundle)
    finally:
        del sys.modules["bundle_image_io"]
    copied = [v for v in vars(bundle).values() if callable(v) or isinstance(v, type(sys))]
    assert not any(getattr(v, "__module__", v.__name__).startswith("fedpartial") for v in copied)
    np.testing.assert_array_equal(bundle.decode_resized(f, bundle.Preprocessing(8, 1, None, "area"), 1), want)
    assert bundle.native_channels(str(f), bundle.Preprocessing(8, 3, ((40.0, 80.0),) * 3)) == 1  # not a CT


def test_the_report_says_which_dicom_images_were_inverted_windowed_or_repaired(tmp_path):
    """prepare's data-quality report: one line per decoding step beyond the rescale, with the count and three
    names (MONOCHROME1 inverted, a window applied); a plain MONOCHROME2 radiograph is not counted."""
    import json

    from fedpartial.data import prepare as prep

    rng = np.random.default_rng(3)
    rows = ["image,patient_id,A,B"]
    for i in range(12):
        name = f"{i:02d}.dcm"
        tags = {"WindowCenter": 2048, "WindowWidth": 1024} if 5 <= i < 9 else {}
        photometric = "MONOCHROME1" if i < 5 else "MONOCHROME2"
        write_dicom(tmp_path / name, rng.integers(0, 4096, (40, 40)), photometric=photometric, **tags)
        rows.append(f"{name},P{i},{i % 2},{1 - i % 2}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    out = prep.prepare("csv", tmp_path / "labels.csv", tmp_path / "out", 2, "full", figure=False, verbose=False)
    notes = json.loads((out / "dataset.json").read_text())["notes"]
    inverted = [n for n in notes if "MONOCHROME1" in n]
    windowed = [n for n in notes if "Window Center" in n]
    assert len(inverted) == len(windowed) == 1, notes
    assert "5 DICOM image(s) (00.dcm, 01.dcm, 02.dcm, ... 2 more) stored as MONOCHROME1" in inverted[0]
    assert "4 DICOM image(s) (05.dcm, 06.dcm, 07.dcm, ... 1 more) were shown through their own Window" in windowed[0]
