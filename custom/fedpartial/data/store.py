"""The prepared image store: every image of a manifest decoded once, resized to the job's size, kept as uint8.

One store per manifest (a site's training rows, a shared validation or test set) and preprocessing, in a folder
under the cache root (:func:`fedpartial.data.cache.store_root`), named by a hash of the preprocessing (image size,
channels, CT windows, resize mode, format version) and of the manifest's absolute image paths::

    store.json     format, version, key, shape (N, c, S, S), chunk size, complete flag
    images.npy     uint8 (N, c, S, S), a NumPy .npy file read through np.memmap (c: the images' own channels:
                   a grayscale X-ray stays 1 channel, a job asking for 3 repeats it on the training device)
    index.npz      row -> position, each row's source file (path, size, mtime_ns) and label vector + mask
    chunks.log     one line per committed chunk of rows: "<chunk> <crc32 of its bytes>" (appended, fsynced)

Format: a plain ``.npy`` memory map (``benchmarks/scale_data.py`` measured it against LMDB, ``docs/datasets.md``):
reading a batch is one fancy index into the page cache (no per-image decode or key lookup), simulated sites
opening the same validation / test store share its pages, and the file is readable by NumPy alone.

Building (:func:`build_store`) decodes in a process pool over every core (JPEG through ``Image.draft`` when the
target size allows), each worker writing its chunk of rows straight into the memory map; the parent appends the
chunk to ``chunks.log`` once the worker has flushed it, so a killed build loses at most the chunks in flight
and a restart decodes only the rest. Progress: a tqdm bar on a terminal, ``k / N`` lines otherwise.

Opening (:func:`open_store`) checks the format, key, file size (a truncated store), the index's checksum and a
sample of the chunks' checksums (a corrupt store) and refuses anything else with one line naming the store and
what to run; :func:`ensure_store` then compares each row's source file size and mtime with the index (no image is
decoded) and decodes again only the rows whose file changed, naming them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..processes import pool_worker_init
from .cache import store_root
from .decode import (  # noqa: F401 - training's decoding of one file, imported from here by its callers
    DEFAULT_MAX_PIXELS,
    FORMAT,
    MAX_PIXELS_ENV,
    RESIZE_FILTERS,
    VERSION,
    Preprocessing,
    decode_resized,
    deep_colour,
    is_dicom,
    low_byte_tiles,
    native_channels,
    open_image,
    png_significant_bits,
    significant_bits,
    sixteen_bit_scale,
    stored_channels,
    upright,
)

TRACE_ENV = "FEDPARTIAL_STORE_TRACE"  # a file each decoded row is appended to (benchmarks count decodes with it)
CHUNK_ROWS = 64  # rows per committed chunk (a killed build loses at most the chunks being decoded)
log = logging.getLogger("fedpartial.store")


class StoreError(RuntimeError):
    """A store that cannot be used as it is (truncated, corrupt, foreign) or not built in time; one line naming
    the store and what to run."""


class DecodeFailure(RuntimeError):
    """Images that could not be decoded while building: ``failures`` = [(row, message), ...]."""

    def __init__(self, failures: list[tuple[int, str]]):
        self.failures = sorted(failures)
        row, msg = self.failures[0]
        more = f" ({len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        super().__init__(f"row {row}: {msg}{more}")


def store_key(paths: Sequence[str], prep: Preprocessing) -> str:
    """sha256 of the preprocessing and the ordered absolute image paths."""
    h = hashlib.sha256(json.dumps(prep.key(), sort_keys=True).encode())
    for p in paths:
        h.update(str(p).encode() + b"\0")
    return h.hexdigest()


def store_folder(
    paths: Sequence[str], prep: Preprocessing, root: str | os.PathLike | None = None, name: str = ""
) -> Path:
    """``<root>/<name>-<S>px-<key>``: the folder of the store of these images under this preprocessing."""
    slug = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:40] or "rows"
    return store_root(root) / f"{slug}-{prep.image_size}px-{store_key(paths, prep)[:16]}"


# ------------------------------------------------------------------------------------------------------- decoding
# (training's decoding of one file is fedpartial.data.decode, imported above: an exported bundle copies that file)


def _kind_or_gray(path: str, prep: Preprocessing) -> int:
    """:func:`native_channels`, or 1 for a file that cannot be read (the decoding names it at its row)."""
    try:
        return native_channels(path, prep)
    except (OSError, ValueError):
        return 1


def manifest_channels(
    paths: Sequence[str], prep: Preprocessing, desc: str = "image kinds", log_fn: Callable[[str], None] | None = None
) -> int:
    """A store's channels: 1 when the job is grayscale or every image is (headers read until a colour image is
    found; a header costs far less than a decode), else the job's; a grayscale image in a colour store is repeated, so every row
    equals its file decoded alone in its own channels and repeated (:class:`DecodedImages`, an exported bundle)."""
    if prep.channels == 1:
        return 1
    from concurrent.futures import ThreadPoolExecutor

    step = 4096
    update, close = _progress(len(paths), 0, desc, log_fn) if len(paths) > 8 * step else (lambda k: None, lambda: None)
    try:
        with ThreadPoolExecutor(max_workers=min(8, default_workers())) as pool:
            for a in range(0, len(paths), step):
                part = paths[a : a + step]
                if any(c != 1 for c in pool.map(lambda p: _kind_or_gray(p, prep), part)):
                    return prep.channels
                update(len(part))
    finally:
        close()
    return 1 if paths else prep.channels


class DecodedImages:
    """The rows of a store decoded again on every access, nothing kept (``cache: none``; ``fedpartial-predict``;
    an exported bundle decodes each file the same way): each row is :func:`decode_resized` of its file in the
    file's own stored channels (:func:`stored_channels`); a batch mixing grayscale and colour rows has its
    grayscale rows repeated to the job's channels, as a store of such a manifest holds them
    (:func:`manifest_channels`), so the values equal the store's byte for byte. Indexing as :class:`ImageStore`'s memory map: ``[i]`` -> ``(c, S, S)`` uint8,
    :meth:`batch` -> ``(B, c, S, S)``."""

    def __init__(self, paths: Sequence[str | os.PathLike], prep: Preprocessing):
        self.paths, self.prep = [str(p) for p in paths], prep
        self.channels = self._channels(0) if self.paths else 1
        self.image_size = prep.image_size

    def _channels(self, row: int) -> int:
        return stored_channels(native_channels(self.paths[row], self.prep), self.prep)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def images(self) -> "DecodedImages":
        return self

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self), self.channels, self.image_size, self.image_size)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            path = self.paths[int(index)]
            try:
                return decode_resized(path, self.prep, self._channels(int(index)))
            except Exception as e:  # noqa: BLE001 - decoders raise many types; the message names the file
                text = str(e) if path in str(e) else f"cannot read image {path}: {type(e).__name__}: {e}"
                raise ValueError(text) from None
        return self.batch(np.arange(len(self))[index])

    def batch(self, rows) -> np.ndarray:
        rows = np.asarray(rows, np.int64).reshape(-1)
        if not len(rows):
            return np.zeros((0, *self.shape[1:]), np.uint8)
        out = [self[int(r)] for r in rows]
        if len({x.shape[0] for x in out}) > 1:  # grayscale beside colour: gray repeated, as the device would
            out = [np.repeat(x, self.prep.channels, 0) if x.shape[0] == 1 else x for x in out]
        return np.stack(out)


def _decode_chunk(
    images: str, chunk: int, start: int, paths: Sequence[str], prep: Preprocessing, channels: int
) -> tuple[int, int | None, list[tuple[int, str]], float]:
    """Worker: decode rows ``start ..`` into the memory map, flush. Returns (chunk, crc32 of the chunk's bytes or
    None when a row failed, failures, CPU seconds)."""
    t0 = time.process_time()
    mm = np.load(images, mmap_mode="r+")
    failures = []
    trace = os.environ.get(TRACE_ENV)  # measurement hook (benchmarks/scale_data.py): one line per decoded row
    for i, p in enumerate(paths):
        try:
            mm[start + i] = decode_resized(p, prep, channels)
        except Exception as e:  # noqa: BLE001 - decoders raise many types
            failures.append((start + i, f"{type(e).__name__}: {e}".replace(str(p), Path(p).name)))
        if trace:
            with open(trace, "a") as f:
                f.write(f"{start + i}\n")
    mm.flush()
    crc = None if failures else zlib.crc32(memoryview(mm[start : start + len(paths)]).cast("B"))
    del mm
    return chunk, crc, failures, time.process_time() - t0


# -------------------------------------------------------------------------------------------------- the store


def _stamps(paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each file's size, mtime and ctime (ns; -1 for a file that is gone). The ctime is the one a replaced file
    cannot put back: ``touch -d`` / ``os.utime`` restore an mtime, and any write or rename sets the ctime anew."""
    size = np.zeros(len(paths), np.int64)
    mtime = np.zeros(len(paths), np.int64)
    ctime = np.zeros(len(paths), np.int64)
    for i, p in enumerate(paths):
        try:
            st = os.stat(p)
        except OSError:
            size[i], mtime[i], ctime[i] = -1, -1, -1
            continue
        size[i], mtime[i], ctime[i] = st.st_size, st.st_mtime_ns, st.st_ctime_ns
    return size, mtime, ctime


