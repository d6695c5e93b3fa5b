"""RSNA ICH loader, DICOM -> HU -> windows, and the synthetic ICH phantom (small sizes: the file runs in seconds)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from pydicom.multival import MultiValue

from fedpartial.data.catalog.ich import CLASSES as ICH_CLASSES
from fedpartial.data.catalog.ich.loader import apply_windows, first_value, load_rsna_ich, read_dicom_hu
from fedpartial.data.catalog.ich.phantom import (
    _dicom_template,
    _phantom_arrays,
    _sample_params,
    _write_dicom,
    generate_ich_phantom,
    load_ich_phantom,
)

N, SIZE = 60, 64  # one small phantom for the file-level tests
TARGET = {"epidural": 0.035, "intraparenchymal": 0.12, "intraventricular": 0.09, "subarachnoid": 0.12, "subdural": 0.15}


@pytest.fixture(scope="module")
def phantom(tmp_path_factory) -> Path:
    return generate_ich_phantom(tmp_path_factory.mktemp("ph") / "ich", n_images=N, size=SIZE, seed=3)


@pytest.fixture(scope="module")
def arrays():
    """In-memory phantom with masks: ``(params, raw (N, H, W) int16, masks)``."""
    return _phantom_arrays(300, size=SIZE, seed=1)


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    """``(B, H, W)`` bool, dilated by ``steps`` pixels (4-neighbourhood)."""
    m = mask.copy()
    for _ in range(steps):
        d = m.copy()
        d[:, 1:] |= m[:, :-1]
        d[:, :-1] |= m[:, 1:]
        d[:, :, 1:] |= m[:, :, :-1]
        d[:, :, :-1] |= m[:, :, 1:]
        m = d
    return m


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ phantom
def test_generation_is_deterministic(phantom, tmp_path):
    again = generate_ich_phantom(tmp_path / "again", n_images=N, size=SIZE, seed=3)
    a, b = _files(phantom), _files(again)
    assert a.keys() == b.keys() and len(a) == N + 2
    assert all(a[k] == b[k] for k in a)
    other = _files(generate_ich_phantom(tmp_path / "other", n_images=N, size=SIZE, seed=4))
    assert other["stage_2_train.csv"] != a["stage_2_train.csv"]
    px_a = read_dicom_hu(phantom / next(k for k in a if k.endswith(".dcm")))
    px_o = read_dicom_hu(tmp_path / "other" / next(k for k in other if k.endswith(".dcm")))
    assert not np.array_equal(px_a, px_o)


def test_regeneration_is_idempotent_and_safe(phantom, tmp_path):
    stamps = {p: p.stat().st_mtime_ns for p in phantom.rglob("*")}
    assert generate_ich_phantom(phantom, n_images=N, size=SIZE, seed=3) == phantom
    assert {p: p.stat().st_mtime_ns for p in phantom.rglob("*")} == stamps
    # other parameters replace the phantom (atomically: no temp folder left behind)
    root = generate_ich_phantom(tmp_path / "p", n_images=20, size=SIZE, seed=0)
    generate_ich_phantom(root, n_images=12, size=SIZE, seed=0)
    assert len(list((root / "stage_2_train").glob("*.dcm"))) == 12
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["p"]
    # a folder that is not a phantom is never overwritten
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "stage_2_train.csv").write_text("ID,Label\n")
    with pytest.raises(ValueError, match="not an ICH phantom"):
        generate_ich_phantom(tmp_path / "real", n_images=10, size=SIZE)


def test_dicom_matches_render_and_hu_ranges(phantom):
    prm, raw, masks = _phantom_arrays(N, size=SIZE, seed=3)
    for i in (0, N // 2, N - 1):
        hu = read_dicom_hu(phantom / "stage_2_train" / f"{prm['image_id'][i]}.dcm")
        assert hu.shape == (SIZE, SIZE) and hu.dtype == np.float32
        np.testing.assert_array_equal(hu, raw[i].astype(np.float32) - 1024)
    hu = raw.astype(np.float32) - 1024
    lesion = np.any([masks[c] for c in ICH_CLASSES], axis=0)
    tissue = masks["brain"] & ~_dilate(~masks["brain"] | masks["ventricles"] | lesion, 2)
    assert np.median(hu[masks["skull"]]) > 600
    assert np.median(hu[:, :3, :3]) < -900  # air in the corners
    assert 20 < np.median(hu[tissue]) < 45
    assert np.median(hu[masks["ventricles"] & ~_dilate(~masks["ventricles"], 1)]) < 20


def test_prevalence_and_cooccurrence():
    prm = _sample_params(600, seed=0, n_patients=100)
    y = prm["labels"]
    assert y.shape == (600, 5)
    for j, c in enumerate(ICH_CLASSES):
        assert abs(y[:, j].mean() - TARGET[c]) < 0.01, c
    assert 0.5 < (y.sum(1) == 0).mean() < 0.6
    assert (y.sum(1) >= 2).mean() > 0.03
    assert (y[:, 1] & y[:, 2]).sum() > 0  # IPH + IVH
    # positives cluster in patients, every patient has several slices
    pats, counts = np.unique(prm["patient"], return_counts=True)
    assert len(pats) == 100 and counts.min() >= 1 and counts.mean() == 6
    any_ = y.any(1)
    per_pat = np.array([any_[prm["patient"] == p].mean() for p in pats])
    assert np.var(per_pat) > 2 * any_.mean() * (1 - any_.mean()) / 6  # more spread than independent slices


def test_lesions_are_drawn_where_they_belong(arrays):
    prm, raw, m = arrays
    for j, c in enumerate(ICH_CLASSES):
        area = m[c].sum((1, 2))
        pos = prm["labels"][:, j] == 1
        assert (area[~pos] == 0).all(), c
        assert (area[pos] > 0).mean() > 0.95, c
        assert not (m[c] & ~m["brain"]).any(), c  # all bleeds are intracranial
    near_skull = _dilate(m["skull"], 1)
    edh = m["epidural"]
    assert not (edh & ~_dilate(m["skull"], 6)).any()  # a lens no thicker than ~5 px at 64 px
    has = edh.any((1, 2))
    assert (edh & near_skull).any((1, 2))[has].all()  # hugs the inner table
    assert not (m["subdural"] & ~_dilate(m["skull"], 4)).any()
    assert not (m["intraventricular"] & ~m["ventricles"]).any()
    assert not (m["intraparenchymal"] & m["ventricles"]).any()
    # blood is brighter than the brain (30-40 HU) around it; in the ventricles it mixes with CSF (5 HU)
    hu = raw.astype(np.float32) - 1024
    for c, floor in (("epidural", 45), ("intraparenchymal", 45), ("intraventricular", 20), ("subdural", 45)):
        core = m[c] & ~_dilate(~m[c], 1)
        if core.any():
            assert np.median(hu[core]) > floor, c


def test_load_ich_phantom(phantom, caplog):
    with caplog.at_level(logging.WARNING):
        table = load_ich_phantom(phantom, n_images=N, size=SIZE, seed=3)
    assert "SYNTHETIC" in caplog.text
    assert table.name == "ich_phantom" and table.synthetic and table.task == "multilabel"
    assert table.classes == ICH_CLASSES and len(table.frame) == N
    prm = _sample_params(N, seed=3, n_patients=N // 6)
    by_id = dict(zip(prm["image_id"], prm["patient_id"]))
    ids = table.frame["image"].str.extract(r"(ID_[0-9a-f]+)\.dcm$")[0]
    assert (table.frame["patient_id"].to_numpy() == ids.map(by_id).to_numpy()).all()
    assert table.frame["patient_id"].nunique() == N // 6
    assert all((table.root / p).is_file() for p in table.frame["image"])


# --------------------------------------------------------------------------------------------- DICOM / HU
def test_windows_shape_and_range():
    hu = np.array([[-1000, 0, 40], [80, 1200, 3000]], dtype=np.float32)
    w = apply_windows(hu)
    assert w.shape == (3, 2, 3) and w.dtype == np.float32
    assert w.min() >= 0 and w.max() <= 1
    assert w[0, 0, 2] == pytest.approx(0.5)  # 40 HU = brain window centre
    assert w[0, 0, 0] == 0 and w[0, 1, 1] == 1 and w[2, 1, 2] == 1
    assert w[1, 1, 0] == pytest.approx(0.5)  # 80 HU = subdural window centre
    assert apply_windows(hu, windows=((0, 100),)).shape == (1, 2, 3)


def test_read_dicom_hu_defaults_and_errors(tmp_path):
    ds = _dicom_template(32)
    raw = np.arange(32 * 32, dtype=np.int16).reshape(32, 32)
    _write_dicom(ds, tmp_path / "a.dcm", raw, "ID_a", "P1", 0, 1)
    np.testing.assert_array_equal(read_dicom_hu(tmp_path / "a.dcm"), raw - 1024.0)
    del ds.RescaleSlope, ds.RescaleIntercept  # missing -> 1 / 0
    _write_dicom(ds, tmp_path / "b.dcm", raw, "ID_b", "P1", 0, 2)
    np.testing.assert_array_equal(read_dicom_hu(tmp_path / "b.dcm"), raw.astype(np.float32))
    ds.RescaleSlope, ds.RescaleIntercept = 2, -1000
    _write_dicom(ds, tmp_path / "c.dcm", raw, "ID_c", "P1", 0, 3)
    np.testing.assert_array_equal(read_dicom_hu(tmp_path / "c.dcm"), raw * 2.0 - 1000)
    # the RSNA 12-bit files with a wrong intercept are repaired: stored 3096 -> -1000 HU, 40 -> 40 HU; the release
    # is recognised by its own SOP Instance UIDs (ID_<hex>), so another CT with the same bit layout is left as it is
    ds.PixelRepresentation, ds.BitsStored, ds.HighBit, ds.RescaleIntercept, ds.RescaleSlope = 0, 12, 11, 0, 1
    bad = np.where(raw % 2 == 0, 3096, 40).astype(np.int16)
    _write_dicom(ds, tmp_path / "other.dcm", bad, "ID_d", "P1", 0, 4)
    np.testing.assert_array_equal(read_dicom_hu(tmp_path / "other.dcm"), bad.astype(np.float32))
    ds.SOPInstanceUID = "ID_0123abcde"
    ds.save_as(tmp_path / "d.dcm", enforce_file_format=True)
    np.testing.assert_array_equal(read_dicom_hu(tmp_path / "d.dcm"), np.where(raw % 2 == 0, -1000.0, 40.0))
    assert first_value(MultiValue(float, [2.0, 3.0]), 1) == 2 and first_value(None, 1) == 1 and first_value("", 0) == 0
    (tmp_path / "junk.dcm").write_bytes(b"not a dicom file")
    with pytest.raises(ValueError, match="junk.dcm"):
        read_dicom_hu(tmp_path / "junk.dcm")


# --------------------------------------------------------------------------------------------- RSNA CSV
def _rsna_csv(path: Path, rows: list[tuple[str, str]]) -> None:
    path.write_text("ID,Label\n" + "".join(f"{i},{lab}\n" for i, lab in rows))


def _image_rows(img: str, labels: dict[str, int]) -> list[tuple[str, str]]:
    rows = [(f"{img}_{c}", str(labels.get(c, 0))) for c in ICH_CLASSES]
    return rows + [(f"{img}_any", str(int(any(labels.values()))))]


def test_rsna_csv_pivot_and_duplicates(tmp_path):
    rows = _image_rows("ID_00a1", {"subdural": 1}) + _image_rows("ID_00b2", {})
    rows.insert(3, ("ID_00a1_epidural", "0"))  # the real CSV repeats some rows
    rows += _image_rows("ID_00c3", {"intraparenchymal": 1, "intraventricular": 1})
    _rsna_csv(tmp_path / "stage_2_train.csv", rows)
    (tmp_path / "pids.csv").write_text("image_id,patient_id\nID_00a1,PAT1\nID_00b2,PAT1\n")
    t = load_rsna_ich(tmp_path, patient_ids="pids.csv")
    assert t.name == "rsna_ich" and t.task == "multilabel" and t.classes == ICH_CLASSES and not t.synthetic
    f = t.frame
    assert list(f.columns) == ["image", "patient_id", *ICH_CLASSES] and "any" not in f.columns
    assert f["image"].tolist() == [f"stage_2_train/ID_00{x}.dcm" for x in ("a1", "b2", "c3")]
    assert f["patient_id"].tolist() == ["PAT1", "PAT1", "ID_00c3"]  # no CSV entry, no DICOM -> image id
    assert f[ICH_CLASSES].to_numpy().tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    assert len(load_rsna_ich(tmp_path, limit=2, read_patient_ids_from_dicom=False).frame) == 2


@pytest.mark.parametrize(
    "bad_row, match",
    [
        (("ID_00b2_subdural", "2"), "label '2'"),
        (("ID_00b2_subdurall", "0"), "malformed ID"),
        (("00b2_subdural", "0"), "malformed ID"),
    ],
)
def test_rsna_csv_errors_name_file_and_line(tmp_path, bad_row, match):
    rows = _image_rows("ID_00a1", {}) + _image_rows("ID_00b2", {})
    rows[10] = bad_row  # data row 11 = CSV line 12
    _rsna_csv(tmp_path / "labels.csv", rows)
    with pytest.raises(ValueError, match=rf"labels\.csv.*line 12.*{match}"):
        load_rsna_ich(tmp_path, csv_name="labels.csv")


def test_rsna_csv_missing_subtype(tmp_path):
    rows = _image_rows("ID_00a1", {})
    del rows[2]
    _rsna_csv(tmp_path / "stage_2_train.csv", rows)
    with pytest.raises(ValueError, match="intraventricular"):
        load_rsna_ich(tmp_path)
