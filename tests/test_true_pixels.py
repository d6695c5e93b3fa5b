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


def _chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def _rgb16_png(path, rgb16: np.ndarray, sbit: int | None) -> None:
    """A 16-bit RGB PNG written by hand (Pillow writes none), row r filtered with PNG filter r % 5 (None, Sub, Up,
    Average, Paeth: the unfiltering runs over 6-byte pixels); with ``sbit`` an sBIT chunk for each channel."""
    h, w, _ = rgb16.shape
    raw = np.frombuffer(rgb16.astype(">u2").tobytes(), np.uint8).reshape(h, w * 6).astype(np.int64)
    rows, prior = [], np.zeros(w * 6, np.int64)
    for r in range(h):
        x = raw[r]
        left = np.concatenate([np.zeros(6, np.int64), x[:-6]])
        upleft = np.concatenate([np.zeros(6, np.int64), prior[:-6]])
        p = left + prior - upleft
        pa, pb, pc = np.abs(p - left), np.abs(p - prior), np.abs(p - upleft)
        paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prior, upleft))
        pred = [0, left, prior, (left + prior) // 2, paeth][r % 5]
        rows.append(bytes([r % 5]) + ((x - pred) % 256).astype(np.uint8).tobytes())
        prior = x
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([16, 2, 0, 0, 0])  # 16 bits, colour type 2 (RGB)
    sbit_chunk = _chunk(b"sBIT", bytes([sbit] * 3)) if sbit else b""
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + sbit_chunk
        + _chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + _chunk(b"IEND", b"")
    )


def _rgb16_tiff(path, rgb16: np.ndarray, deflate: bool) -> None:
    """A 16-bit RGB TIFF (little endian, one strip, uncompressed or deflate) written by hand."""
    import struct

    h, w, _ = rgb16.shape
    data = rgb16.astype("<u2").tobytes()
    data = zlib.compress(data) if deflate else data
    tags = [(256, 3, 1, w), (257, 3, 1, h), (258, 3, 3, 0), (259, 3, 1, 8 if deflate else 1), (262, 3, 1, 2)]
    tags += [(273, 4, 1, 0), (277, 3, 1, 3), (278, 3, 1, h), (279, 4, 1, len(data)), (284, 3, 1, 1)]
    bps_at = 8 + 2 + 12 * len(tags) + 4
    out = b"II*\x00" + struct.pack("<IH", 8, len(tags))
    for tag, kind, count, value in tags:
        value = {258: bps_at, 273: bps_at + 6}.get(tag, value)
        out += struct.pack("<HHI", tag, kind, count) + struct.pack(
            "<HH" if kind == 3 else "<I", *((value, 0) if kind == 3 else (value,))
        )
    path.write_bytes(out + struct.pack("<I", 0) + struct.pack("<3H", 16, 16, 16) + data)


def _colour_gradient() -> np.ndarray:
    g = _gradient()
    return np.stack([g, 255 - g, np.roll(g, 7, axis=1)], axis=-1)


@pytest.mark.parametrize("sbit", [12, None])
def test_a_16_bit_rgb_png_of_12_bit_values_decodes_as_its_8_bit_rendering(tmp_path, sbit):
    """Pillow opens a 16-bit RGB PNG as 8-bit RGB of each sample's high byte: 12-bit values 0..4,095 became
    0..15. Read at full depth and scaled by its sBIT (or, without one, by the 12 bits its largest value needs)."""
    rgb8 = _colour_gradient()
    Image.fromarray(rgb8).save(tmp_path / "rgb8.png")
    deep = np.rint(rgb8.astype(np.float64) * 4095 / 255).astype(np.uint16)
    _rgb16_png(tmp_path / "rgb16.png", deep, sbit)
    assert (
        Image.open(tmp_path / "rgb16.png").mode == "RGB" and png_significant_bits(str(tmp_path / "rgb16.png")) == sbit
    )
    for channels in (3, 1):
        prep = Preprocessing(32, channels, None, "area")
        want = decode_resized(tmp_path / "rgb8.png", prep, channels).astype(int)
        got = decode_resized(tmp_path / "rgb16.png", prep, channels).astype(int)
        assert got.shape == want.shape and np.abs(got - want).max() <= 1
    np.testing.assert_allclose(read_image(tmp_path / "rgb16.png", 3), rgb8.transpose(2, 0, 1) / 255.0, atol=1.0 / 255)
    info: dict = {}
    read_image(tmp_path / "rgb16.png", 1, info=info)
    assert info == {"bits": 12, "declared": sbit is not None}


@pytest.mark.parametrize("deflate", [False, True])
def test_a_16_bit_rgb_tiff_decodes_at_its_full_depth(tmp_path, deflate):
    rgb8 = _colour_gradient()
    Image.fromarray(rgb8).save(tmp_path / "rgb8.png")
    _rgb16_tiff(tmp_path / "rgb16.tif", np.rint(rgb8.astype(np.float64) * 4095 / 255).astype(np.uint16), deflate)
    prep = Preprocessing(32, 3, None, "area")
    want = decode_resized(tmp_path / "rgb8.png", prep, 3).astype(int)
    assert np.abs(decode_resized(tmp_path / "rgb16.tif", prep, 3).astype(int) - want).max() <= 1
    np.testing.assert_allclose(read_image(tmp_path / "rgb16.tif", 3), rgb8.transpose(2, 0, 1) / 255.0, atol=1.0 / 255)


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


def test_16_bit_images_of_12_bit_values_without_sbit_are_one_warning_in_the_report(tmp_path, capsys):
    """A PACS export of 16-bit PNGs holding 12-bit values, no sBIT: each is read as 12-bit, and prepare's report
    says so in one WARNING line (count, three names), the images with an sBIT chunk or 8 bits not counted."""
    import json

    from fedpartial.data import prepare as prep

    rng = np.random.default_rng(2)
    rows = ["image,patient_id,A,B"]
    for i in range(30):
        name = f"{i:02d}.png"
        if i < 20:  # 12-bit values in 16-bit files without sBIT
            _sbit_png(tmp_path / name, rng.integers(0, 4096, (40, 40)), None)
        elif i < 25:  # declared by sBIT
            _sbit_png(tmp_path / name, rng.integers(0, 4096, (40, 40)), 12)
        else:
            Image.fromarray(rng.integers(0, 256, (40, 40), dtype=np.uint8)).save(tmp_path / name)
        rows.append(f"{name},P{i},{i % 2},{1 - i % 2}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    out = prep.prepare("csv", tmp_path / "labels.csv", tmp_path / "out", 2, "full", figure=False)
    warned = [n for n in json.loads((out / "dataset.json").read_text())["notes"] if n.startswith("WARNING")]
    assert len(warned) == 1, warned
    assert "20 image(s) of 16 bits per sample hold values of only 12 bits and no sBIT chunk" in warned[0]
    assert "(00.png, 01.png, 02.png, ... 17 more): each is read as 12-bit (its values / 4,095" in warned[0]
    assert capsys.readouterr().out.count("WARNING") == 1
