"""A synthetic head-CT phantom in the RSNA ICH layout (real DICOM files), for demos, tests and CI.

:func:`generate_ich_phantom` writes ``stage_2_train.csv`` (RSNA format, ``any`` included), one
``stage_2_train/ID_<hex>.dcm`` per slice (int16, RescaleSlope 1, RescaleIntercept -1024, PatientID set) and a
``phantom.json`` marker, so that :func:`fedpartial.data.catalog.ich.loader.load_rsna_ich` reads it exactly as it
reads the real data. Everything is a deterministic function of the arguments.

Each slice: air (-1000 HU), scalp, an elliptical skull (cortical tables ~1200 HU, diploe ~750 HU), brain
(white ~30 HU, cortical ribbon ~38 HU, smooth texture), CSF in the sulci, along the brain surface and in two
butterfly-shaped lateral ventricles; head size / shape / rotation / position vary by patient, level and noise by
slice. Hemorrhages (blood +48..+80 HU, size and contrast vary, a quarter of them small and faint):

- epidural: biconvex lens against the inner skull table;
- subdural: thin crescent along the inner table;
- intraparenchymal: compact irregular blob in the parenchyma (with a faint oedema rim);
- intraventricular: blood (mixed with CSF: +20..+80 HU) layering in the dependent (posterior) part of one or
  both ventricles;
- subarachnoid: blood in the sulci and the surface CSF of a sector of the brain.

The image is then blurred (partial volume) and gets acquisition noise. Label prevalences are exact (largest
remainder) and follow :data:`LABEL_COMBOS`; positive slices cluster in patients, who share head geometry and
bleed location across their slices.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ...sources.base import SourceTable
from . import CLASSES as ICH_CLASSES
from .loader import load_rsna_ich

logger = logging.getLogger(__name__)

PHANTOM_VERSION = 1
_CHUNK = 64  # slices rendered at once (part of the random stream: fixed)

# (classes, fraction of all slices). Marginals: epidural 3.5%, intraparenchymal 12%, intraventricular 9%,
# subarachnoid 12%, subdural 15%; 6.5% of slices carry two or three subtypes; 55.5% have no bleed.
LABEL_COMBOS: list[tuple[tuple[str, ...], float]] = [
    ((), 0.555),
    (("epidural",), 0.030),
    (("epidural", "subdural"), 0.005),
    (("subdural",), 0.125),
    (("subarachnoid", "subdural"), 0.020),
    (("subarachnoid",), 0.090),
    (("intraparenchymal",), 0.080),
    (("intraparenchymal", "intraventricular"), 0.030),
    (("intraparenchymal", "subarachnoid"), 0.005),
    (("intraparenchymal", "intraventricular", "subarachnoid"), 0.005),
    (("intraventricular",), 0.055),
]

# uniform ranges of the lesion parameters (tuned with benchmarks/phantom_learnability.py)
BLOOD_HU = (48.0, 80.0)  # hemorrhage density
FAINT_FRACTION = 0.25  # share of lesions drawn with the lower third of BLOOD_HU and smaller sizes
NOISE_HU = (3.0, 7.0)  # white acquisition noise (std)
BLUR_PX = (0.5, 0.9)  # partial-volume Gaussian blur (sigma, in pixels at 128 px)


# ----------------------------------------------------------------------------------------------- parameters
def _exact_counts(n: int, fractions: np.ndarray) -> np.ndarray:
    """Largest-remainder rounding of ``n * fractions`` (sums to n)."""
    raw = n * fractions / fractions.sum()
    counts = np.floor(raw).astype(int)
    counts[np.argsort(-(raw - counts), kind="stable")[: n - counts.sum()]] += 1
    return counts


def _unique_hex(rng: np.random.Generator, n: int, digits: int, taken: set[str] | None = None) -> list[str]:
    """``n`` random hex strings of ``digits`` digits, distinct from each other and from ``taken``."""
    taken = set() if taken is None else taken
    out: list[str] = []
    while len(out) < n:
        for v in rng.integers(0, 16**digits, size=n - len(out), dtype=np.int64):
            s = f"{int(v):0{digits}x}"
            if s not in taken:
                taken.add(s)
                out.append(s)
    return out


def _sample_params(n_images: int, seed: int, n_patients: int) -> dict[str, np.ndarray]:
    """Every random choice that is not pixel noise: labels ``(N, 5)``, ids and per-slice geometry ``(N,)``."""
    rng = np.random.default_rng(np.random.SeedSequence([PHANTOM_VERSION, seed, n_images, n_patients]))
    n, p = n_images, n_patients
    combo_mat = np.array([[c in combo for c in ICH_CLASSES] for combo, _ in LABEL_COMBOS], dtype=np.int8)
    counts = _exact_counts(n, np.array([f for _, f in LABEL_COMBOS]))
    labels = combo_mat[np.repeat(np.arange(len(LABEL_COMBOS)), counts)]
    rng.shuffle(labels, axis=0)
    # positive slices cluster in patients: sort by (bleed + noise), cut into patients of random length
    labels = labels[np.argsort(labels.any(1) + rng.normal(0, 0.7, n), kind="stable")]
    pat = np.repeat(np.arange(p), 1 + rng.multinomial(n - p, np.full(p, 1.0 / p)))

    def per_patient(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, p)[pat]

    def per_slice(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, n)

    level = per_slice(0.0, 1.0)  # slice level: head and ventricles are largest mid-way
    mid = 1.0 - np.abs(2 * level - 1)
    a = per_patient(0.60, 0.72)
    prm: dict[str, np.ndarray] = {
        "labels": labels,
        "patient": pat,
        "cx": per_patient(-0.06, 0.06) + per_slice(-0.01, 0.01),
        "cy": per_patient(-0.05, 0.05) + per_slice(-0.01, 0.01),
        "theta": per_patient(-0.3, 0.3) + per_slice(-0.03, 0.03),
        "a": a * (0.88 + 0.12 * mid),
        "b": np.minimum(a * per_patient(1.12, 1.30), 0.88) * (0.88 + 0.12 * mid),
        "shape": rng.uniform(0, 0.035, (p, 2))[pat],
        "shape_phase": rng.uniform(-np.pi, np.pi, (p, 2))[pat],
        "t": per_patient(0.040, 0.065),
        "scalp": per_patient(0.02, 0.04),
        "sulc_k": rng.integers(18, 27, p)[pat].astype(float),
        "sulc_psi": per_patient(-np.pi, np.pi),
        "sulc_chi": per_patient(-np.pi, np.pi),
        "sulc_depth": per_patient(0.74, 0.84),
        "sulc_w": per_slice(0.45, 0.8),  # sulcus width in pixels at 128 px
        "grey": per_patient(4.0, 10.0),
        "white": per_slice(28.0, 34.0),
        "tex_amp": per_slice(1.0, 3.0),
        "v_sep": per_patient(0.09, 0.12),
        "v_beta": per_patient(0.05, 0.25),
        "v_bend": per_patient(0.6, 1.2),
        "v_scale": 0.7 + 0.5 * mid * per_slice(0.7, 1.0),  # ventricle size: by level, not by label
        "noise": per_slice(*NOISE_HU),
        "blur": per_slice(*BLUR_PX),
    }
    side = per_patient(-np.pi, np.pi)  # where this patient's extra-axial bleeds sit
    faint = rng.uniform(size=(n, 5)) < FAINT_FRACTION
    lo, hi = BLOOD_HU
    blood = np.where(faint, rng.uniform(lo, lo + (hi - lo) / 3, (n, 5)), rng.uniform(lo + (hi - lo) / 4, hi, (n, 5)))
    blood[:, 2] = 5 + (blood[:, 2] - 5) * rng.uniform(0.35, 1.0, n)  # intraventricular blood mixes with CSF
    shrink = np.where(faint, rng.uniform(0.45, 0.8, (n, 5)), 1.0)
    prm.update(
        {
            "blood": blood,
            "shrink": shrink,
            "edh_phi": side + per_slice(-0.15, 0.15),
            "edh_w": per_slice(0.25, 0.55),
            "edh_d": per_slice(0.10, 0.22),
            "sdh_phi": side + np.pi * rng.integers(0, 2, p)[pat] + per_slice(-0.3, 0.3),
            "sdh_w": per_slice(0.7, 1.6),
            "sdh_d": per_slice(0.04, 0.09),
            "iph_alpha": per_patient(-np.pi, np.pi) + per_slice(-0.2, 0.2),
            "iph_rho": per_patient(0.38, 0.70),
            "iph_r": per_slice(0.022, 0.08),
            "iph_edema": per_slice(0.0, 4.0),
            "iph_harm": rng.uniform(0, 0.22, (n, 3)),
            "iph_phase": rng.uniform(-np.pi, np.pi, (n, 3)),
            "ivh_side": rng.integers(0, 3, n).astype(float),
            "ivh_fill": per_slice(0.15, 0.65),
            "sah_phi": side + per_slice(-0.5, 0.5),
            "sah_w": per_slice(0.5, 1.4),
        }
    )
    perm = rng.permutation(n)  # CSV order unrelated to patients / labels
    prm = {k: v[perm] for k, v in prm.items()}
    taken: set[str] = set()
    prm["image_id"] = np.array([f"ID_{h}" for h in _unique_hex(rng, n, 9, taken)])
    pids = np.array([f"ID_{h}" for h in _unique_hex(rng, p, 10, taken)])
    prm["patient_id"] = pids[prm["patient"]]
    return prm


# ------------------------------------------------------------------------------------------------- rendering
def _col(x: np.ndarray) -> np.ndarray:
    """``(B,)`` -> ``(B, 1, 1)`` float32 for broadcasting against ``(B, H, W)``."""
    return np.asarray(x, dtype=np.float32)[:, None, None]


def _flag(x: np.ndarray) -> np.ndarray:
    """``(B,)`` bool -> ``(B, 1, 1)`` bool."""
    return np.asarray(x, dtype=bool)[:, None, None]


def _wrap(angle: np.ndarray) -> np.ndarray:
    """Angles -> [-pi, pi]."""
    return angle - np.float32(2 * np.pi) * np.round(angle * np.float32(0.5 / np.pi))


def _smooth_noise(rng: np.random.Generator, b: int, size: int, cells: int = 12) -> np.ndarray:
    """``(B, size, size)`` smooth noise (unit-ish std): a ``cells x cells`` grid bilinearly upsampled."""
    g = rng.standard_normal((b, cells + 1, cells + 1)).astype(np.float32)
    pos = (np.arange(size, dtype=np.float32) + 0.5) / size * cells
    i0 = np.minimum(pos.astype(int), cells - 1)
    f = (pos - i0).astype(np.float32)
    rows = g[:, i0] * (1 - f)[None, :, None] + g[:, i0 + 1] * f[None, :, None]
    return rows[:, :, i0] * (1 - f) + rows[:, :, i0 + 1] * f


def _blur(x: np.ndarray, sigma_px: np.ndarray) -> np.ndarray:
    """Separable Gaussian blur of ``(B, H, W)`` with a per-image sigma ``(B,)`` (pixels, radius 2)."""
    offs = np.arange(-2, 3, dtype=np.float32)
    w = np.exp(-0.5 * (offs[None, :] / np.maximum(sigma_px, 1e-3)[:, None].astype(np.float32)) ** 2)
    w = (w / w.sum(1, keepdims=True)).astype(np.float32)
    for axis in (1, 2):
        pad = [(0, 0)] * 3
        pad[axis] = (2, 2)
        xp = np.pad(x, pad, mode="edge")
        n = x.shape[axis]
        x = sum(w[:, k, None, None] * np.take(xp, np.arange(k, k + n), axis=axis) for k in range(5))
    return x.astype(np.float32)


def _render(prm: dict[str, np.ndarray], size: int, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """Render the slices of ``prm`` (a chunk, B slices): HU ``(B, size, size)`` float32 and bool masks
    ``(B, size, size)`` for the anatomy (``skull``, ``brain``, ``ventricles``) and each class."""
    b = len(prm["a"])
    px = np.float32(size / 128.0)  # pixel-size-dependent widths are given at 128 px
    grid = (np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1
    dx, dy = grid[None, None, :] - _col(prm["cx"]), grid[None, :, None] - _col(prm["cy"])
    ct, st = np.cos(_col(prm["theta"])), np.sin(_col(prm["theta"]))
    u, v = ct * dx + st * dy, -st * dx + ct * dy  # head frame; -v is anterior (top of the image)
    a, bb, t = _col(prm["a"]), _col(prm["b"]), _col(prm["t"])
    ai, bi = a - t, bb - t
    phi = np.arctan2(v / bi, u / ai)  # angle in the head frame
    shape = 1 + sum(
        _col(prm["shape"][:, j]) * np.cos((j + 2) * phi + _col(prm["shape_phase"][:, j])) for j in range(2)
    )  # egg-shaped heads: 2nd and 3rd angular harmonics
    r_out = np.sqrt((u / a) ** 2 + (v / bb) ** 2) / shape
    ri = np.sqrt((u / ai) ** 2 + (v / bi) ** 2) / shape  # 1 at the inner table
    r_px = np.float32(size / 2) * (ai + bi) / 2  # intracranial radius in pixels

    brain = ri < 1
    skull = (r_out < 1) & ~brain
    scalp = (r_out >= 1) & (r_out < 1 + _col(prm["scalp"]))
    hu = np.full((b, size, size), -1000.0, dtype=np.float32)
    hu = np.where(scalp, np.float32(35.0), hu)
    depth = (ri - 1) / ((a / ai) - 1)  # 0 at the inner table, 1 at the outer table
    hu = np.where(skull, 1250 - 550 * np.exp(-(((depth - 0.5) / 0.22) ** 2)), hu)
    tex = _smooth_noise(rng, b, size) * _col(prm["tex_amp"])
    parenchyma = _col(prm["white"]) + _col(prm["grey"]) * np.clip((ri - 0.82) / 0.06, 0, 1) + tex
    # CSF: surface rim, sulci (a periodic pattern in angle, warped) and two lateral ventricles
    rim = brain & (ri > 1 - 1.0 / r_px)
    n_sulci = _col(prm["sulc_k"])
    arc = np.abs(_wrap(n_sulci * phi + _col(prm["sulc_psi"]) + 0.8 * np.sin(3 * phi + _col(prm["sulc_chi"])))) / n_sulci
    sulci = (
        brain
        & (arc * ri * r_px < _col(prm["sulc_w"]) * px)
        & (ri > _col(prm["sulc_depth"]) + 0.05 * np.sin(5 * phi + _col(prm["sulc_chi"])))
    )
    vs, sep, beta = _col(prm["v_scale"]), _col(prm["v_sep"]) * a / 0.66, _col(prm["v_beta"])
    lobes = []
    for sign in (-1.0, 1.0):  # butterfly: two bent lobes diverging anteriorly
        du, dv = (u - sign * sep * vs) / vs, (v + 0.04 * bb) / vs
        q = np.cos(beta) * dv - sign * np.sin(beta) * du  # along the lobe, + posterior
        w = np.cos(beta) * du + sign * np.sin(beta) * dv  # across
        w = w - sign * _col(prm["v_bend"]) * (q**2 - 0.015)
        half_len = 0.20 * bb / 0.8
        lobes.append((((q / half_len) ** 2 + (w / 0.055) ** 2 < 1) & brain, q / half_len))
    ventricles = lobes[0][0] | lobes[1][0]
    hu = np.where(brain, parenchyma, hu)
    hu = np.where(rim | sulci, np.float32(8.0), hu)
    hu = np.where(ventricles, np.float32(5.0), hu)

    fields = {
        "u": u,
        "v": v,
        "ri": ri,
        "phi": phi,
        "brain": brain,
        "ventricles": ventricles,
        "csf": rim | sulci,
        "lobe0": lobes[0][0],
        "lobe1": lobes[1][0],
        "q0": lobes[0][1],
        "q1": lobes[1][1],
    }
    masks = {"skull": skull, "brain": brain, "ventricles": ventricles}
    for j, c in enumerate(ICH_CLASSES):  # each lesion is drawn on the slices that carry it only
        idx = np.flatnonzero(prm["labels"][:, j])
        masks[c] = np.zeros_like(brain)
        if len(idx):
            f, p = {k: x[idx] for k, x in fields.items()}, {k: x[idx] for k, x in prm.items()}
            masks[c][idx], oedema = _LESIONS[c](f, p, p["shrink"][:, j])
            if oedema is not None:
                hu[idx] = np.where(oedema, hu[idx] - _col(p["iph_edema"]), hu[idx])
    for j, c in enumerate(ICH_CLASSES):
        hu = np.where(masks[c], _col(prm["blood"][:, j]), hu)
    hu = _blur(hu, prm["blur"] * px)
    hu += rng.standard_normal(hu.shape, dtype=np.float32) * _col(prm["noise"])
    return hu, masks


# ------------------------------------------------------------------------------------------------- lesions
# Each takes the pixel fields ``f`` (``(B, H, W)``: head-frame u, v; ri = 1 at the inner table; phi; bool
# brain / ventricles / csf / lobe0 / lobe1; q0 / q1 = position along each ventricle lobe, +1 posterior), the
# slice parameters ``p`` (``(B, ...)``) and a size factor ``shrink`` ``(B,)``; returns the blood mask
# ``(B, H, W)`` and an optional oedema mask.
def _epidural(f: dict, p: dict, shrink: np.ndarray):
    """Biconvex lens against the inner table."""
    x = _wrap(f["phi"] - _col(p["edh_phi"])) / _col(p["edh_w"] * shrink)
    prof = np.sqrt(np.clip(1 - x**2, 0, 1))
    return f["brain"] & (prof > 0) & (f["ri"] > 1 - _col(p["edh_d"] * shrink) * prof), None


def _subdural(f: dict, p: dict, shrink: np.ndarray):
    """Thin crescent along the inner table with tapering ends."""
    x = _wrap(f["phi"] - _col(p["sdh_phi"])) / _col(p["sdh_w"] * shrink)
    prof = np.clip(1 - x**2, 0, 1) ** 0.35
    return f["brain"] & (prof > 0) & (f["ri"] > 1 - _col(p["sdh_d"] * shrink) * prof), None


def _intraparenchymal(f: dict, p: dict, shrink: np.ndarray):
    """Irregular blob (radius with 2nd-4th angular harmonics) in the parenchyma, with an oedema rim."""
    al, rho = p["iph_alpha"], p["iph_rho"]
    ex = f["u"] - _col(rho * np.cos(al) * (p["a"] - p["t"]))
    ey = f["v"] - _col(rho * np.sin(al) * (p["b"] - p["t"]))
    ang, dist = np.arctan2(ey, ex), np.sqrt(ex**2 + ey**2)
    radius = _col(p["iph_r"] * shrink) * (
        1 + sum(_col(p["iph_harm"][:, j]) * np.cos((j + 2) * ang + _col(p["iph_phase"][:, j])) for j in range(3))
    )
    inside = f["brain"] & ~f["ventricles"] & (f["ri"] < 0.93)
    blood = inside & (dist < radius)
    return blood, inside & (dist < 1.7 * radius) & ~blood


def _intraventricular(f: dict, p: dict, shrink: np.ndarray):
    """Blood layering in the posterior (dependent) part of one lobe or both."""
    fill = 1 - 2 * _col(p["ivh_fill"] * shrink)
    side = p["ivh_side"]
    return (
        (f["lobe0"] & (f["q0"] > fill) & _flag(side != 1)) | (f["lobe1"] & (f["q1"] > fill) & _flag(side != 0))
    ), None


def _subarachnoid(f: dict, p: dict, shrink: np.ndarray):
    """Sulcal and surface CSF of a sector turned to blood."""
    return f["csf"] & (np.abs(_wrap(f["phi"] - _col(p["sah_phi"]))) < _col(p["sah_w"] * shrink)), None


_LESIONS = {
    "epidural": _epidural,
    "intraparenchymal": _intraparenchymal,
    "intraventricular": _intraventricular,
    "subarachnoid": _subarachnoid,
    "subdural": _subdural,
}


def _render_chunk(prm: dict[str, np.ndarray], size: int, seed: int, c: int) -> tuple[int, np.ndarray, dict]:
    """Chunk ``c``: ``(start, raw int16 (B, H, W), masks)`` with raw = round(HU + 1024) (own noise stream)."""
    start = c * _CHUNK
    sl = {k: v[start : start + _CHUNK] for k, v in prm.items()}
    rng = np.random.default_rng(np.random.SeedSequence([PHANTOM_VERSION, seed, 7919, c]))
    hu, masks = _render(sl, size, rng)
    return start, np.clip(np.rint(hu + 1024), 0, 4095).astype(np.int16), masks


def _default_patients(n_images: int, n_patients: int | None) -> int:
    p = max(1, n_images // 6) if n_patients is None else int(n_patients)
    if not 1 <= p <= n_images:
        raise ValueError(f"n_patients must be in [1, n_images={n_images}], got {p}")
    return p


def _phantom_arrays(n_images: int, size: int = 64, seed: int = 0, n_patients: int | None = None):
    """In-memory phantom (tests): ``(params, raw int16 (N, H, W), masks {name: (N, H, W) bool})``."""
    prm = _sample_params(n_images, seed, _default_patients(n_images, n_patients))
    raws, masks = [], {}
    for c in range(-(-n_images // _CHUNK)):
        _, raw, m = _render_chunk(prm, size, seed, c)
        raws.append(raw)
        for k, v in m.items():
            masks.setdefault(k, []).append(v)
    return prm, np.concatenate(raws), {k: np.concatenate(v) for k, v in masks.items()}


# ----------------------------------------------------------------------------------------------------- DICOM
_CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"


def _dicom_template(size: int):
    """A CT Image Storage dataset with everything that is the same for all slices (explicit VR little endian)."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = _CT_IMAGE_STORAGE
    meta.MediaStorageSOPInstanceUID = "1.2.3"
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset("phantom.dcm", {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = _CT_IMAGE_STORAGE
    ds.Modality, ds.PatientName, ds.StudyDescription = "CT", "PHANTOM^SYNTHETIC", "SYNTHETIC ICH PHANTOM (fedpartial)"
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    ds.PixelSpacing = [round(230.0 / size, 6)] * 2
    ds.SliceThickness = 5.0
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.Rows, ds.Columns = size, size
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = -1024, 1, "HU"
    ds.WindowCenter, ds.WindowWidth = [40, 40], [80, 80]  # MultiValue, as in many RSNA files
    return ds


def _write_dicom(ds, path: Path, raw: np.ndarray, image_id: str, patient_id: str, seed: int, slice_no: int) -> None:
    """Fill the slice-specific elements of template ``ds`` (deterministic UIDs) and save; ``raw`` ``(H, W)``
    int16 stored values, HU = raw - 1024."""
    from pydicom.uid import generate_uid

    sop = generate_uid(entropy_srcs=["fedpartial-ich-phantom", str(seed), image_id])
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = sop
    ds.StudyInstanceUID = generate_uid(entropy_srcs=["fedpartial-ich-phantom-study", str(seed), patient_id])
    ds.SeriesInstanceUID = generate_uid(entropy_srcs=["fedpartial-ich-phantom-series", str(seed), patient_id])
    ds.PatientID, ds.InstanceNumber = patient_id, slice_no
    ds.ImagePositionPatient = [-115.0, -115.0, float(5 * slice_no)]
    ds.PixelData = np.ascontiguousarray(raw, dtype="<i2").tobytes()
    ds.save_as(path, enforce_file_format=True)


# -------------------------------------------------------------------------------------------------- generate
def _params_key(n_images: int, size: int, seed: int, n_patients: int) -> dict:
    return {
        "generator": "fedpartial.ich_phantom",
        "version": PHANTOM_VERSION,
        "n_images": n_images,
        "size": size,
        "seed": seed,
        "n_patients": n_patients,
    }


def _is_complete(out_dir: Path, key: dict) -> bool:
    try:
        meta = json.loads((out_dir / "phantom.json").read_text())
    except (OSError, ValueError):
        return False
    if {k: meta.get(k) for k in key} != key or not (out_dir / "stage_2_train.csv").is_file():
        return False
    img_dir = out_dir / "stage_2_train"
    return img_dir.is_dir() and sum(1 for e in os.scandir(img_dir) if e.name.endswith(".dcm")) == key["n_images"]


def generate_ich_phantom(
    out_dir: str | os.PathLike, n_images: int = 1500, size: int = 128, seed: int = 0, n_patients: int | None = None
) -> Path:
    """Write the phantom into ``out_dir`` (see the module doc) and return ``out_dir``.

    Deterministic (same arguments -> same bytes), atomic (built in a temporary sibling folder, then renamed)
    and idempotent (a complete phantom with the same parameters is left alone). An existing ``out_dir`` that
    is neither empty nor a phantom is never touched (ValueError).
    """
    from filelock import FileLock

    if n_images < 1 or size < 32:
        raise ValueError(f"need n_images >= 1 and size >= 32, got n_images={n_images}, size={size}")
    out_dir = Path(out_dir).absolute()
    key = _params_key(int(n_images), int(size), int(seed), _default_patients(n_images, n_patients))
    if _is_complete(out_dir, key):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir.parent / f".{out_dir.name}.lock")):
        if _is_complete(out_dir, key):
            return out_dir
        if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "phantom.json").exists():
            raise ValueError(f"'{out_dir}' exists and is not an ICH phantom; refusing to overwrite it")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            _write_phantom(tmp, key)
            if out_dir.exists():
                old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
                os.rename(out_dir, old)
                os.rename(tmp, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_phantom(folder: Path, key: dict) -> None:
    n, size, seed = key["n_images"], key["size"], key["seed"]
    prm = _sample_params(n, seed, key["n_patients"])
    img_dir = folder / "stage_2_train"
    img_dir.mkdir()
    template = _dicom_template(size)
    slice_no = np.zeros(n, dtype=int)
    for p in np.unique(prm["patient"]):
        idx = np.flatnonzero(prm["patient"] == p)
        slice_no[idx] = np.arange(1, len(idx) + 1)
    with ThreadPoolExecutor(max_workers=2) as pool:  # numpy releases the GIL: render ahead while writing
        chunks = pool.map(lambda c: _render_chunk(prm, size, seed, c)[:2], range(-(-n // _CHUNK)))
        for start, raw in chunks:
            for j in range(len(raw)):
                i = start + j
                _write_dicom(
                    template,
                    img_dir / f"{prm['image_id'][i]}.dcm",
                    raw[j],
                    str(prm["image_id"][i]),
                    str(prm["patient_id"][i]),
                    seed,
                    int(slice_no[i]),
                )
    lines = ["ID,Label"]
    for img, lab in zip(prm["image_id"], prm["labels"]):
        lines += [f"{img}_{c},{int(v)}" for c, v in zip(ICH_CLASSES, lab)] + [f"{img}_any,{int(lab.any())}"]
    (folder / "stage_2_train.csv").write_text("\n".join(lines) + "\n")
    prevalence = {c: int(v) for c, v in zip(ICH_CLASSES, prm["labels"].sum(0))}
    prevalence["any"] = int(prm["labels"].any(1).sum())
    (folder / "phantom.json").write_text(
        json.dumps({**key, "classes": ICH_CLASSES, "positives": prevalence, "synthetic": True}, indent=2) + "\n"
    )


def load_ich_phantom(
    root: str | os.PathLike, n_images: int = 1500, size: int = 128, seed: int = 0, **kw
) -> SourceTable:
    """Generate the phantom under ``root`` if needed and load it like the RSNA data (``synthetic=True``).

    ``n_patients`` in ``kw`` goes to :func:`generate_ich_phantom`, the rest to :func:`load_rsna_ich`.
    """
    root = generate_ich_phantom(root, n_images=n_images, size=size, seed=seed, n_patients=kw.pop("n_patients", None))
    logger.warning(
        "=" * 20 + " SYNTHETIC DATA: ICH phantom at %s (%d images, %d px, seed %d) is NOT real CT; "
        "results on it say nothing about clinical performance " + "=" * 20,
        root,
        n_images,
        size,
        seed,
    )
    table = load_rsna_ich(root, **kw)
    table.name, table.synthetic = "ich_phantom", True
    return table
