"""Pixels that stay true: a 12-bit PNG decodes as its 8-bit rendering, an EXIF-rotated JPEG as the upright file, and
the image store never serves a row whose bytes changed on disk or whose source file was replaced (size and mtime
put back)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from PIL import Image

from fedpartial.data.store import (
    DecodedImages,
    Preprocessing,
    StoreError,
    build_store,
    decode_resized,
    ensure_store,
    open_store,
    png_significant_bits,
    sixteen_bit_scale,
)
from fedpartial.data.transforms import read_image

PREP = Preprocessing(32, 1, None, "area")


def _gradient(h: int = 48, w: int = 40) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return ((x * 5 + y * 3) % 256).astype(np.uint8)


def _sbit_png(path, arr16: np.ndarray, bits: int | None) -> None:
    """A 16-bit grayscale PNG; with ``bits``, an ``sBIT`` chunk declaring them (as a PACS export writes it)."""
    Image.fromarray(arr16.astype(np.uint16)).save(path)
    if bits is None:
        return
    data = path.read_bytes()
    chunk = b"sBIT" + bytes([bits])
    new = len(chunk[4:]).to_bytes(4, "big") + chunk + zlib.crc32(chunk).to_bytes(4, "big")
    at = data.index(b"IDAT") - 4
    path.write_bytes(data[:at] + new + data[at:])


@pytest.mark.parametrize("bits,sbit", [(12, True), (12, False), (10, False), (16, True)])
def test_a_deep_png_decodes_as_its_8_bit_rendering(tmp_path, bits, sbit):
    g8 = _gradient()
    Image.fromarray(g8).save(tmp_path / "g8.png")
    deep = np.rint(g8.astype(np.float64) * (2**bits - 1) / 255).astype(np.uint16)
    _sbit_png(tmp_path / "deep.png", deep, bits if sbit else None)
    assert png_significant_bits(str(tmp_path / "deep.png")) == (bits if sbit else None)
    assert sixteen_bit_scale(deep, str(tmp_path / "deep.png")) == 2**bits - 1
    want = decode_resized(tmp_path / "g8.png", PREP, 1).astype(int)
    got = decode_resized(tmp_path / "deep.png", PREP, 1).astype(int)
    assert np.abs(got - want).max() <= 1
    # the per-sample path (MONAI transforms) reads it the same way
    np.testing.assert_allclose(read_image(tmp_path / "deep.png", 1)[0], g8 / 255.0, atol=1.0 / 255)
    if bits < 16:  # what the old rule (/ 65,535) made of it: a handful of grey levels
        assert np.unique(np.rint(deep / 65535 * 255)).size < 20 < np.unique(got).size


def test_sbit_wins_over_the_images_own_depth(tmp_path):
    dark = np.full((20, 20), 3000, np.uint16)  # a dark 16-bit image: without sBIT read as 12-bit
    _sbit_png(tmp_path / "dark.png", dark, 16)
    assert sixteen_bit_scale(dark, str(tmp_path / "dark.png")) == 65535
    _sbit_png(tmp_path / "nosbit.png", dark, None)
    assert sixteen_bit_scale(dark, str(tmp_path / "nosbit.png")) == 4095


@pytest.mark.parametrize(
    "orientation,turn",
    [(6, Image.Transpose.ROTATE_90), (8, Image.Transpose.ROTATE_270), (3, Image.Transpose.ROTATE_180)],
)
def test_an_exif_rotated_jpeg_decodes_as_the_upright_file(tmp_path, orientation, turn):
    rng = np.random.default_rng(0)
    upright = np.kron(rng.integers(0, 255, (6, 4, 3)), np.ones((16, 16, 1))).astype(np.uint8)  # 96 x 64 blocks
    Image.fromarray(upright).save(tmp_path / "upright.jpg", quality=95)
    stored = Image.fromarray(upright).transpose(turn)  # the sensor's rows; the tag says how to turn them back
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(tmp_path / "tagged.jpg", quality=95, exif=exif)
    prep = Preprocessing(32, 3, None, "area")
    want = decode_resized(tmp_path / "upright.jpg", prep, 3).astype(int)
    got = decode_resized(tmp_path / "tagged.jpg", prep, 3).astype(int)
    assert np.abs(got - want).mean() < 2.0
    raw = np.asarray(stored.resize((32, 32))).transpose(2, 0, 1).astype(int)  # the tag ignored
    assert np.abs(raw - want).mean() > 20
    x = read_image(tmp_path / "tagged.jpg", 3)
    assert x.shape[1:] == upright.shape[:2]


def _images(folder, n: int = 10):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        Image.fromarray(np.full((16, 16), 12 * i + 5, np.uint8)).save(folder / f"{i}.png")
        paths.append(str(folder / f"{i}.png"))
    return paths


def test_a_byte_changed_in_any_chunk_is_never_served(tmp_path):
    n, per = 20, 2
    paths = _images(tmp_path / "img", n)
    build_store(paths, Preprocessing(8, 1, None, "area"), tmp_path / "store", workers=1, chunk_rows=per)
    images = tmp_path / "store" / "images.npy"
    clean = images.read_bytes()
    offset = len(clean) - n * 64  # the rows (8 x 8 x 1 bytes) follow the .npy header
    at_open = at_read = 0
    for row in range(n):
        chunk = row // per
        data = bytearray(clean)
        data[offset + row * 64 + 17] ^= 0xFF  # one byte of one row
        images.write_bytes(bytes(data))
        rows = f"rows {chunk * per}..{chunk * per + per - 1} do not match"
        try:  # opening checks 4 chunks (first, last, two between); the others when first read
            store = open_store(tmp_path / "store")
        except StoreError as e:
            assert rows in str(e)
            at_open += 1
            continue
        with pytest.raises(StoreError, match=rows):
            store.batch([row])
        with pytest.raises(StoreError, match="do not match their checksum"):
            _ = store.images  # every row, as the in-memory copy reads them
        other = (row + per) % n
        assert store.batch([other])[0, 0, 0, 0] == 12 * other + 5  # the rows of intact chunks are served
        at_read += 1
    assert at_open == 4 * per and at_read == n - 4 * per
    images.write_bytes(clean)
    assert open_store(tmp_path / "store").batch(np.arange(n))[:, 0, 0, 0].tolist() == [12 * i + 5 for i in range(n)]


def test_a_replaced_source_file_with_its_size_and_mtime_put_back_is_decoded_again(tmp_path):
    paths = _images(tmp_path / "img", 6)
    prep = Preprocessing(8, 1, None, "area")
    store = ensure_store(paths, prep, root=tmp_path / "stores", name="t")
    assert store.batch([2])[0, 0, 0, 0] == 29
    st = os.stat(paths[2])
    Image.fromarray(np.full((16, 16), 200, np.uint8)).save(paths[2])  # another image, the same size on disk
    assert os.path.getsize(paths[2]) == st.st_size
    os.utime(paths[2], ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back
    assert os.stat(paths[2]).st_mtime_ns == st.st_mtime_ns
    again = ensure_store(paths, prep, root=tmp_path / "stores", name="t")
    assert again.batch([2])[0, 0, 0, 0] == 200 == DecodedImages([paths[2]], prep)[0][0, 0, 0]
    assert again.batch([1])[0, 0, 0, 0] == 17


def test_a_class_folder_inside_another_stops_prepare_naming_it(tmp_path):
    from fedpartial.data.sources.base import SourceError
    from fedpartial.data.sources.folder_source import load_folder

    for c in ("nv", "mel", "nv/2021", "nv/mel"):
        (tmp_path / c).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / c / "a.png")
    with pytest.raises(SourceError, match="class folder 'nv/mel' lies inside class folder 'nv'"):
        load_folder(tmp_path)
    (tmp_path / "nv" / "mel" / "a.png").unlink()
    (tmp_path / "nv" / "mel").rmdir()
    table = load_folder(tmp_path)  # a plain sub-folder (nv/2021) is part of its class
    assert sorted(table.frame["image"]) == ["mel/a.png", "nv/2021/a.png", "nv/a.png"]


def test_byte_identical_files_are_found_by_size_then_content(tmp_path):
    from fedpartial.data.quality import duplicate_groups

    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    middle = bytearray(big)
    middle[150_000] ^= 1  # same size, same first and last 64 KiB: only the full hash tells them apart
    files = {
        "a.dcm": big,
        "b.dcm": big,
        "c.dcm": bytes(middle),
        "d.png": b"x" * 10,
        "e.png": b"x" * 10,
        "f.png": b"y" * 10,
    }
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    groups = duplicate_groups(paths, [p.stat().st_size for p in paths])
    assert sorted(sorted(paths[i].name for i in g) for g in groups) == [["a.dcm", "b.dcm"], ["d.png", "e.png"]]


def test_a_copy_under_another_name_and_patient_lands_in_the_split_of_its_original(tmp_path, capsys):
    """An export holding the same image twice, under two names and two patients: prepare reports the pair and
    keeps both in one split (one patient), whatever the seed."""
    from fedpartial.data import prepare as prep

    rng = np.random.default_rng(1)
    rows = ["image,patient_id,A,B"]
    for i in range(40):
        Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,P{i},{i % 2},{1 - i % 2}")
    (tmp_path / "copy.png").write_bytes((tmp_path / "7.png").read_bytes())
    rows.append("copy.png,Q7,1,0")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    for seed in range(2):
        out = prep.prepare(
            "csv",
            tmp_path / "labels.csv",
            tmp_path / f"out{seed}",
            2,
            "full",
            seed=seed,
            figure=False,
            decode_images=False,
        )
        where = {}
        for f in ("site-1.csv", "site-2.csv", "val.csv", "test.csv"):
            for line in (out / f).read_text().splitlines()[1:]:
                image, patient = line.split(",")[:2]
                where[image] = (f if f.startswith(("val", "test")) else "train", patient)
        assert where["7.png"][0] == where["copy.png"][0] and where["7.png"][1] == where["copy.png"][1] == "P7"
    printed = capsys.readouterr().out
    assert "2 image(s) are byte-identical copies in 1 group(s): 7.png (line 9) = copy.png (line 42)" in printed
