"""Image loading, augmentation pipelines and cached datasets (fedpartial.data.transforms / .dataset)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fedpartial.data import transforms as tf
from fedpartial.data.dataset import make_dataset, make_loader
from fedpartial.data.manifest import Manifest

BRAIN = (40.0, 80.0)


# ------------------------------------------------------------------------------------------------------ fixtures


def write_dicom(path, stored: np.ndarray, slope: float = 1.0, intercept: float = -1024.0, preamble: bool = True):
    """A minimal CT slice: int16 pixels with RescaleSlope / RescaleIntercept."""
    pydicom = pytest.importorskip("pydicom")
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128 if preamble else None)
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = CTImageStorage, meta.MediaStorageSOPInstanceUID, "CT"
    ds.Rows, ds.Columns = stored.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    ds.PixelData = stored.astype(np.int16).tobytes()
    pydicom.dcmwrite(str(path), ds, enforce_file_format=True)
    return path


@pytest.fixture
def images(tmp_path):
    """Tiny files of every supported kind; returns name -> path."""
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    gray[0, 0], gray[0, 1] = 0, 255
    rgb = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    p = {
        "gray": tmp_path / "gray.png",
        "rgb": tmp_path / "rgb.png",
        "jpg": tmp_path / "img.jpg",
        "dcm": tmp_path / "ct.dcm",
        "dcm_noext": tmp_path / "ct_slice",
    }
    Image.fromarray(gray, "L").save(p["gray"])
    Image.fromarray(rgb, "RGB").save(p["rgb"])
    yy, xx = np.mgrid[0:20, 0:30]
    smooth = np.stack([xx * 8, yy * 12, 255 - xx * 8], -1).astype(np.uint8)  # JPEG-friendly
    Image.fromarray(smooth, "RGB").save(p["jpg"], quality=95)
    stored = np.full((16, 16), 1064, np.int16)  # 1064 - 1024 = 40 HU
    stored[0, 0], stored[0, 1] = 0, 2000  # -1024 HU, 976 HU
    write_dicom(p["dcm"], stored)
    write_dicom(p["dcm_noext"], stored)
    return {k: str(v) for k, v in p.items()}, gray, rgb, smooth


def make_manifest(paths, n_classes=3, seed=0) -> Manifest:
    rng = np.random.default_rng(seed)
    n = len(paths)
    labels = rng.integers(0, 2, (n, n_classes)).astype(np.float32)
    mask = rng.random((n, n_classes)) < 0.6
    mask[:, 0] = True
    return Manifest(
        paths=list(paths),
        labels=labels * mask,
        mask=mask,
        classes=[f"c{i}" for i in range(n_classes)],
        patient_ids=[""] * n,
        splits=["train"] * n,
        lines=list(range(2, n + 2)),
    )


@pytest.fixture
def count_decodes(monkeypatch):
    """Counts calls to the decoder (transforms.read_image) per path."""
    calls: dict[str, int] = {}
    real = tf.read_image

    def counting(path, *a, **k):
        calls[str(path)] = calls.get(str(path), 0) + 1
        return real(path, *a, **k)

    monkeypatch.setattr(tf, "read_image", counting)
    return calls


# -------------------------------------------------------------------------------------------------------- loading


def load(path, channels, ct_windows=None):
    return tf.LoadImageAnyd("image", channels, ct_windows)({"image": path})["image"]


def test_png_gray_and_rgb_conversion(images):
    p, gray, rgb, _ = images
    g1 = load(p["gray"], 1)
    assert g1.shape == (1, 20, 30) and g1.dtype == torch.float32
    assert float(g1.min()) == 0.0 and float(g1.max()) == 1.0
    torch.testing.assert_close(g1[0], torch.from_numpy(gray / 255.0).float())
    g3 = load(p["gray"], 3)  # gray -> RGB repeats
    assert g3.shape == (3, 20, 30) and torch.equal(g3[0], g3[1]) and torch.equal(g3[1], g3[2])
    c3 = load(p["rgb"], 3)
    torch.testing.assert_close(c3, torch.from_numpy(rgb.transpose(2, 0, 1) / 255.0).float())
    c1 = load(p["rgb"], 1)  # RGB -> gray averages
    torch.testing.assert_close(c1[0], c3.mean(0))


def test_jpg(images):
    p, _, _, smooth = images
    x = load(p["jpg"], 3)
    assert x.shape == (3, 20, 30) and x.dtype == torch.float32
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert float((x - torch.from_numpy(smooth.transpose(2, 0, 1) / 255.0)).abs().max()) < 0.05  # lossy


@pytest.mark.parametrize("name", ["dcm", "dcm_noext"])
def test_dicom_hu_and_windows(images, name):
    p = images[0]
    assert tf.is_dicom(p[name]) and not tf.is_dicom(p["gray"])
    hu = tf.read_dicom_hu(p[name])
    assert hu.dtype == np.float32 and hu.shape == (16, 16)
    assert hu[0, 0] == -1024 and hu[0, 1] == 2000 - 1024 and hu[5, 5] == 40  # stored - 1024
    x = load(p[name], 1, [BRAIN])
    assert x.shape == (1, 16, 16)
    assert float(x[0, 5, 5]) == pytest.approx(0.5) and x[0, 0, 0] == 0 and x[0, 0, 1] == 1
    x3 = load(p[name], 3, [BRAIN, (80, 200), (600, 2800)])  # one channel per window
    assert x3.shape == (3, 16, 16)
    assert float(x3[1, 5, 5]) == pytest.approx((40 - (80 - 100)) / 200)
    assert float(x3[2, 5, 5]) == pytest.approx((40 - (600 - 1400)) / 2800)
    mm = load(p[name], 3)  # no windows: min-max, repeated to 3 channels
    assert mm.shape == (3, 16, 16) and float(mm.min()) == 0 and float(mm.max()) == 1


def test_missing_or_unreadable_file_names_it(tmp_path, images):
    missing = str(tmp_path / "nope.png")
    with pytest.raises(tf.ImageLoadError, match="nope.png"):
        load(missing, 3)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(tf.ImageLoadError, match="broken.jpg"):
        load(str(bad), 3)
    for cache in ("memory", "none"):  # also through MONAI's wrapped exceptions
        with pytest.raises(tf.ImageLoadError, match="nope.png"):
            ds = make_dataset(make_manifest([images[0]["gray"], missing]), 8, 3, monai_cache=cache)
            ds[1]


# -------------------------------------------------------------------------------------------------------- pipelines


def test_resize_and_eval_is_deterministic(images):
    p = images[0]
    t = tf.build_transforms("eval", 12, 3, None, None)
    a, b = t({"image": p["rgb"]})["image"], t({"image": p["rgb"]})["image"]
    assert a.shape == (3, 12, 12) and a.dtype == torch.float32 and type(a) is torch.Tensor
    assert torch.equal(a, b)
    pre = tf.build_transforms("weak", 12, 3, None, None, cached_only=True)
    assert torch.equal(pre({"image": p["rgb"]})["image"], a)
    ct = tf.build_transforms("eval", 8, 3, None, None, ct_windows=[BRAIN] * 3)({"image": p["dcm"]})["image"]
    assert ct.shape == (3, 8, 8)


@pytest.mark.parametrize("kind", ["weak", "strong"])
def test_random_kinds_keep_shape_and_dtype(kind):
    x = torch.rand(3, 32, 32)
    t = tf.augment_transforms(kind, 32)
    t.set_random_state(0)
    outs = [t({"image": x.clone()})["image"] for _ in range(4)]
    for o in outs:
        assert o.shape == (3, 32, 32) and o.dtype == torch.float32 and type(o) is torch.Tensor
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    t.set_random_state(0)
    assert torch.equal(t({"image": x.clone()})["image"], outs[0])  # reproducible from a seed


def test_normalisation_uses_mean_std():
    x = torch.rand(3, 8, 8)
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.25, 2.0]
    y = tf.augment_transforms("eval", 8, mean, std)({"image": x.clone()})["image"]
    torch.testing.assert_close(y, (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None])
    with pytest.raises(ValueError):
        tf.augment_transforms("eval", 8, [0.5, 0.5], [1.0, 1.0], channels=3)
    with pytest.raises(ValueError):
        tf.augment_transforms("fancy", 8)


def test_two_views_differ():
    x = torch.rand(3, 32, 32)
    t = tf.view_transforms({"image": "weak", "image_2": "weak", "image_strong": "strong"}, 32)
    t.set_random_state(1)
    out = t({"image": x.clone()})
    assert set(out) == {"image", "image_2", "image_strong"}
    assert not torch.equal(out["image"], out["image_2"])
    assert all(v.shape == (3, 32, 32) for v in out.values())
    only = tf.view_transforms({"image_strong": "strong"}, 32)({"image": x.clone()})
    assert set(only) == {"image_strong"}


def test_plain_tensors_same_draws_and_restores_flag():
    """Augmenting without MetaTensor bookkeeping gives the same numbers from the same seed, and MONAI's global
    flag is back to what it was afterwards (also after an exception)."""
    from monai.data import get_track_meta, set_track_meta

    x = torch.rand(3, 24, 24)
    views = {"weak": "weak", "strong": "strong"}
    t = tf.view_transforms(views, 24, [0.5] * 3, [0.25] * 3)
    t.set_random_state(7)
    tracked = [t({"image": x.clone()}) for _ in range(6)]
    t.set_random_state(7)
    assert get_track_meta() is True
    with tf.plain_tensors():
        assert get_track_meta() is False
        plain = [t({"image": x.clone()}) for _ in range(6)]
    assert get_track_meta() is True
    for a, b in zip(tracked, plain):
        for k in views:
            assert type(b[k]) is torch.Tensor
            torch.testing.assert_close(b[k], torch.as_tensor(a[k]), rtol=0, atol=0)
    set_track_meta(False)
    try:
        with pytest.raises(RuntimeError), tf.plain_tensors():
            raise RuntimeError("boom")
        assert get_track_meta() is False  # a caller's own setting survives
    finally:
        set_track_meta(True)


# ---------------------------------------------------------------------------------------------------------- datasets


def test_dataset_items(images):
    p = images[0]
    m = make_manifest([p["gray"], p["rgb"], p["jpg"]])
    ds = make_dataset(m, 16, 3, [0.5] * 3, [0.5] * 3, views={"image": "weak", "image_2": "weak"})
    assert len(ds) == 3
    it = ds[1]
    assert set(it) == {"image", "image_2", "label", "mask", "index"}
    for k in ("image", "image_2"):
        assert it[k].shape == (3, 16, 16) and it[k].dtype == torch.float32
    assert it["label"].dtype == torch.float32 and it["label"].shape == (3,)
    assert it["mask"].dtype == torch.bool and torch.equal(it["mask"], torch.from_numpy(m.mask[1]))
    assert torch.equal(it["label"], torch.from_numpy(m.labels[1]))
    assert it["index"].dtype == torch.int64 and int(it["index"]) == 1
    batch = next(iter(make_loader(ds, 3, shuffle=False, seed=0)))
    assert batch["image"].shape == (3, 3, 16, 16) and batch["mask"].dtype == torch.bool
    assert batch["index"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        ds.with_views({"label": "eval"})


def test_memory_cache_decodes_once(images, count_decodes):
    p = images[0]
    paths = [p["gray"], p["rgb"], p["jpg"], p["dcm"]]
    ds = make_dataset(make_manifest(paths), 16, 3, views={"image": "weak", "image_2": "weak"}, num_workers=2)
    ev = ds.with_views({"image": "eval"})
    loader = make_loader(ds, 2, shuffle=True, seed=0)
    epochs = [torch.cat([b["image"] for b in loader]) for _ in range(2)]
    assert not torch.equal(epochs[0], epochs[1])  # augmentations not cached
    e1, e2 = ev[0]["image"], ev[0]["image"]
    assert torch.equal(e1, e2)
    ev[0]["image"].add_(1)  # mutating an item must not touch the cache
    assert torch.equal(ev[0]["image"], e1)
    assert count_decodes == {q: 1 for q in paths}


def test_disk_cache_is_reused(images, tmp_path, count_decodes):
    p = images[0]
    m = make_manifest([p["gray"], p["rgb"], p["dcm"]])
    kw = dict(image_size=16, channels=3, ct_windows=[BRAIN] * 3, monai_cache="disk", cache_dir=tmp_path / "cache")
    a = make_dataset(m, views={"image": "eval"}, **kw)
    first = [a[i]["image"] for i in range(len(a))]
    assert sum(count_decodes.values()) == 3
    b = make_dataset(m, views={"image": "weak"}, **kw).with_views({"image": "eval"})  # a "new process"
    for i in range(len(b)):
        assert torch.equal(b[i]["image"], first[i])
    assert sum(count_decodes.values()) == 3
    make_dataset(m, views={"image": "eval"}, **{**kw, "image_size": 8})[0]  # other settings: other cache
    assert sum(count_decodes.values()) == 4
    with pytest.raises(ValueError, match="cache_dir"):
        make_dataset(m, 16, 3, monai_cache="disk")


def test_loader_order_is_seeded(images):
    p = images[0]
    ds = make_dataset(make_manifest([p["gray"], p["rgb"], p["jpg"], p["dcm"]] * 3), 8, 3, views={"image": "weak"})

    def run(seed):
        batches = list(make_loader(ds, 4, shuffle=True, seed=seed))
        return torch.cat([b["index"] for b in batches]), torch.cat([b["image"] for b in batches])

    (i1, x1), (i2, x2), (i3, _) = run(5), run(5), run(6)
    assert torch.equal(i1, i2) and torch.equal(x1, x2)
    assert not torch.equal(i1, i3)
    assert sorted(i1.tolist()) == list(range(12))
