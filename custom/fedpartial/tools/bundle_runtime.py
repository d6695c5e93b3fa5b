"""What a MONAI bundle written by ``fedpartial-export`` runs besides MONAI itself: the image decoder, the
folder listing and the handler that writes ``predictions.csv`` (MONAI's ``SupervisedEvaluator`` runs the model).
``fedpartial-export`` writes the bundle's ``scripts/image_io.py`` as training's own decoding module
(``fedpartial/data/decode.py``: the image store's ``decode_resized`` and the DICOM / CT-window helpers it calls,
copied whole) followed by this file without the decoder block below, so the bundle runs where this package is not
installed: numpy, Pillow, pydicom, torch, MONAI and pytorch-ignite only.

Why a decoder of our own rather than MONAI's ``LoadImaged`` + ``Resized``: the sites trained on their image
stores, which hold every image decoded once (a JPEG at the smallest DCT scale that covers the size), resized by
Pillow and rounded to uint8 (16-bit scaled, DICOM through the CT windows); a float resize after MONAI's reader
gives other values. The bundle decodes each file exactly so (the same bytes as a store row), then divides by 255
and repeats a grayscale image to the model's channels, as training does on its device; the normalisation and the
activation are MONAI's transforms in ``configs/inference.json``. ``ClassificationSaver`` writes MONAI's own layout
(``filename,0,1,...``), not ``fedpartial-predict``'s columns with the decisions, hence :class:`PredictionWriter`.
"""

from __future__ import annotations

import csv
import os
import sys
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

# --- decoder (replaced at export) ---
from fedpartial.data.decode import Preprocessing, decode_resized, native_channels, stored_channels  # noqa: E402

# --- end decoder ---

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".dicom")  # what prepare reads too
ERROR_KEY = "error"  # a dataset item's decoding error ("" when it decoded)
PREDICTIONS_FILE = "predictions.csv"


def list_images(folder: str | os.PathLike) -> list[str]:
    """Every image file (:data:`IMAGE_SUFFIXES`) under ``folder`` (recursive), sorted by path, as
    ``folder``-joined strings. ``FileNotFoundError`` when the folder is missing or holds none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    paths = sorted(str(p) for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise FileNotFoundError(f"no image ({', '.join(IMAGE_SUFFIXES)}) under {folder}")
    return paths


def bundle_images(folder: str | os.PathLike) -> list[str]:
    """:func:`list_images` for the bundle's ``inference.json``: a folder without images ends the run with one
    line (exit status 2) instead of MONAI's traceback of the config expression."""
    try:
        return list_images(folder)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def read_or_leave_out(path: str, prep: Preprocessing) -> tuple[np.ndarray | None, str]:
    """``(decode_resized(path) in the file's own stored channels, "")``, or ``(None, why)`` for a file that cannot be
    read (``why`` without the path), with a line ``left out PATH: cannot read it (why)`` on stderr: the bundle and
    ``fedpartial-predict`` leave such an image out alike."""
    try:
        return decode_resized(path, prep, stored_channels(native_channels(path, prep), prep)), ""
    except Exception as e:  # noqa: BLE001 - decoders raise many types: the image is left out, named
        why = str(e).replace(path, "").strip(" :") or type(e).__name__
        print(f"left out {path}: cannot read it ({why})", file=sys.stderr, flush=True)
        return None, why


def _map_transform():
    from monai.transforms import MapTransform

    return MapTransform


