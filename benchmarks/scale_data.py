"""The image store at the releases' sizes: synthetic releases in the published layouts, built from the shared
images, measured, removed.

    python benchmarks/scale_data.py            # full: 20,000 NIH-like 1024 px PNGs, 2,000 MIMIC-like JPGs, 112,120 rows
    python benchmarks/scale_data.py --quick    # the same keys at a small size (<= 3 min), printed as JSON

Releases (under a temporary folder, removed at the end; nothing committed):

- NIH-like: ``images/*.png`` 1024 x 1024 grayscale + ``Data_Entry_2017.csv`` (``Image Index``, ``Finding Labels``,
  ``Patient ID``), each image one of the shared 64 px NIH images upscaled (bicubic) with noise (PNG of about the
  release's size per image). To keep generation within minutes, ``--distinct`` different images are encoded and
  the release's other files are copies of them with their own bytes (``tagged_copy``: prepare keeps byte-identical
  files in one split; every file is decoded on its own; the CPU cost per image is what is measured).
- MIMIC-like: ``files/p1x/p<subject>/s<study>/<dicom_id>.jpg`` 2500 x 3000 grayscale JPEG (per-image figures).
- a 112,120-row NIH-like release with 32 px images (the row scaling of the data check).

Keys written to ``benchmarks/results/scale_data.json`` (``--quick``: printed only, unless ``--out``):

- ``bytes_per_image``: store bytes per image at 224 px, 1 channel (``images.npy`` size / N).
- ``prepare_ratio_to_decode``: prepare's CPU time per NIH-like image (``fedpartial-prepare --no-decode`` + the store
  build, every process) over one plain Pillow decode + box resize of the same images (one process).
  ``prepare_ratio_to_decode_jpg``: the same for the MIMIC-like JPEGs (the store decodes them at a reduced DCT scale).
- ``prepare_core_scaling``: store build wall time with 1 process over 2 processes (same images).
- ``restart_decodes``: images decoded when every site opens its stores a second time.
- ``datacheck_s_112k``: one site's data check + dataset open on the 112,120-row release (manifests read, stores
  opened and checked against the files' sizes and mtimes, datasets built), stores already built.
- ``resume_lost_fraction``: a store build killed half-way and restarted: (images decoded by both runs - N) / N.
- ``loader_img_per_s``: 224 px uint8 batches of 32 from the store, shuffled, host side, one core.
- ``sites_pss_gb`` / ``sites_pss_bound_gb``: 8 processes (``--quick``: 4), each a site reading its training store and
  the shared validation and test stores; summed proportional set size, and its bound: the same processes before
  opening their stores (each site having run every step once and let go: code paths and allocator warm) + one copy
  of the validation / test stores + each site's training store (a store's ``images.npy`` in whole pages) + one heap
  growth step a site (glibc's 128 KiB top pad: the open stores' and datasets' Python objects hold no image). Every
  PSS is read by this process, of all sites at once, between the sites' steps; ``sites_pss_detail`` has the growth
  per step and per kind of mapping (stores, heap, other anonymous memory, files).
- ``format``: the memory map against LMDB (raw uint8 bytes per key, ``lmdb``): bytes per image, batch read rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "custom"))

from fedpartial.data.catalog.nih_cxr14 import CLASSES as NIH_CLASSES  # noqa: E402 - the release's 14 findings

SHARED = ROOT.parent / "shared" / "data" / "nih_cxr14_1000"
RESULTS = ROOT / "benchmarks" / "results" / "scale_data.json"
TOP8 = NIH_CLASSES[:6] + ["Pneumothorax", "Consolidation"]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ releases


def _shared_images() -> list[Path]:
    imgs = sorted((SHARED / "images").glob("*.png"))
    if not imgs:
        raise SystemExit(f"{SHARED}/images not found: the shared NIH images are needed")
    return imgs


def _make_png(args) -> None:
    from PIL import Image

    src, out, size, seed = args
    rng = np.random.default_rng(seed)
    big = Image.open(src).convert("L").resize((size, size), Image.Resampling.BICUBIC)
    a = np.asarray(big).astype(np.int16) + rng.integers(-4, 5, (size, size), dtype=np.int16)
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(out, "PNG", compress_level=1)


def _make_jpg(args) -> None:
    from PIL import Image

    src, out, seed = args
    rng = np.random.default_rng(seed)
    big = Image.open(src).convert("L").resize((2500, 3000), Image.Resampling.BICUBIC)
    a = np.asarray(big).astype(np.int16) + rng.integers(-3, 4, big.size[::-1], dtype=np.int16)
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)


def tagged_copy(src: Path, dst: Path, tag: int) -> None:
    """A copy of a PNG / JPEG with the same pixels and its own bytes (a PNG ``tEXt`` chunk before ``IEND``, a JPEG
    comment after ``SOI`` carry ``tag``): prepare merges byte-identical files into one patient, so the release's
    repeated images must differ as files, as a real release's do."""
    import struct
    import zlib

    data = src.read_bytes()
    text = b"fedpartial\x00" + str(tag).encode()
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        chunk = struct.pack(">I", len(text)) + b"tEXt" + text + struct.pack(">I", zlib.crc32(b"tEXt" + text))
        end = data.rindex(b"IEND") - 4
        data = data[:end] + chunk + data[end:]
    else:  # JPEG: a COM segment right after SOI
        data = data[:2] + b"\xff\xfe" + struct.pack(">H", len(text) + 2) + text + data[2:]
    dst.write_bytes(data)


