"""The site-manifest contract (fedpartial.data.manifest): round trip and error messages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.manifest import ManifestError, check_coverage, read_manifest, write_manifest

CLASSES = ["epidural", "intraparenchymal", "intraventricular"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data root with three non-empty images and one empty (0-byte) one."""
    (tmp_path / "scans").mkdir()
    for i in range(3):
        (tmp_path / "scans" / f"{i}.png").write_bytes(b"not-really-a-png")
    (tmp_path / "scans" / "empty.png").write_bytes(b"")
    return tmp_path


def _write(root: Path, text: str, name: str = "site.csv") -> Path:
    f = root / name
    f.write_text(text)
    return f


def _expect(file: Path, line: int | None, *fragments: str, site: str = "site-3", **kw) -> ManifestError:
    """read_manifest fails with a message naming the site, the file, the line and the fragments."""
    with pytest.raises(ManifestError) as info:
        read_manifest(file, kw.pop("classes", CLASSES), site=site, **kw)
    msg = str(info.value)
    assert f"site '{site}'" in msg and str(file) in msg, msg
    if line is not None:
        assert f"line {line}" in msg, msg
        assert info.value.row == line
    for frag in fragments:
        assert frag in msg, msg
    assert info.value.site == site and info.value.file == str(file)
    return info.value


def test_round_trip(root):
    labels = np.array([[1, 0, 0], [0, 1, 1], [0, 0, 0]], np.float32)
    mask = np.array([[True, True, False], [True, True, True], [False, False, False]])
    f = root / "m.csv"
    write_manifest(
        f,
        [f"scans/{i}.png" for i in range(3)],
        labels,
        mask,
        CLASSES,
        patient_ids=["P1", "P1", "P2"],
        splits=["train", "val", "test"],
    )
    assert not list(root.glob("m.csv.tmp*"))
    m = read_manifest(f, CLASSES, site="site-1", require_annotated=True)
    assert len(m) == 3
    assert np.array_equal(m.mask, mask)
    assert np.array_equal(m.labels, labels * mask)
    assert m.patient_ids == ["P1", "P1", "P2"]
    assert m.splits == ["train", "val", "test"]
    assert m.lines == [2, 3, 4]
    assert m.paths == [str(root / f"scans/{i}.png") for i in range(3)]
    assert m.annotated_classes() == CLASSES
    assert m.positives().tolist() == [1, 1, 1]
    assert m.subset("train").annotated_classes() == ["epidural", "intraparenchymal"]
    assert f.read_text().splitlines()[1] == "scans/0.png,P1,train,1,0,"


def test_hand_written_manifest_with_absent_column_and_defaults(root):
    f = _write(root, "image,epidural\nscans/0.png,1\nscans/1.png,\n")
    m = read_manifest(f, CLASSES, site="s")
    assert m.annotated.tolist() == [True, False, False]
    assert m.splits == ["train", "train"] and m.patient_ids == ["", ""]
    assert m.mask[:, 0].tolist() == [True, False]


def test_missing_image(root):
    f = _write(root, "image,epidural\nscans/0.png,1\nscans/nope.png,0\n")
    _expect(f, 3, "image not found", "nope.png")


def test_empty_image_file(root):
    f = _write(root, "image,epidural\nscans/0.png,1\nscans/1.png,0\nscans/empty.png,0\n")
    _expect(f, 4, "image file is empty")


def test_unknown_class_column(root):
    f = _write(root, "image,epidural,subdurall\nscans/0.png,1,0\n")
    _expect(f, 1, "unknown class column", "subdurall")


@pytest.mark.parametrize("value", ["2", "yes", "-1", "0.5"])
def test_bad_value(root, value):
    f = _write(root, f"image,epidural,intraparenchymal\nscans/0.png,1,0\nscans/1.png,0,{value}\n")
    err = _expect(f, 3, "intraparenchymal", repr(value))
    assert "allowed values are 1, 0 or empty" in err.reason


def test_empty_manifest(root):
    f = _write(root, "image,epidural\n")
    _expect(f, None, "no rows")


def test_zero_byte_manifest(root):
    f = _write(root, "")
    _expect(f, None, "empty")


def test_missing_manifest(root):
    _expect(root / "absent.csv", None, "not found")


def test_missing_image_column(root):
    f = _write(root, "path,epidural\nscans/0.png,1\n")
    _expect(f, 1, "missing required column 'image'")


def test_multiclass_two_positives(root):
    f = _write(root, "image,epidural,intraparenchymal\nscans/0.png,1,0\nscans/1.png,1,1\n")
    read_manifest(f, CLASSES, site="s", task="multilabel")  # fine as multi-label
    _expect(f, 3, "more than one positive", task="multiclass")


def test_bad_split(root):
    f = _write(root, "image,split,epidural\nscans/0.png,train,1\nscans/1.png,training,0\n")
    _expect(f, 3, "split 'training'")


def test_empty_image_path(root):
    f = _write(root, "image,epidural\nscans/0.png,1\n ,0\n")
    _expect(f, 3, "empty image path")


def test_nothing_annotated(root):
    f = _write(root, "image,epidural\nscans/0.png,\n")
    _expect(f, None, "no class is annotated")
    assert not read_manifest(f, CLASSES, site="s", require_annotated=False).annotated.any()


def test_check_coverage_names_class_and_sites():
    check_coverage({"site-1": np.array([1, 0, 0], bool), "site-2": np.array([0, 1, 1], bool)}, CLASSES)
    with pytest.raises(ManifestError) as info:
        check_coverage({"site-1": np.array([1, 0, 0], bool), "site-2": np.array([1, 1, 0], bool)}, CLASSES)
    msg = str(info.value)
    assert "intraventricular" in msg and "site-1" in msg and "site-2" in msg
    with pytest.raises(ManifestError):
        check_coverage({}, CLASSES)


def test_write_manifest_creates_parent(tmp_path):
    f = tmp_path / "a" / "b" / "m.csv"
    write_manifest(f, ["x.png"], np.zeros((1, 3)), np.ones((1, 3), bool), CLASSES)
    assert f.read_text().splitlines() == ["image,epidural,intraparenchymal,intraventricular", "x.png,0,0,0"]


def test_line_numbers_count_blank_lines(root):
    """A hand-written CSV with a blank line: the error names the line an editor shows."""
    f = _write(root, "image,epidural\nscans/0.png,1\n\nscans/1.png,yes\n")
    _expect(f, 4, "'yes'")


def test_duplicate_column_is_named(root):
    f = _write(root, "image,epidural,epidural\nscans/0.png,1,0\n")
    _expect(f, 1, "duplicate column", "epidural")


def test_ragged_row(root):
    f = _write(root, "image,epidural\nscans/0.png,1,0\n")
    _expect(f, 2, "has 3 fields, the header has 2")