def _read_log(file: Path) -> dict[int, int]:
    """Committed chunks ``{chunk: crc32}`` (a torn last line is ignored; a later line for a chunk wins)."""
    out: dict[int, int] = {}
    if not file.is_file():
        return out
    for line in file.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].lstrip("-").isdigit() and parts[1].isdigit():
            c = int(parts[0])
            if c < 0:  # "-<chunk> 0": chunk invalidated (a source file changed)
                out.pop(-c - 1, None)
            else:
                out[c] = int(parts[1])
    return out


def _append_log(file: Path, lines: Sequence[str]) -> None:
    with open(file, "a") as f:
        f.write("".join(f"{l}\n" for l in lines))
        f.flush()
        os.fsync(f.fileno())


def _write_json(file: Path, obj: dict) -> None:
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, file)


def file_sha256(file: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ImageStore:
    """An opened store (:func:`open_store`): ``images`` ``(N, c, S, S)`` uint8 memory map (opened lazily, again
    in every process: pickling sends the folder, never the pixels), ``meta``, and the index arrays read from disk
    when asked (:attr:`index`: only opening and relabelling need them, so a site keeps none of them in memory; the
    shared validation / test stores' indexes are not copied into every simulated site)."""

    def __init__(self, folder: Path, meta: dict):
        self.folder, self.meta = Path(folder), meta
        self._images: np.ndarray | None = None
        self._crcs: dict[int, int] | None = None
        self._verified: np.ndarray | None = None  # chunk -> its rows matched their checksum in this process
        self._all = False  # every chunk verified: nothing left to check

    def __getstate__(self):
        return {
            "folder": self.folder,
            "meta": self.meta,
            "_images": None,
            "_crcs": None,
            "_verified": None,
            "_all": False,
        }

    @property
    def index(self) -> dict[str, np.ndarray]:
        """The index arrays (``position``, ``size``, ``mtime_ns``, ``labels``, ``mask``), read now (no paths)."""
        return _read_index(self.folder)

    def __len__(self) -> int:
        return int(self.meta["shape"][0])

    @property
    def channels(self) -> int:
        return int(self.meta["shape"][1])

    @property
    def image_size(self) -> int:
        return int(self.meta["shape"][2])

    def _map(self) -> np.ndarray:
        if self._images is None:
            self._images = np.load(self.folder / "images.npy", mmap_mode="r")
        return self._images

    def verify(self, rows=None) -> None:
        """Check the crc32 of every chunk holding ``rows`` (all rows: None) against ``chunks.log``, once per chunk
        and process, before any of its rows is served: a byte changed on disk after the build is a
        :class:`StoreError` naming the rows, never a row served. The checks slow a site's first shuffled pass over a
        store only (``python benchmarks/scale_data.py``: ``datacheck_s_112k`` opens a 112,120-row release's stores,
        every chunk verified)."""
        if self._verified is not None and self._all:
            return
        per = int(self.meta["chunk_rows"])
        n = len(self)
        if self._verified is None:
            self._crcs = _read_log(self.folder / "chunks.log")
            self._verified = np.zeros(-(-n // per) if n else 0, bool)
        chunks = (
            np.arange(len(self._verified)) if rows is None else np.unique(np.asarray(rows, np.int64) % max(n, 1) // per)
        )
        mm = self._map()
        for c in chunks[~self._verified[chunks]]:
            c = int(c)
            if zlib.crc32(memoryview(mm[c * per : (c + 1) * per]).cast("B")) != self._crcs.get(c):
                raise _refuse(
                    self.folder, f"corrupt (rows {c * per}..{min(n, (c + 1) * per) - 1} do not match their checksum)"
                )
            self._verified[c] = True
        self._all = bool(self._verified.all())

    @property
    def images(self) -> np.ndarray:
        """Every row (a read-only memory map), each chunk verified first (:meth:`verify`)."""
        self.verify()
        return self._map()

    def batch(self, rows) -> np.ndarray:
        """``(B, c, S, S)`` uint8 copy of ``rows`` (any order), gathered straight into the batch: one allocation
        of the batch's size (a fancy index would build a second, temporary copy first)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        n = len(self)
        if len(rows) and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the store's {n} images ({self.folder})")
        self.verify(rows)
        mm = self._map()
        out = np.empty((len(rows), *mm.shape[1:]), np.uint8)
        # mode="wrap" (bounds checked above; negative rows count from the end, as with indexing): numpy's "raise"
        # would gather into a temporary buffer before copying into ``out``
        return np.take(mm, rows, axis=0, out=out, mode="wrap")

    @property
    def paths(self) -> np.ndarray:
        """The source file of each row (read from the index when asked: a site does not keep them in memory)."""
        with np.load(self.folder / "index.npz", allow_pickle=False) as z:
            return z["paths"]

    def stale_rows(self, index: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Rows whose source file's size, mtime or ctime differ from the index (or that are gone); stats only (a
        chmod or a move of the files changes their ctime too: their rows are decoded again). ``index``:
        :attr:`index` when the caller has already read it."""
        size, mtime, ctime = _stamps(list(self.paths))
        index = self.index if index is None else index
        changed = (size != index["size"]) | (mtime != index["mtime_ns"])
        if "ctime_ns" in index:
            changed |= ctime != index["ctime_ns"]
        return np.flatnonzero(changed)


def _refuse(folder: Path, why: str) -> StoreError:
    return StoreError(
        f"image store {folder} is {why}; it is not read: remove it (rm -r '{folder}') and start "
        "the job again, or rebuild it first with fedpartial-store (docs/datasets.md, 'Image store')"
    )


def open_store(folder: str | os.PathLike, key: str | None = None, check_chunks: int = 4) -> ImageStore:
    """Open a complete store, refusing a foreign, truncated or corrupt one (:class:`StoreError`, one line).

    ``key``: the expected :func:`store_key` (a store of other images or settings is foreign); ``check_chunks``:
    how many chunks (first, last and evenly spaced) have their crc32 checked against ``chunks.log``."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "store.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(folder, f"not a readable store (store.json: {type(e).__name__})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise _refuse(
            folder,
            f"foreign (format {meta.get('format')!r} version {meta.get('version')!r}, expected {FORMAT!r} {VERSION})",
        )
    if key is not None and meta.get("key") != key:
        raise _refuse(folder, "foreign (built for other images or other preprocessing)")
    if not meta.get("complete"):
        raise _refuse(folder, "incomplete (its build did not finish)")
    shape = [int(s) for s in meta["shape"]]
    images = folder / "images.npy"
    try:
        mm = np.load(images, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
        raise _refuse(folder, f"truncated or corrupt (images.npy: {str(e) or type(e).__name__})") from None
    if list(mm.shape) != shape or mm.dtype != np.uint8:
        raise _refuse(folder, f"corrupt (images.npy holds {mm.dtype} {list(mm.shape)}, store.json says uint8 {shape})")
    need = int(mm.offset) + int(np.prod(shape))
    if images.stat().st_size < need:
        raise _refuse(folder, f"truncated (images.npy has {images.stat().st_size} bytes of {need})")
    try:
        if file_sha256(folder / "index.npz") != meta.get("index_sha256"):
            raise _refuse(folder, "corrupt (index.npz does not match its checksum)")
        n_index = {k: len(v) for k, v in _read_index(folder).items()}
    except StoreError:
        raise
    except (OSError, ValueError, zlib.error) as e:
        raise _refuse(folder, f"corrupt (index.npz: {type(e).__name__}: {e})") from None
    crcs = _read_log(folder / "chunks.log")
    n, rows = shape[0], int(meta["chunk_rows"])
    n_chunks = -(-n // rows)
    if len(crcs) != n_chunks:
        raise _refuse(folder, f"corrupt (chunks.log lists {len(crcs)} of {n_chunks} chunks)")
    for c in sorted({int(c) for c in np.linspace(0, n_chunks - 1, max(2, check_chunks))} if n_chunks else ()):
        if zlib.crc32(memoryview(mm[c * rows : (c + 1) * rows]).cast("B")) != crcs[c]:  # rows: contiguous, no copy
            raise _refuse(
                folder, f"corrupt (rows {c * rows}..{min(n, (c + 1) * rows) - 1} do not match their checksum)"
            )
    del mm
    if set(n_index.values()) != {shape[0]}:
        raise _refuse(folder, f"corrupt (index.npz has {sorted(set(n_index.values()))} rows, images.npy {shape[0]})")
    return ImageStore(folder, meta)


def corrupt_chunks(folder: str | os.PathLike, redo: bool = False) -> list[tuple[int, int]]:
    """Rows ``(first, last)`` of every chunk of a complete store whose bytes do not match their crc32 in
    ``chunks.log`` (or that the log lacks): all of ``images.npy`` read once (``fedpartial-store``; a job checks a
    sample of chunks when it opens a store, and each chunk before it serves its rows). ``redo``: those chunks are
    marked to be decoded again, and the store is unfinished until a build (:func:`ensure_store`) decodes their rows,
    and only theirs. A store that is unfinished or cannot be read as a whole: ``[]`` (:func:`open_store` says why)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "store.json").read_text())
        shape, per = [int(s) for s in meta["shape"]], int(meta["chunk_rows"])
        if not meta.get("complete") or per < 1:
            return []
        mm = np.load(folder / "images.npy", mmap_mode="r")
    except (OSError, ValueError, EOFError, KeyError, TypeError):
        return []
    if list(mm.shape) != shape:
        return []
    n, crcs = shape[0], _read_log(folder / "chunks.log")
    bad = [
        c
        for c in range(-(-n // per))
        if c not in crcs or zlib.crc32(memoryview(mm[c * per : (c + 1) * per]).cast("B")) != crcs[c]
    ]
    del mm
    if redo and bad:
        _append_log(folder / "chunks.log", [f"-{c + 1} 0" for c in bad if c in crcs])
        meta["complete"] = False
        _write_json(folder / "store.json", meta)
    return [(c * per, min(n, (c + 1) * per) - 1) for c in bad]


def _read_index(folder: Path) -> dict[str, np.ndarray]:
    with np.load(folder / "index.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files if k != "paths"}  # paths: ImageStore.paths, on demand


def _progress(total: int, done: int, desc: str, log_fn: Callable[[str], None] | None):
    """A tqdm bar on a terminal, else ``k / N`` lines through ``log_fn`` (every 5 % or 30 s)."""
    if sys.stderr.isatty() and log_fn is None:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=done, desc=desc, unit="img", dynamic_ncols=True)
        return bar.update, bar.close
    state = {"k": done, "last": time.monotonic(), "step": max(1, total // 20), "mark": done}
    say = log_fn or (lambda m: log.info(m))

    def update(k: int) -> None:
        state["k"] += k
        now = time.monotonic()
        if state["k"] - state["mark"] >= state["step"] or now - state["last"] >= 30 or state["k"] == total:
            say(f"{desc}: {state['k']} / {total} images")
            state["mark"], state["last"] = state["k"], now

    return update, lambda: None


def _pool(workers: int):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"

    # workers die with their parent (a killed fedpartial-store leaves none behind)
    return ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method), initializer=pool_worker_init)


_TRIM = None


def release_free_heap() -> None:
    """Give the C allocator's free heap back to the system (glibc ``malloc_trim``; nothing elsewhere). After a
    pass over a split, the freed batch arrays and index reads would otherwise stay in the process as free heap
    (glibc keeps up to twice the largest freed block), a few MB in every simulated site."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def build_store(
    paths: Sequence[str],
    prep: Preprocessing,
    folder: str | os.PathLike,
    labels: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    workers: int | None = None,
    chunk_rows: int = CHUNK_ROWS,
    desc: str = "image store",
    log_fn: Callable[[str], None] | None = None,
    budget_s: float | None = None,
    redo: Sequence[int] = (),
) -> dict:
    """Build (or finish, or refresh) the store of ``paths`` in ``folder``; returns build statistics
    ``{"decoded", "cpu_s" (decoding, every process), "cpu_s_pool" (of it in the pool's processes), "wall_s",
    "workers"}``.

    Resumes a build that stopped (the chunks in ``chunks.log`` are kept); ``redo``: rows decoded again (their
    source file changed). ``budget_s``: when the rest would take longer (estimated from the first chunk), raise
    :class:`StoreError` naming the command to build it beforehand, instead of starting work that a timeout
    would kill. Ctrl-C / SIGTERM: the chunks finished so far are kept, and the same call goes on after them.

    Raises:
        DecodeFailure: rows that could not be decoded (the others are committed; a rerun redoes only those).
    """
    folder, paths = Path(folder), [str(p) for p in paths]
    meta = _open_or_create(folder, paths, prep, labels, mask, chunk_rows, desc, log_fn)
    if len(redo):
        _mark_changed(folder, meta, paths, labels, mask, redo)
    build = _ChunkBuild(folder, meta, paths, prep, desc, log_fn)
    if build.todo:
        build.run(workers, budget_s)
    _finish(folder, meta)
    return build.stats


def _open_or_create(
    folder: Path, paths: list[str], prep: Preprocessing, labels, mask, chunk_rows: int, desc: str, log_fn
) -> dict:
    """The store's ``store.json`` content: read (refused when built for other images or preprocessing), or, for a
    new store, written with its index, an empty (sparse) ``images.npy`` and no chunk done."""
    key, meta_file = store_key(paths, prep), folder / "store.json"
    meta = None
    if meta_file.is_file():
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, json.JSONDecodeError):
            meta = None
        if meta is not None and (
            meta.get("format") != FORMAT or meta.get("version") != VERSION or meta.get("key") != key
        ):
            raise _refuse(folder, "foreign (built for other images or other preprocessing)")
    if meta is not None:
        return meta
    n = len(paths)
    folder.mkdir(parents=True, exist_ok=True)
    channels = manifest_channels(paths, prep, f"{desc}: image kinds", log_fn) if n else 1
    shape = (n, channels, prep.image_size, prep.image_size)
    np.lib.format.open_memmap(folder / "images.npy", mode="w+", dtype=np.uint8, shape=shape).flush()
    (folder / "chunks.log").write_text("")
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "key": key,
        "shape": list(shape),
        "chunk_rows": int(chunk_rows),
        "preprocessing": prep.key(),
        "complete": False,
        "created": time.time(),
    }
    _write_index(folder, meta, paths, labels, mask)
    _write_json(meta_file, meta)
    return meta


def _mark_changed(folder: Path, meta: dict, paths: list[str], labels, mask, rows: Sequence[int]) -> None:
    """The chunks holding ``rows`` (their source files changed) are to be decoded again, and the index records the
    files' new sizes and times."""
    chunk_rows = int(meta["chunk_rows"])
    _append_log(folder / "chunks.log", [f"-{c + 1} 0" for c in sorted({int(r) // chunk_rows for r in rows})])
    meta["complete"] = False
    _write_json(folder / "store.json", meta)
    _write_index(folder, meta, paths, labels, mask)
    _write_json(folder / "store.json", meta)


class _ChunkBuild:
    """Decoding the chunks a store lacks (``todo``, in order) into its ``images.npy``, each finished chunk logged
    with its checksum (``commit``), progress shown; ``stats`` as :func:`build_store` returns them."""

    def __init__(self, folder: Path, meta: dict, paths: list[str], prep: Preprocessing, desc: str, log_fn):
        self.folder, self.paths, self.prep, self.desc, self.log_fn = folder, paths, prep, desc, log_fn
        self.rows, self.channels, n = int(meta["chunk_rows"]), int(meta["shape"][1]), len(paths)
        self.n_chunks = -(-n // self.rows)
        done = _read_log(folder / "chunks.log")
        self.todo = [c for c in range(self.n_chunks) if c not in done]
        self.stats = {"decoded": 0, "cpu_s": 0.0, "cpu_s_pool": 0.0, "wall_s": 0.0, "workers": 0}
        self.failures: list[tuple[int, str]] = []

    def size(self, chunk: int) -> int:
        return min(self.rows, len(self.paths) - chunk * self.rows)

    def args(self, chunk: int) -> tuple:
        rows = self.rows
        return str(self.folder / "images.npy"), chunk, chunk * rows, self.paths[chunk * rows : (chunk + 1) * rows]

    def decode(self, chunk: int):
        return _decode_chunk(*self.args(chunk), self.prep, self.channels)

    def submit(self, pool, chunk: int):
        return pool.submit(_decode_chunk, *self.args(chunk), self.prep, self.channels)

    def commit(self, result) -> None:
        chunk, crc, fails, cpu = result
        k = self.size(chunk)
        self.stats["decoded"] += k
        self.stats["cpu_s"] += cpu
        if crc is not None:
            _append_log(self.folder / "chunks.log", [f"{chunk} {crc}"])
        self.failures.extend(fails)
        self.update(k)

    def run(self, workers: int | None, budget_s: float | None) -> None:
        """Decode every chunk of ``todo`` (the first in this process, the rest in a pool of ``workers``); Ctrl-C /
        SIGTERM keeps the finished chunks and says so.

        Raises:
            DecodeFailure: rows that could not be decoded (the other rows are committed).
            StoreError: the rest would take longer than ``budget_s``.
        """
        t0, n = time.perf_counter(), len(self.paths)
        workers = max(1, min(int(workers or default_workers()), len(self.todo)))
        self.stats["workers"] = workers
        self.update, close = _progress(n, n - sum(self.size(c) for c in self.todo), self.desc, self.log_fn)
        try:
            first, queue = self.todo[0], list(self.todo[1:])  # the first in this process: its time tells the rest's
            parallel = workers > 1 and len(queue) > 1
            with _pool(workers) if parallel else contextlib.nullcontext() as pool:
                # the pool's processes start, and decode the next chunks, while this process decodes the first one
                pending = (
                    {self.submit(pool, queue.pop(0)) for _ in range(min(2 * workers, len(queue)))}
                    if parallel
                    else set()
                )
                t_first = time.perf_counter()
                result = self.decode(first)
                self.commit(result)
                # seconds per image: CPU time when the pool shares the cores with it (its wall time would count theirs)
                per_image = (result[3] if parallel else time.perf_counter() - t_first) / max(1, self.size(first))
                self._check_budget(per_image, workers, budget_s, pool, pending)
                if parallel:
                    self._decode_in_pool(pool, pending, queue)
                else:
                    for c in queue:
                        self.commit(self.decode(c))
        except KeyboardInterrupt:
            kept = len(_read_log(self.folder / "chunks.log"))
            (self.log_fn or (lambda m: print(m, file=sys.stderr, flush=True)))(
                f"{self.desc}: stopped; {kept} of {self.n_chunks} chunks are kept in {self.folder} (the same command "
                "goes on after them)"
            )
            raise
        finally:
            close()
            self.stats["wall_s"] = time.perf_counter() - t0
        if self.failures:
            raise DecodeFailure(self.failures)

    def _check_budget(self, per_image: float, workers: int, budget_s: float | None, pool, pending) -> None:
        """Raise :class:`StoreError` naming the command to build the store beforehand when the chunks left would take
        longer than ``budget_s`` (those the pool finished meanwhile are kept)."""
        rest = sum(self.size(c) for c in self.todo[1:])
        if budget_s is None or not rest or per_image * rest / workers <= budget_s:
            return
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            self._commit_finished(pending)
        prep = self.prep
        raise StoreError(
            f"image store {self.folder}: {rest} images left to decode, about {per_image * rest / workers / 60:.0f} "
            f"min on {workers} process(es), more than the {budget_s / 60:.0f} min this step may take; build it "
            f"before the job: fedpartial-store PREPARED_FOLDER (or --site-config FILE --dataset NAME) "
            f"--image-size {prep.image_size} --channels {prep.channels} (docs/datasets.md, 'Image store')"
        )

    def _decode_in_pool(self, pool, pending: set, queue: list[int]) -> None:
        """The pool's chunks committed as they finish, the queue fed to it; Ctrl-C / SIGTERM: the running chunks
        finish and are kept."""
        from concurrent.futures import FIRST_COMPLETED, wait

        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    self.commit(f.result())
                    self.stats["cpu_s_pool"] += f.result()[3]
                    if queue:
                        pending.add(self.submit(pool, queue.pop(0)))
        except KeyboardInterrupt:
            pool.shutdown(wait=True, cancel_futures=True)
            self._commit_finished(pending)
            raise

    def _commit_finished(self, futures) -> None:
        for f in futures:  # chunks the pool finished are kept (a later build resumes after them)
            if f.done() and not f.cancelled() and f.exception() is None:
                self.commit(f.result())


def _write_index(folder: Path, meta: dict, paths: list[str], labels, mask) -> None:
    size, mtime, ctime = _stamps(paths)
    n = len(paths)
    labels = np.zeros((n, 0), np.float32) if labels is None else np.asarray(labels, np.float32)
    mask = np.zeros(labels.shape, bool) if mask is None else np.asarray(mask, bool)
    tmp = folder / f"index.tmp{os.getpid()}.npz"
    np.savez(
        tmp,
        paths=np.asarray(paths, dtype=str),
        size=size,
        mtime_ns=mtime,
        ctime_ns=ctime,
        labels=labels,
        mask=mask,
        position=np.arange(n, dtype=np.int64),
    )
    os.replace(tmp, folder / "index.npz")
    meta["index_sha256"] = file_sha256(folder / "index.npz")


def _finish(folder: Path, meta: dict) -> None:
    if not meta.get("complete"):
        meta["complete"] = True
        meta["finished"] = time.time()
        _write_json(folder / "store.json", meta)


def relabel(
    store: ImageStore, labels: np.ndarray, mask: np.ndarray, index: dict[str, np.ndarray] | None = None
) -> bool:
    """Record the manifest's label vectors in the store's index when they differ (a corrected label: nothing is
    decoded again). Returns whether the index changed. ``index``: ``store.index`` when the caller has read it."""
    labels, mask = np.asarray(labels, np.float32), np.asarray(mask, bool)
    index = store.index if index is None else index
    if (
        index["labels"].shape == labels.shape
        and np.array_equal(index["labels"], labels)
        and np.array_equal(index["mask"], mask)
    ):
        return False
    tmp = store.folder / f"index.tmp{os.getpid()}.npz"
    np.savez(tmp, **{**index, "paths": store.paths, "labels": labels, "mask": mask})
    os.replace(tmp, store.folder / "index.npz")
    store.meta["index_sha256"] = file_sha256(store.folder / "index.npz")
    _write_json(store.folder / "store.json", store.meta)
    return True


def ensure_store(
    paths: Sequence[str],
    prep: Preprocessing,
    root: str | os.PathLike | None = None,
    name: str = "",
    labels: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    workers: int | None = None,
    log_fn: Callable[[str], None] | None = None,
    budget_s: float | None = None,
) -> ImageStore:
    """The complete, current store of ``paths``: opened when it exists (no image decoded: the index's sizes and
    mtimes are compared with the files), its changed rows decoded again (named), built when absent or unfinished
    (under a file lock: simulated sites opening the same validation store wait for the first).

    Raises:
        StoreError: a foreign / truncated / corrupt store, or a build that does not fit ``budget_s``.
        DecodeFailure: images that cannot be decoded (rows).
    """
    from filelock import FileLock

    paths = [str(p) for p in paths]
    folder = store_folder(paths, prep, root, name)
    key = store_key(paths, prep)
    say = log_fn or (lambda m: log.info(m))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        meta_file = folder / "store.json"
        complete = False
        if meta_file.is_file():
            try:
                complete = bool(json.loads(meta_file.read_text()).get("complete"))
            except (OSError, json.JSONDecodeError):
                raise _refuse(folder, "not a readable store (store.json)") from None
        if complete:
            store = open_store(folder, key)
            index = store.index  # read once for both checks
            stale = store.stale_rows(index)
            if not len(stale):
                if labels is not None:
                    relabel(store, labels, mask if mask is not None else np.ones_like(labels, bool), index)
                return store
            names = [Path(paths[i]).name for i in stale[:5]]
            say(
                f"image store {folder.name}: {len(stale)} source file(s) changed since it was built "
                f"({', '.join(names)}{', ...' if len(stale) > 5 else ''}): decoding them again"
            )
            build_store(
                paths,
                prep,
                folder,
                labels,
                mask,
                workers,
                desc=name or "image store",
                log_fn=log_fn,
                budget_s=budget_s,
                redo=stale,
            )
        else:
            if meta_file.is_file():
                say(f"image store {folder.name}: resuming an unfinished build")
            build_store(
                paths, prep, folder, labels, mask, workers, desc=name or "image store", log_fn=log_fn, budget_s=budget_s
            )
        store = open_store(folder, key)
        if labels is not None:
            relabel(store, labels, mask if mask is not None else np.ones_like(labels, bool))
        return store