def nih_release(folder: Path, n: int, size: int, distinct: int, workers: int, seed: int = 0) -> Path:
    """``folder/images/<8 digits>_<3 digits>.png`` + ``Data_Entry_2017.csv``; ~3 images per patient."""
    import pandas as pd

    shared = _shared_images()
    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    names = [f"{i // 3 + 1:08d}_{i % 3:03d}.png" for i in range(n)]
    base = [folder / "images" / names[i] for i in range(min(distinct, n))]
    jobs = [(shared[i % len(shared)], base[i], size, seed * 100003 + i) for i in range(len(base))]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_make_png, jobs, chunksize=8))
    for i in range(len(base), n):
        tagged_copy(base[i % len(base)], folder / "images" / names[i], i)
    labels = rng.random((n, len(NIH_CLASSES))) < np.linspace(0.12, 0.01, len(NIH_CLASSES))
    finding = ["|".join(c for c, y in zip(NIH_CLASSES, row) if y) or "No Finding" for row in labels]
    pd.DataFrame(
        {
            "Image Index": names,
            "Finding Labels": finding,
            "Follow-up #": [i % 3 for i in range(n)],
            "Patient ID": [i // 3 + 1 for i in range(n)],
            "View Position": "PA",
        }
    ).to_csv(folder / "Data_Entry_2017.csv", index=False)
    return folder


def mimic_release(folder: Path, n: int, distinct: int, workers: int) -> list[Path]:
    shared = _shared_images()
    paths = []
    for i in range(n):
        subject = 10000000 + i // 2
        d = folder / "files" / f"p{str(subject)[:2]}" / f"p{subject}" / f"s{50000000 + i}"
        d.mkdir(parents=True, exist_ok=True)
        paths.append(d / f"{i:08x}-dicom.jpg")
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_make_jpg, [(shared[i % len(shared)], paths[i], i) for i in range(min(distinct, n))]))
    for i in range(distinct, n):
        tagged_copy(paths[i % distinct], paths[i], i)
    return paths


def prepare_split(root: Path, out: Path, sites: int, site_size: int | None = None) -> float:
    """``fedpartial-prepare`` (no decode: the store build decodes) -> CPU seconds of the process."""
    cmd = [
        sys.executable,
        "-m",
        "fedpartial.data.prepare_cli",
        "--source",
        "nih_cxr14",
        "--root",
        str(root),
        "--out",
        str(out),
        "--sites",
        str(sites),
        "--protocol",
        "missing_k",
        "--k",
        "7",
        "--val-frac",
        "0.1",
        "--test-frac",
        "0.3",
        "--classes",
        *TOP8,
        "--no-decode",
        "--no-figure",
        "--seed",
        "0",
    ]
    if site_size:
        cmd += ["--site-size", str(site_size)]
    t = os.times()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    u = os.times()
    return (u.children_user - t.children_user) + (u.children_system - t.children_system)


# ----------------------------------------------------------------------------------------------- measures


def plain_decode_s(paths, size: int) -> float:
    """CPU seconds per image of one plain Pillow decode + box resize (no draft)."""
    from PIL import Image

    t = time.process_time()
    for p in paths:
        with Image.open(p) as im:
            im.convert("L").resize((size, size), Image.Resampling.BOX)
    return (time.process_time() - t) / len(paths)


