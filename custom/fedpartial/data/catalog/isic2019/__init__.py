"""ISIC 2019 (the challenge's training set; Fed-ISIC2019 splits it into six centres)."""

from __future__ import annotations

from ..spec import Dataset

COLUMNS: list[str] = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK"]
"""The label columns of ``ISIC_2019_Training_GroundTruth.csv`` in the release's order."""

CLASSES: list[str] = COLUMNS[:-1]
"""The 8 diagnoses with training images (the default class list; UNK is a test-time class)."""

FLAMBY_CENTRES: list[str] = ["BCN", "HAM_vidir_molemax", "HAM_vidir_modern", "HAM_rosendahl", "MSK", "HAM_vienna_dias"]
"""Fed-ISIC2019's centres in FLamby's index order 0..5."""

PRESET: dict = {
    "name": "isic2019",
    "task": "multiclass",
    "classes": CLASSES,
    "channels": 3,
    "image_size": 64,
    "ct_windows": None,
    "mean": None,
    "std": None,
    "prepare": {
        "source": "isic2019",
        "root": None,
        "partition": "centre",
        "protocol": "full",
        "seed": 0,
        "val_frac": 0.1,
        "test_frac": 0.2,
    },
}

DATASETS: tuple[Dataset, ...] = (
    Dataset(
        name="isic2019",
        loader=f"{__name__}.loader:load_isic2019",
        summary="ISIC 2019 training set (FLamby's Fed-ISIC2019 centres)",
        presets={"isic2019": PRESET},
        modality="XC",
        centres=tuple(FLAMBY_CENTRES),
    ),
)