class LoadImageAnyd(_map_transform()):
    """Path -> ``(channels, S, S)`` float32 tensor in [0, 1], the values training read from its image store (see
    the module docstring): :func:`decode_resized` in the file's own stored channels, / 255, a grayscale image
    repeated to ``channels``.

    Args:
        keys: keys whose values are file paths.
        channels: the model's input channels.
        image_size: the side S the images are resized to.
        ct_windows: DICOM only: ``[[center, width], ...]`` in HU, one channel each; None = min-max scaled HU.
        resize_mode: area (box filter) / bilinear / bicubic / nearest, as the job's ``dataset.resize_mode``.
    """

    def __init__(
        self,
        keys,
        channels: int,
        image_size: int,
        ct_windows: Sequence[Sequence[float]] | None = None,
        resize_mode: str = "area",
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        windows = tuple(tuple(map(float, w)) for w in ct_windows) if ct_windows else None
        self.prep = Preprocessing(int(image_size), int(channels), windows, str(resize_mode))

    def __call__(self, data: Mapping[Hashable, object]) -> dict:
        d = dict(data)
        d.setdefault(ERROR_KEY, "")
        for key in self.key_iterator(d):
            x, why = read_or_leave_out(str(d[key]), self.prep)
            if x is None:
                d[ERROR_KEY] = why
                x = np.zeros((self.prep.channels, self.prep.image_size, self.prep.image_size), np.uint8)
            t = torch.from_numpy(np.array(x, np.float32)).div_(255.0)  # a copy: PIL arrays are read-only
            if t.shape[0] != self.prep.channels:
                t = t.expand(self.prep.channels, -1, -1).contiguous()
            d[key] = t
        return d


class Progress:
    """``for batch in Progress(loader, "predict")``: a tqdm bar on a terminal (stderr), else ``label k / N`` lines
    (about ten, and the last)."""

    def __init__(self, iterable, label: str, total: int | None = None, stream=None) -> None:
        self.iterable, self.label = iterable, label
        self.total = len(iterable) if total is None else int(total)
        self.stream = stream if stream is not None else sys.stderr

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        if getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                yield from tqdm(self.iterable, total=self.total, desc=self.label, unit="batch", file=self.stream)
                return
        step = max(1, self.total // 10)
        for k, item in enumerate(self.iterable, 1):
            yield item
            if k % step == 0 or k == self.total:
                print(f"{self.label} {k} / {self.total}", file=self.stream, flush=True)


class PredictionWriter:
    """An ignite handler of MONAI's ``SupervisedEvaluator``: collects each item's path (``path_key`` of the
    decollated batch) and probabilities (``pred_key`` of the decollated output, after the evaluator's
    postprocessing), prints ``predict: batch k / N`` lines, and writes ``output_dir/predictions.csv``
    (:func:`write_predictions`) when the run completes."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        classes: Sequence[str],
        task: str,
        thresholds: Sequence[float] | None = None,
        path_key: str = "path",
        pred_key: str = "pred",
    ) -> None:
        self.output_dir, self.classes, self.task = output_dir, list(classes), task
        self.thresholds, self.path_key, self.pred_key = thresholds, path_key, pred_key
        self.paths: list[str] = []
        self.probs: list[np.ndarray] = []
        self.left_out: list[tuple[str, str]] = []  # (path, why): images that could not be read

    def attach(self, engine) -> None:
        from ignite.engine import Events

        engine.add_event_handler(Events.STARTED, self._reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._collect)
        engine.add_event_handler(Events.COMPLETED, self._write)

    def _reset(self, engine) -> None:
        self.paths, self.probs, self.left_out = [], [], []

    def _collect(self, engine) -> None:
        batch, output = engine.state.batch, engine.state.output
        batch = batch if isinstance(batch, list) else [batch]
        output = output if isinstance(output, list) else [output]
        for item, out in zip(batch, output):
            if item.get(ERROR_KEY):
                self.left_out.append((str(item[self.path_key]), str(item[ERROR_KEY])))
                continue
            self.paths.append(str(item[self.path_key]))
            self.probs.append(torch.as_tensor(out[self.pred_key]).detach().float().cpu().numpy().reshape(-1))
        n, k = engine.state.epoch_length, engine.state.iteration
        if n and (k % max(1, n // 10) == 0 or k == n):
            print(f"predict: batch {k} / {n}", file=sys.stderr, flush=True)

    def _write(self, engine) -> None:
        probs = np.stack(self.probs) if self.probs else np.zeros((0, len(self.classes)), np.float32)
        write_predictions(self.paths, probs, self.classes, self.task, self.thresholds, self.output_dir, self.left_out)
        if self.left_out and not self.paths:
            print(f"error: none of the {len(self.left_out)} images could be read", file=sys.stderr, flush=True)
            raise SystemExit(2)


def decisions(
    probs: np.ndarray, classes: Sequence[str], task: str, thresholds: Sequence[float] | None
) -> tuple[list[str], list[list]]:
    """The decision columns: multi-label ``pred_<class>`` = 1 where ``prob >= threshold`` of that class;
    single-label ``prediction`` = the class of the highest probability. Returns ``(columns, rows)``."""
    if task == "multilabel":
        t = np.asarray(thresholds if thresholds is not None else [0.5] * len(classes), dtype=np.float64)
        return [f"pred_{c}" for c in classes], (probs >= t[None, :]).astype(int).tolist()
    return ["prediction"], [[classes[int(i)]] for i in np.argmax(probs, axis=1)]


def write_predictions(
    paths: Sequence[str],
    probs: np.ndarray,
    classes: Sequence[str],
    task: str,
    thresholds: Sequence[float] | None,
    output_dir: str | os.PathLike,
    left_out: Sequence[tuple[str, str]] = (),
) -> str:
    """``output_dir/predictions.csv``: ``image``, ``prob_<class>`` per class (6 decimals), then the decisions
    (:func:`decisions`); images that could not be read (``left_out``: ``(path, why)``) follow with empty cells
    and the reason in a last column ``error`` (present only then). Returns the file's path."""
    probs = np.asarray(probs)
    if len(paths) != len(probs):
        raise ValueError(f"{len(paths)} images but {len(probs)} predictions")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cols, dec = decisions(probs, classes, task, thresholds)
    path = out / PREDICTIONS_FILE
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", *(f"prob_{c}" for c in classes), *cols, *([ERROR_KEY] if left_out else [])])
        for p, row, d in zip(paths, probs, dec):
            w.writerow([p, *(f"{float(v):.6f}" for v in row), *d, *([""] if left_out else [])])
        for p, why in left_out:
            w.writerow([p, *[""] * (len(classes) + len(cols)), why])
    skipped = f"; {len(left_out)} image(s) left out (unreadable: the 'error' column says why)" if left_out else ""
    print(f"wrote {len(paths)} predictions to {path}{skipped}", file=sys.stderr)
    return str(path)