def dataset_cfg(size: int, cache_dir: Path) -> dict:
    from fedpartial.data.presets import resolve_dataset

    return resolve_dataset({"preset": "nih_cxr14", "image_size": size, "cache_dir": str(cache_dir)})


def site_manifests(prepared: Path, site: str):
    from fedpartial.data.manifest import read_manifest
    from fedpartial.data.prepare import load_prepared

    p = load_prepared(prepared)
    read = dict(data_root=p.data_root, site=site, task=p.task, duplicates="error")
    m = {"train": read_manifest(p.sites[site], p.classes, **read).subset("train")}
    for s in ("val", "test"):
        m[s] = read_manifest(getattr(p, s), p.classes, **read)
    return m


def build_all_stores(prepared: Path, size: int, cache_dir: Path) -> dict:
    """Every site's stores (shared sets once): CPU seconds (workers + this process), images decoded."""
    from fedpartial.data import store as st
    from fedpartial.data.prepare import load_prepared
    from fedpartial.data.sitedata import SiteDatasets

    cfg = dataset_cfg(size, cache_dir)
    out = {"cpu_s": 0.0, "cpu_s_pool": 0.0, "decoded": 0, "wall_s": 0.0}
    real = st.build_store

    def counted(*a, **k):
        r = real(*a, **k)
        out["cpu_s"] += r["cpu_s"]
        out["cpu_s_pool"] += r["cpu_s_pool"]
        out["decoded"] += r["decoded"]
        return r

    st.build_store = counted
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for site in load_prepared(prepared).sites:
            SiteDatasets(site_manifests(prepared, site), cfg, log_fn=lambda m: None).open_stores()
    finally:
        st.build_store = real
    out["wall_s"] = time.perf_counter() - t0
    out["parent_cpu_s"] = time.process_time() - c0
    return out


def count_lines(file: Path) -> int:
    return len(file.read_text().splitlines()) if file.is_file() else 0


