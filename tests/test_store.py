"""The prepared image store (fedpartial.data.store): decoded once, uint8, resumable, refused when damaged."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from fedpartial.data import store as st
from fedpartial.data.store import DecodeFailure, Preprocessing, StoreError, build_store, ensure_store, open_store


def _images(folder, n=10, size=40, mode="L", fmt="png", seed=0):
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        shape = (size, size) if mode == "L" else (size, size, 3)
        p = folder / f"img{i}.{fmt}"
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(p)
        paths.append(str(p))
    return paths


def test_gray_image_stays_one_channel_and_matches_a_plain_box_resize(tmp_path):
    """A grayscale PNG in a 3-channel job is stored with 1 channel, equal to Pillow's box (area) resize; an RGB
    image in a 1-channel job is stored as its luma; a 16-bit PNG is scaled to [0, 255]."""
    paths = _images(tmp_path, 3, 40)
    prep = Preprocessing(16, 3)
    s = ensure_store(paths, prep, tmp_path / "stores", "t")
    assert s.images.shape == (3, 1, 16, 16) and s.images.dtype == np.uint8
    want = np.asarray(Image.open(paths[1]).resize((16, 16), Image.Resampling.BOX))
    assert np.array_equal(s.batch([1])[0, 0], want)
    (tmp_path / "c").mkdir()
    rgb = _images(tmp_path / "c", 2, 40, "RGB")
    g = ensure_store(rgb, Preprocessing(16, 1), tmp_path / "stores", "g")
    assert g.channels == 1
    assert np.array_equal(
        g.batch([0])[0, 0], np.asarray(Image.open(rgb[0]).convert("L").resize((16, 16), Image.Resampling.BOX))
    )
    c = ensure_store(rgb, Preprocessing(16, 3), tmp_path / "stores", "c")
    assert c.channels == 3
    deep = tmp_path / "deep.png"
    Image.fromarray(np.full((20, 20), 65535, np.uint16)).save(deep)
    d = ensure_store([str(deep)], Preprocessing(8, 1), tmp_path / "stores", "d")
    assert d.batch([0]).min() == 255


def test_batch_returns_rows_in_the_asked_order(tmp_path):
    paths = _images(tmp_path, 7, 20)
    s = ensure_store(paths, Preprocessing(8, 1), tmp_path / "s")
    rows = [5, 0, 5, 3]
    assert np.array_equal(s.batch(rows), np.stack([s.images[r] for r in rows]))


def test_second_open_decodes_nothing_and_a_changed_file_is_named_and_redone(tmp_path, monkeypatch):
    paths = _images(tmp_path, 5, 20)
    calls = []
    real = st.decode_resized
    monkeypatch.setattr(st, "decode_resized", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    ensure_store(paths, Preprocessing(8, 1), tmp_path / "s", workers=1)
    assert len(calls) == 5
    calls.clear()
    ensure_store(paths, Preprocessing(8, 1), tmp_path / "s", workers=1)
    assert calls == []
    Image.fromarray(np.zeros((20, 20), np.uint8)).save(paths[2])
    os.utime(paths[2], ns=(1, 1))
    said = []
    s = ensure_store(paths, Preprocessing(8, 1), tmp_path / "s", workers=1, log_fn=said.append)
    assert any("img2.png" in m and "changed" in m for m in said)
    assert len(calls) == 5  # the chunk holding the changed row (all 5 rows here)
    assert s.batch([2]).max() == 0


def test_interrupted_build_resumes_where_it_stopped(tmp_path, monkeypatch):
    """A build stopped (Ctrl-C) in its third of 5 chunks keeps the first 2; the restart decodes only the other 3
    chunks' rows."""
    paths = _images(tmp_path, 10, 20)
    prep = Preprocessing(8, 1)
    folder = st.store_folder(paths, prep, tmp_path / "s")
    chunks = []
    real_chunk = st._decode_chunk

    def interrupted(*a):
        chunks.append(a[1])
        if len(chunks) == 3:
            raise KeyboardInterrupt
        return real_chunk(*a)

    monkeypatch.setattr(st, "_decode_chunk", interrupted)
    said = []
    with pytest.raises(KeyboardInterrupt):
        build_store(paths, prep, folder, chunk_rows=2, workers=1, log_fn=said.append)
    assert any("stopped; 2 of 5 chunks are kept" in m for m in said), said
    monkeypatch.setattr(st, "_decode_chunk", real_chunk)
    with pytest.raises(StoreError, match="incomplete"):
        open_store(folder)
    calls = []
    real = st.decode_resized
    monkeypatch.setattr(st, "decode_resized", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    s = ensure_store(paths, prep, tmp_path / "s", workers=1)
    assert sorted(calls) == sorted(paths[4:])
    fresh = np.stack([real(p, prep, 1) for p in paths])
    assert np.array_equal(np.asarray(s.images), fresh)


def test_process_pool_build_equals_a_single_process_build(tmp_path):
    paths = _images(tmp_path, 9, 30)
    prep = Preprocessing(12, 1)
    a = build_store(paths, prep, tmp_path / "a", chunk_rows=2, workers=2)
    b = build_store(paths, prep, tmp_path / "b", chunk_rows=2, workers=1)
    assert a["decoded"] == b["decoded"] == 9 and a["workers"] == 2
    assert np.array_equal(np.asarray(open_store(tmp_path / "a").images), np.asarray(open_store(tmp_path / "b").images))


def test_truncated_corrupt_and_foreign_stores_are_refused(tmp_path):
    paths = _images(tmp_path, 6, 20)
    prep = Preprocessing(8, 1)
    folder = st.store_folder(paths, prep, tmp_path / "s")
    ensure_store(paths, prep, tmp_path / "s")
    key = st.store_key(paths, prep)
    with pytest.raises(StoreError, match="foreign"):
        open_store(folder, st.store_key(paths, Preprocessing(16, 1)))
    data = (folder / "images.npy").read_bytes()
    (folder / "images.npy").write_bytes(data[:-10])
    with pytest.raises(StoreError, match="truncated") as e:
        ensure_store(paths, prep, tmp_path / "s")
    assert str(folder) in str(e.value) and "rm -r" in str(e.value) and "\n" not in str(e.value)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    (folder / "images.npy").write_bytes(bytes(flipped))
    with pytest.raises(StoreError, match="corrupt"):
        open_store(folder, key)
    (folder / "images.npy").write_bytes(data)
    open_store(folder, key)
    meta = json.loads((folder / "store.json").read_text())
    (folder / "store.json").write_text(json.dumps({**meta, "format": "something-else"}))
    with pytest.raises(StoreError, match="foreign"):
        open_store(folder, key)
    (folder / "store.json").write_text(json.dumps(meta))
    # an index of another length, its checksum recorded (written by something else): refused, not read
    import numpy as np

    with np.load(folder / "index.npz") as z:
        short = {k: z[k][:-1] for k in z.files}
    np.savez(folder / "index.npz", **short)
    (folder / "store.json").write_text(json.dumps({**meta, "index_sha256": st.file_sha256(folder / "index.npz")}))
    with pytest.raises(StoreError, match=r"corrupt \(index.npz has \[5\] rows, images.npy 6\)"):
        open_store(folder, key)


def test_an_opened_store_keeps_no_index_in_memory_and_pickles_without_it(tmp_path):
    """A site keeps the memory map and the metadata only: the index is read from disk when asked (opening,
    relabelling), so simulated sites sharing a validation store do not each hold a copy of its index."""
    import pickle

    import numpy as np

    paths = _images(tmp_path, 5, 20)
    labels = np.eye(5, 3, dtype=np.float32)
    store = ensure_store(paths, Preprocessing(8, 1), tmp_path / "s", labels=labels)
    assert set(vars(store)) == {"folder", "meta", "_images", "_crcs", "_verified", "_all"}
    assert store._crcs is None and store._verified is None  # the chunk checks: a few bytes a chunk, on first read
    store.batch([0])
    assert len(store._verified) == len(store._crcs) == -(-5 // store.meta["chunk_rows"])
    np.testing.assert_array_equal(store.index["labels"], labels)
    state = pickle.dumps(store)
    assert len(state) < 2000 and pickle.loads(state).index["position"].tolist() == list(range(5))
    assert st.relabel(store, labels[::-1].copy(), np.ones_like(labels, bool))  # a corrected label: on disk
    np.testing.assert_array_equal(store.index["labels"], labels[::-1])


def test_an_undecodable_image_names_its_row_and_the_rest_is_kept(tmp_path):
    paths = _images(tmp_path, 6, 20)
    (tmp_path / "img3.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    prep = Preprocessing(8, 1)
    with pytest.raises(DecodeFailure) as e:
        ensure_store(paths, prep, tmp_path / "s", workers=1)
    assert e.value.failures[0][0] == 3 and "img3.png" in e.value.failures[0][1]


def test_a_build_that_would_overrun_its_budget_stops_with_the_command(tmp_path):
    paths = _images(tmp_path, 12, 20)
    with pytest.raises(StoreError, match="fedpartial-store"):
        build_store(paths, Preprocessing(8, 1), tmp_path / "s", chunk_rows=2, workers=1, budget_s=0.0)


def test_a_parallel_build_over_its_budget_keeps_the_chunks_its_pool_finished(tmp_path):
    """With a process pool, the pool starts on the next chunks while this process decodes the first (its CPU time
    per image is the estimate); over the budget, the chunks already decoded are logged, and a later build resumes
    after them and gives the same store as one built without stopping."""
    paths = _images(tmp_path, 24, 20)
    prep = Preprocessing(8, 1)
    with pytest.raises(StoreError, match="fedpartial-store"):
        build_store(paths, prep, tmp_path / "s", chunk_rows=2, workers=2, budget_s=0.0)
    kept = st._read_log(tmp_path / "s" / "chunks.log")
    assert 0 in kept and 1 <= len(kept) < 12  # the first chunk and what the pool finished
    again = build_store(paths, prep, tmp_path / "s", chunk_rows=2, workers=2)
    assert again["decoded"] == 24 - 2 * len(kept)
    whole = build_store(paths, prep, tmp_path / "t", chunk_rows=2, workers=1)
    assert whole["decoded"] == 24
    assert np.array_equal(open_store(tmp_path / "s").images, open_store(tmp_path / "t").images)


def test_jpeg_uses_draft_scaling(tmp_path):
    """A large JPEG decoded for a small target is decoded at a reduced DCT scale (same result as a full decode
    resized, within JPEG's own error)."""
    rng = np.random.default_rng(0)
    big = np.repeat(np.repeat(rng.integers(0, 256, (32, 32), dtype=np.uint8), 16, 0), 16, 1)
    p = tmp_path / "big.jpg"
    Image.fromarray(big).save(p, quality=95)
    out = st.decode_resized(p, Preprocessing(32, 1), 1)
    full = np.asarray(Image.open(p).resize((32, 32), Image.Resampling.BOX)).astype(int)
    assert out.shape == (1, 32, 32) and np.abs(out[0].astype(int) - full).mean() < 3


def test_fedpartial_store_builds_what_the_site_then_opens_without_decoding(tmp_path, monkeypatch):
    """``fedpartial-store --site-config`` builds the store a site's datasets then open (same folder, no decode)."""
    import json

    from fedpartial.data.manifest import read_manifest
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.sitedata import SiteDatasets
    from fedpartial.data.store_cli import main

    _images(tmp_path, 4, 40)
    (tmp_path / "train.csv").write_text("image,Atelectasis\n" + "".join(f"img{i}.png,{i % 2}\n" for i in range(4)))
    cfg = tmp_path / "fedpartial_data.json"
    cfg.write_text(json.dumps({"datasets": {"nih_cxr14": {"data_root": ".", "train": "train.csv"}}}))
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))
    assert main(["--site-config", str(cfg), "--preset", "nih_cxr14", "--image-size", "16"]) == 0
    calls = []
    real = st.decode_resized
    monkeypatch.setattr(st, "decode_resized", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    ds = resolve_dataset({"preset": "nih_cxr14", "image_size": 16})
    m = read_manifest(tmp_path / "train.csv", ds["classes"], data_root=tmp_path, require_annotated=False)
    data = SiteDatasets({"train": m.subset("train")}, ds)
    data.open_stores()
    batch = next(iter(data.train_loader({"image": "weak"}, 4, batched=True)))
    assert calls == [] and batch["image"].shape == (4, 1, 16, 16) and batch["image"].dtype == torch.float32


def test_fedpartial_store_finds_every_corrupt_chunk_and_decodes_only_those(tmp_path, monkeypatch, capsys):
    """A store whose chunks changed on disk after its build: the job's sample of four chunks may miss one (chunk 3
    of 5 here) and refuses the store when it finds one (chunk 0), naming fedpartial-store; fedpartial-store checks
    every chunk, names the bad ones and decodes their rows only, and the store then opens and reads as built."""
    import json

    from fedpartial.data.store_cli import main

    n = 5 * st.CHUNK_ROWS - 10  # 5 chunks; open_store's sample checks chunks 0, 1, 2 and 4
    _images(tmp_path, n, 12)
    (tmp_path / "train.csv").write_text("image,Atelectasis\n" + "".join(f"img{i}.png,{i % 2}\n" for i in range(n)))
    cfg = tmp_path / "fedpartial_data.json"
    cfg.write_text(json.dumps({"datasets": {"nih_cxr14": {"data_root": ".", "train": "train.csv"}}}))
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))
    argv = ["--site-config", str(cfg), "--preset", "nih_cxr14", "--image-size", "8", "--workers", "1"]
    assert main(argv) == 0
    folder = next(p for p in (tmp_path / "cache" / "stores").glob("*-8px-*") if p.is_dir())
    good = np.load(folder / "images.npy").copy()
    per = st.CHUNK_ROWS
    mm = np.load(folder / "images.npy", mmap_mode="r+")
    mm[3 * per + 5, 0, 2, 2] ^= 0xFF  # chunk 3: outside the sample
    mm.flush()
    del mm
    open_store(folder)  # the fault: the job's check does not see it
    capsys.readouterr()
    calls = []
    real = st.decode_resized
    monkeypatch.setattr(st, "decode_resized", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    assert main(argv) == 0
    out = capsys.readouterr()
    said = out.out + out.err
    assert f"rows {3 * per}..{4 * per - 1} do not match their checksum" in said, said
    assert len(calls) == per  # that chunk's rows, decoded again
    assert np.array_equal(np.load(folder / "images.npy"), good)
    open_store(folder).verify()
    # a bad chunk in the sample: the job refuses the store, the tool rebuilds it (two chunks at once)
    mm = np.load(folder / "images.npy", mmap_mode="r+")
    mm[0, 0, 0, 0] ^= 0xFF
    mm[4 * per, 0, 0, 0] ^= 0xFF
    mm.flush()
    del mm
    with pytest.raises(StoreError, match="fedpartial-store"):
        open_store(folder)
    calls.clear()
    assert main(argv) == 0
    said = "".join(capsys.readouterr())
    assert f"rows 0..{per - 1}, {4 * per}..{n - 1} do not match their checksum" in said, said
    assert len(calls) == per + (n - 4 * per)
    assert np.array_equal(np.load(folder / "images.npy"), good)
    open_store(folder).verify()


def _site(tmp_path, n=6, cache="store"):
    from fedpartial.data.manifest import read_manifest, write_manifest
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.sitedata import SiteDatasets

    _images(tmp_path, n, 24)
    ds = resolve_dataset(
        {"preset": "ich_phantom", "image_size": 8, "cache": cache, "cache_dir": str(tmp_path / "stores")}
    )
    C = len(ds["classes"])
    labels, mask = np.eye(C)[np.arange(n) % C], np.ones((n, C), bool)
    write_manifest(tmp_path / "m.csv", [f"img{i}.png" for i in range(n)], labels, mask, ds["classes"])
    m = read_manifest(tmp_path / "m.csv", ds["classes"], data_root=tmp_path, site="site-1")
    return SiteDatasets({"train": m}, ds), ds


def test_cache_modes_give_the_same_images_and_memory_keeps_a_uint8_copy(tmp_path):
    """'store', 'disk' and 'memory' read the same stored uint8 images ('memory' from a copy in the process), the
    1-channel store repeated to the 3-channel model's input on conversion; an unknown mode is an error."""
    batches = {}
    for cache in ("store", "disk", "memory"):
        data, _ = _site(tmp_path, cache=cache)
        batches[cache] = next(iter(data.eval_loader("train", 6)))["image"]
        assert batches[cache].shape == (6, 3, 8, 8) and torch.equal(batches[cache][:, 0], batches[cache][:, 2])
    assert torch.equal(batches["store"], batches["disk"]) and torch.equal(batches["store"], batches["memory"])
    data, _ = _site(tmp_path, cache="memory")
    assert isinstance(data.images("train"), np.ndarray) and data.images("train").dtype == np.uint8
    with pytest.raises(ValueError, match="cache"):
        _site(tmp_path, cache="float")


def test_an_undecodable_image_is_a_manifest_error_at_its_line(tmp_path):
    from fedpartial.data.manifest import ManifestError

    data, _ = _site(tmp_path)
    (tmp_path / "img4.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    with pytest.raises(ManifestError) as e:
        data.open_stores()
    assert "site 'site-1'" in str(e.value) and "line 6" in str(e.value) and "img4.png" in str(e.value)


def test_a_site_whose_stores_do_not_fit_the_data_check_is_told_what_to_run(tmp_path):
    """With no time left for the build the site's stores are not started: one line naming fedpartial-store with
    the job's size and channels."""
    data, ds = _site(tmp_path, n=200)
    with pytest.raises(StoreError) as e:
        data.open_stores(budget_s=0.0)
    msg = str(e.value)
    assert "fedpartial-store" in msg and "--image-size 8" in msg and "--channels 3" in msg and "\n" not in msg


def test_a_manifest_mixing_gray_and_colour_is_stored_in_colour_and_each_row_equals_its_file_alone(tmp_path):
    """Gray first, colour later: the store takes the job's 3 channels (a header of every image is read), the gray
    rows repeated; each row equals the file decoded alone in its own channels and repeated (what
    fedpartial-predict's DecodedImages and an exported bundle do), and DecodedImages gives the store's bytes."""
    rng = np.random.default_rng(3)
    paths = []
    for i, mode in enumerate(["L", "L", "RGB", "L"]):
        shape = (40, 40) if mode == "L" else (40, 40, 3)
        p = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8), mode).save(p)
        paths.append(str(p))
    prep = Preprocessing(16, 3)
    assert st.manifest_channels(paths, prep) == 3 and st.manifest_channels([paths[0], paths[1]], prep) == 1
    assert st.manifest_channels(paths, Preprocessing(16, 1)) == 1
    build_store(paths, prep, tmp_path / "s", workers=1)
    rows = np.asarray(open_store(tmp_path / "s").images)
    assert rows.shape == (4, 3, 16, 16)
    for i, p in enumerate(paths):
        alone = st.decode_resized(p, prep, st.stored_channels(st.native_channels(p, prep), prep))
        np.testing.assert_array_equal(rows[i], np.repeat(alone, 3, 0) if alone.shape[0] == 1 else alone)
    decoded = st.DecodedImages(paths, prep)
    np.testing.assert_array_equal(decoded.batch([0, 1, 2, 3]), rows)
    np.testing.assert_array_equal(decoded.batch([3, 0]), rows[[3, 0]][:, :1])  # gray only: one channel
