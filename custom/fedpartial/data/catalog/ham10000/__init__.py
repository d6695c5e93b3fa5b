"""HAM10000 (ISIC 2018 task 3): 10,015 dermoscopy images, one of seven diagnoses each."""

from __future__ import annotations

from ..spec import Dataset

CLASSES: list[str] = ["MEL", "NV", "BCC", "AKIEC", "BKL", "DF", "VASC"]
"""The ISIC 2018 class order (``HAM10000_metadata``'s ``dx`` codes, upper-cased)."""

DX_TO_CLASS: dict[str, str] = {c.lower(): c for c in CLASSES}
"""``dx`` code -> class."""

PRESET: dict = {
    "name": "ham10000",
    "task": "multiclass",
    "classes": CLASSES,
    "channels": 3,
    "image_size": 64,
    "ct_windows": None,
    "mean": [0.763, 0.546, 0.570],
    "std": [0.141, 0.153, 0.170],
    "prepare": {
        "source": "ham10000",
        "root": "../shared/data/ham10000",
        "num_sites": 5,
        "protocol": "table",
        "table": "fedlsm_isic",
        "seed": 523,
        "val_frac": 0.1,
        "test_frac": 0.2,
    },
}

DATASETS: tuple[Dataset, ...] = (
    Dataset(
        name="ham10000",
        loader=f"{__name__}.loader:load_ham10000",
        summary="HAM10000 (HAM10000_metadata.csv + images/)",
        presets={"ham10000": PRESET},
        modality="XC",
    ),
    Dataset(
        name="isic2018",
        loader=f"{__name__}.loader:load_isic2018",
        summary="ISIC 2018 task 3 (one-hot ground-truth CSV; the HAM10000 images)",
        modality="XC",
    ),
)