def resume_fraction(paths: list[str], size: int, folder: Path, trace: Path) -> dict:
    """Kill a store build (its process group) once half the chunks are committed, restart it, count decodes."""
    code = (
        "import sys, json; sys.path.insert(0, %r); from fedpartial.data.store import build_store, Preprocessing;"
        "paths = json.load(open(%r)); build_store(paths, Preprocessing(%d, 1), %r, log_fn=lambda m: None)"
    )
    plist = folder.parent / "resume_paths.json"
    plist.write_text(json.dumps(paths))
    env = {**os.environ, "FEDPARTIAL_STORE_TRACE": str(trace)}
    cmd = [sys.executable, "-c", code % (str(ROOT / "custom"), str(plist), size, str(folder))]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    n_chunks = -(-len(paths) // 64)
    while proc.poll() is None:
        log = folder / "chunks.log"
        if log.is_file() and count_lines(log) >= n_chunks // 2:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    first = count_lines(trace)
    trace.unlink()
    subprocess.run(cmd, env=env, check=True)
    second = count_lines(trace)
    n = len(paths)
    return {
        "n": n,
        "decoded_before_kill": first,
        "decoded_after_restart": second,
        "lost_fraction": max(0, first + second - n) / n,
    }


def loader_rate(prepared: Path, size: int, cache_dir: Path, seconds: float = 5.0) -> float:
    import torch

    from fedpartial.data.sitedata import SiteDatasets

    torch.set_num_threads(1)
    data = SiteDatasets(site_manifests(prepared, "site-1"), dataset_cfg(size, cache_dir))
    data.open_stores()
    next(iter(data._batches("train", 32, True, 0, False)))  # imports and first touch outside the clock
    n, t0 = 0, time.perf_counter()
    for epoch in range(1000):
        for split in ("test", "val", "train"):
            for b in data._batches(split, 32, True, epoch, False):
                n += len(b["source"])
                if time.perf_counter() - t0 > seconds:
                    return n / (time.perf_counter() - t0)
    return n / (time.perf_counter() - t0)


SITE_CODE = r"""
import sys, json
sys.path.insert(0, %(custom)r)
import torch, filelock  # in the baseline
from fedpartial.data.sitedata import SiteDatasets
sys.path.insert(0, %(bench)r)
from scale_data import PAGE, SITE_STEPS, mapped_bytes, site_manifests, dataset_cfg
from pathlib import Path
torch.set_num_threads(1)
sys.stdin.readline()  # "start": stdin's buffer is allocated before the baseline, not inside a measured step
m = site_manifests(Path(%(prepared)r), %(site)r)
info = {"train_bytes": 0, "shared_bytes": 0,
        "label_bytes": int(sum(x.labels.nbytes + x.mask.nbytes for x in m.values()))}


def step(name):
    if name == "open_stores":
        data.open_stores()
    elif name.startswith("batches_"):  # in the jobs' batches of 32; the last one let go, as a training step does
        for b in data._batches(name[len("batches_"):], 32, False, 0, False):
            pass
    elif name == "touch_all_pages":
        for s in ("train", "val", "test"):  # every page of the three stores touched through the map, one byte
            flat = memoryview(data.images(s).images).cast("B")  # each (no reduction buffers, nothing allocated)
            for i in range(0, flat.nbytes, PAGE):
                flat[i]
            del flat
        info["train_bytes"] = mapped_bytes(data.images("train"))
        info["shared_bytes"] = mapped_bytes(data.images("val")) + mapped_bytes(data.images("test"))


data = SiteDatasets(m, dataset_cfg(%(size)d, Path(%(cache)r)))
for name in SITE_STEPS:  # every step once (code paths, allocator), then let go: the baseline
    step(name)
del data
import gc; gc.collect()
data = SiteDatasets(m, dataset_cfg(%(size)d, Path(%(cache)r)))
print(json.dumps({"ready": len(json.dumps(info))}), flush=True)  # the encoder used once before the baseline
for line in sys.stdin:  # one step per line; the parent measures every site between steps
    if not line.strip():
        break
    step(line.strip())
    print(json.dumps(info), flush=True)
"""

PAGE = os.sysconf("SC_PAGE_SIZE")
HEAP_STEP = 128 * 1024  # glibc's default M_TOP_PAD: the least a process's heap grows by when it grows


def mapped_bytes(store) -> int:
    """A store's images in memory, one copy: its ``images.npy`` in whole pages (the map is of whole pages, the
    first one shared with the file's header)."""
    return -(-(store.folder / "images.npy").stat().st_size // PAGE) * PAGE


SITE_STEPS = ("open_stores", "batches_train", "batches_val", "batches_test", "touch_all_pages")


def pss_by_kind(pid: int) -> dict[str, int]:
    """A process's PSS in bytes by mapping kind (``/proc/PID/smaps``): the image stores' memory maps, the heap,
    other anonymous memory, files (libraries)."""
    out = {"stores": 0, "heap": 0, "anon": 0, "files": 0}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if not head.endswith(":"):  # a mapping's first line: range perms offset dev inode [path]
                path = rest.split()[4] if len(rest.split()) > 4 else ""
                kind = (
                    "stores"
                    if path.endswith("images.npy")
                    else "heap"
                    if path == "[heap]"
                    else "files"
                    if path.startswith("/")
                    else "anon"
                )
            elif head == "Pss:":
                out[kind] += int(rest.split()[0]) * 1024
    return out


def sites_pss(prepared: Path, size: int, cache_dir: Path, sites: list[str]) -> dict:
    """Summed PSS of one process per site (all alive at once), before and after reading their stores.

    Every measurement is taken by this process, of every site at once, between the sites' steps (a shared page
    counts 1/k in each of the k processes mapping it, so a PSS read while other sites were at another step would
    split the shared pages otherwise); the sites themselves run no measuring code."""
    procs = []
    for s in sites:
        code = SITE_CODE % {
            "custom": str(ROOT / "custom"),
            "bench": str(ROOT / "benchmarks"),
            "prepared": str(prepared),
            "site": s,
            "size": size,
            "cache": str(cache_dir),
        }
        procs.append(
            subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
        procs[-1].stdin.write("start\n")
        procs[-1].stdin.flush()
    for p in procs:  # every site ready (warmed up, stores not yet open)
        if "ready" not in json.loads(p.stdout.readline() or "{}"):
            raise RuntimeError(f"a site process failed before its first step (rc {p.wait()})")
    kinds = [[pss_by_kind(p.pid) for p in procs]]
    for name in SITE_STEPS:
        for p in procs:
            p.stdin.write(name + "\n")
            p.stdin.flush()
        after = [json.loads(p.stdout.readline()) for p in procs]
        kinds.append([pss_by_kind(p.pid) for p in procs])
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait()

    def total(snapshot) -> int:
        return sum(sum(k.values()) for k in snapshot)

    before, now = total(kinds[0]), total(kinds[-1])
    shared = after[0]["shared_bytes"]
    train = sum(a["train_bytes"] for a in after)
    # + one allocator growth step a site: the heap grows by glibc's top pad (128 KiB) beyond a request, so the
    # few Python objects of a site's open stores and datasets (no image bytes) can show up as up to 128 KiB
    bound = before + shared + train + len(sites) * HEAP_STEP
    return {
        "sites": len(sites),
        "pss_before_gb": before / 1e9,
        "pss_gb": now / 1e9,
        "bound_gb": bound / 1e9,
        "shared_store_gb": shared / 1e9,
        "train_stores_gb": train / 1e9,
        "over_bound_mb_per_site": round((now - bound) / len(sites) / 1e6, 3),
        # all sites' PSS growth per step (MB, summed over the sites)
        "steps_mb": {n: round((total(kinds[i + 1]) - total(kinds[i])) / 1e6, 3) for i, n in enumerate(SITE_STEPS)},
        # the growth by mapping kind (MB, summed over the sites): the stores' maps against one copy of each store
        "growth_mb_by_kind": {
            k: round(sum(a[k] - b[k] for a, b in zip(kinds[-1], kinds[0])) / 1e6, 3) for k in kinds[0][0]
        },
        "stores_one_copy_mb": round((shared + train) / 1e6, 3),
        "label_arrays_mb_per_site": round(sum(a["label_bytes"] for a in after) / len(after) / 1e6, 3),
    }


def format_compare(store_folder: Path, work: Path, n: int, seconds: float = 3.0) -> dict:
    """The memory map against LMDB (raw uint8 bytes per key) on the same images: size and random batch reads."""
    from fedpartial.data.store import open_store

    s = open_store(store_folder)
    n = min(n, len(s))
    rng = np.random.default_rng(0)
    out = {}

    def rate(read) -> float:
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            read(rng.integers(0, n, 32))
            k += 32
        return k / (time.perf_counter() - t0)

    out["memmap"] = {
        "bytes_per_image": (store_folder / "images.npy").stat().st_size / len(s),
        "batch32_img_per_s": rate(lambda idx: s.batch(idx)),
    }
    try:
        import lmdb
    except ImportError:
        out["lmdb"] = "not installed (pip install lmdb)"
        return out
    path = work / "lmdb_store"
    t0 = time.perf_counter()
    env = lmdb.open(str(path), map_size=int(n * s.images[0].nbytes * 2 + 2**26), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"{i:09d}".encode(), np.ascontiguousarray(s.images[i]).tobytes())
    write_s = time.perf_counter() - t0
    shape = s.images.shape[1:]

    def read_lmdb(idx):
        with env.begin() as txn:
            return np.stack([np.frombuffer(txn.get(f"{i:09d}".encode()), np.uint8).reshape(shape) for i in idx])

    size = sum(f.stat().st_size for f in path.iterdir())
    out["lmdb"] = {"bytes_per_image": size / n, "batch32_img_per_s": rate(read_lmdb), "write_s": write_s}
    env.close()
    return out


def dicom_ms(n: int = 60) -> float:
    """CPU ms per RSNA-like CT slice (512 x 512 DICOM from the ICH phantom generator) stored at 224 px through the
    three CT windows of the rsna_ich preset."""
    from fedpartial.data.catalog.ich import CT_WINDOWS
    from fedpartial.data.catalog.ich.phantom import generate_ich_phantom
    from fedpartial.data.store import Preprocessing, decode_resized

    with tempfile.TemporaryDirectory() as d:
        generate_ich_phantom(d, n_images=n, size=512, seed=0)
        files = sorted(Path(d).rglob("*.dcm"))[:n]
        prep = Preprocessing(224, 3, tuple(tuple(w) for w in CT_WINDOWS))
        decode_resized(files[0], prep, 3)
        t = time.process_time()
        for f in files:
            decode_resized(f, prep, 3)
        return (time.process_time() - t) / len(files) * 1e3


# -------------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (<= 3 min), keys printed as JSON")
    ap.add_argument("--nih", type=int, help="NIH-like 1024 px images (default 20000; quick 960)")
    ap.add_argument("--mimic", type=int, help="MIMIC-like JPEGs (default 2000; quick 24)")
    ap.add_argument("--rows", type=int, help="rows of the small-image NIH-like release (default 112120; quick 6000)")
    ap.add_argument("--distinct", type=int, help="distinct encoded images per release (default 400; quick 60)")
    ap.add_argument("--out", help=f"result file (default {RESULTS.relative_to(ROOT)}; quick: none)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--dicom-only", action="store_true", help="only the CPU ms per 512 px CT slice (RSNA-like)")
    args = ap.parse_args(argv)
    if args.dicom_only:
        print(json.dumps({"store_dicom_512_ms": dicom_ms()}))
        return 0
    q = args.quick
    n_nih = args.nih or (960 if q else 20000)
    n_mimic = args.mimic or (24 if q else 2000)
    rows = args.rows or (6000 if q else 112120)
    distinct = args.distinct or (40 if q else 400)
    workers = len(os.sched_getaffinity(0))
    size = 224
    res: dict = {
        "command": "python benchmarks/scale_data.py" + (" --quick" if q else ""),
        "sizes": {
            "nih_1024px_png": n_nih,
            "mimic_2500x3000_jpg": n_mimic,
            "rows_release": rows,
            "distinct_encoded": distinct,
            "image_size": size,
            "cores": workers,
        },
        "machine": {"cores": workers, "load_1min_at_start": os.getloadavg()[0]},
    }
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="fedpartial_scale_"))
    cache = work / "cache"
    os.environ["FEDPARTIAL_CACHE"] = str(cache)
    try:
        # -- NIH-like release, prepared and stored at 224 px
        say(f"NIH-like release: {n_nih} PNGs 1024 px ({distinct} distinct)")
        nih = nih_release(work / "nih", n_nih, 1024, distinct, workers)
        prep_cpu = prepare_split(nih, work / "nih_prepared", 8)
        say("stores of the 8 sites (train, shared val / test)")
        built = build_all_stores(work / "nih_prepared", size, cache / "stores")
        if built["decoded"] != n_nih:
            raise RuntimeError(f"the stores decoded {built['decoded']} images, the release has {n_nih}")
        sample = sorted((nih / "images").glob("*.png"))[: min(n_nih, distinct)]
        plain = plain_decode_s(sample, size)
        per_image = (prep_cpu + built["cpu_s_pool"] + built["parent_cpu_s"]) / n_nih  # every process, once each
        stores = sorted(p for p in (cache / "stores").iterdir() if p.is_dir())
        total_bytes = sum((p / "images.npy").stat().st_size for p in stores)
        res["bytes_per_image"] = total_bytes / n_nih
        res["prepare_ratio_to_decode"] = per_image / plain
        res["per_image_ms"] = {
            "plain_decode_png_1024": plain * 1e3,
            "prepare_png_1024": per_image * 1e3,
            "prepare_cli_png": prep_cpu / n_nih * 1e3,
            "store_build_wall_per_image": built["wall_s"] / n_nih * 1e3,
        }
        say("restart: every site opens its stores again")
        trace = work / "trace.txt"
        os.environ["FEDPARTIAL_STORE_TRACE"] = str(trace)
        again = build_all_stores(work / "nih_prepared", size, cache / "stores")
        os.environ.pop("FEDPARTIAL_STORE_TRACE")
        res["restart_decodes"] = count_lines(trace) + again["decoded"]
        say("core scaling: 1 vs 2 processes")
        from fedpartial.data.store import Preprocessing, build_store

        m = min(n_nih, 960 if q else 1200)
        some = [str(p) for p in sorted((nih / "images").glob("*.png"))[:m]]
        t1 = build_store(some, Preprocessing(size, 1), work / "scale1", workers=1, log_fn=lambda _: None)
        t2 = build_store(some, Preprocessing(size, 1), work / "scale2", workers=2, log_fn=lambda _: None)
        res["prepare_core_scaling"] = t1["wall_s"] / t2["wall_s"]
        res["core_scaling_detail"] = {"images": m, "wall_1_s": t1["wall_s"], "wall_2_s": t2["wall_s"]}
        say("resume after a kill half-way")
        r = resume_fraction(some, size, work / "resume_store", work / "resume_trace.txt")
        res["resume_lost_fraction"] = r["lost_fraction"]
        res["resume_detail"] = r
        say("loader")
        res["loader_img_per_s"] = loader_rate(work / "nih_prepared", size, cache / "stores", 2.0 if q else 5.0)
        say(f"{4 if q else 8} site processes sharing val / test")
        pss = sites_pss(work / "nih_prepared", size, cache / "stores", [f"site-{i}" for i in range(1, 5 if q else 9)])
        res["sites_pss_gb"], res["sites_pss_bound_gb"] = pss["pss_gb"], pss["bound_gb"]
        res["sites_pss_detail"] = pss
        say("format: memory map vs LMDB")
        biggest = max(stores, key=lambda p: (p / "images.npy").stat().st_size)
        res["format"] = format_compare(biggest, work, 400 if q else 3000, 2.0 if q else 4.0)
        shutil.rmtree(nih)

        # -- MIMIC-like JPEGs: per-image figures
        say(f"MIMIC-like: {n_mimic} JPEGs 2500 x 3000")
        jpgs = mimic_release(work / "mimic", n_mimic, min(n_mimic, max(8, distinct // 4)), workers)
        plain_jpg = plain_decode_s(jpgs[: min(n_mimic, 40 if q else 200)], size)
        b = build_store([str(p) for p in jpgs], Preprocessing(size, 1), work / "mimic_store", log_fn=lambda _: None)
        res["prepare_ratio_to_decode_jpg"] = b["cpu_s"] / n_mimic / plain_jpg
        res["per_image_ms"].update(
            {
                "plain_decode_jpg_2500x3000": plain_jpg * 1e3,
                "store_jpg_2500x3000": b["cpu_s"] / n_mimic * 1e3,
                "store_build_wall_per_image_jpg": b["wall_s"] / n_mimic * 1e3,
            }
        )
        shutil.rmtree(work / "mimic")
        res["per_image_ms"]["store_dicom_512"] = dicom_ms(20 if q else 60)

        # -- the 112k-row release (32 px images): one site's data check + dataset open
        say(f"{rows}-row NIH-like release (32 px)")
        big = nih_release(work / "rows", rows, 32, min(rows, 2000), workers, seed=1)
        t = time.perf_counter()
        prepare_split(big, work / "rows_prepared", 8, 5889)
        res["prepare_rows_s"] = time.perf_counter() - t
        build_all_stores(work / "rows_prepared", 32, cache / "stores_rows")
        t = time.perf_counter()
        from fedpartial.data.sitedata import SiteDatasets

        data = SiteDatasets(site_manifests(work / "rows_prepared", "site-1"), dataset_cfg(32, cache / "stores_rows"))
        data.open_stores()
        for split in ("train", "val", "test"):
            data.dataset(split, {"image": "eval"})
        res["datacheck_s_112k"] = time.perf_counter() - t
        res["datacheck_rows"] = {s: len(m) for s, m in data.manifests.items()}
        res["total_s"] = time.perf_counter() - t_start
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    keys = [
        "bytes_per_image",
        "prepare_ratio_to_decode",
        "prepare_core_scaling",
        "restart_decodes",
        "datacheck_s_112k",
        "resume_lost_fraction",
        "loader_img_per_s",
        "sites_pss_gb",
        "sites_pss_bound_gb",
    ]
    res["targets_met"] = {
        "bytes_per_image": res["bytes_per_image"] <= 1.05 * size * size,
        "prepare_ratio_to_decode": res["prepare_ratio_to_decode"] <= 1.2,
        "prepare_core_scaling": res["prepare_core_scaling"] >= 1.7,
        "restart_decodes": res["restart_decodes"] == 0,
        "datacheck_s_112k": res["datacheck_s_112k"] <= 30,
        "resume_lost_fraction": res["resume_lost_fraction"] <= 0.05,
        "loader_img_per_s": res["loader_img_per_s"] >= 5000,
        "sites_pss_gb": res["sites_pss_gb"] <= res["sites_pss_bound_gb"],
    }
    text = json.dumps({**{k: res[k] for k in keys}, **{k: v for k, v in res.items() if k not in keys}}, indent=1)
    print(text)
    out = Path(args.out) if args.out else (None if q else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
