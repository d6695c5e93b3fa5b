"""MIMIC-CXR-JPG: chest X-rays of the Beth Israel Deaconess Medical Center, labelled by the CheXpert labeler."""

from __future__ import annotations

from ..spec import Dataset

COLUMNS: list[str] = [
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Enlarged Cardiomediastinum",
    "Fracture",
    "Lung Lesion",
    "Lung Opacity",
    "No Finding",
    "Pleural Effusion",
    "Pleural Other",
    "Pneumonia",
    "Pneumothorax",
    "Support Devices",
]
"""The 14 label columns of ``mimic-cxr-2.0.0-chexpert.csv`` in the release's order."""

FINDINGS: list[str] = [c for c in COLUMNS if c != "No Finding"]
"""The 13 observations (the default class list)."""

PRESET: dict = {
    "name": "mimic_cxr",
    "task": "multilabel",
    "classes": FINDINGS,
    "channels": 1,
    "image_size": 64,
    "ct_windows": None,
    "mean": None,
    "std": None,
    "prepare": {
        "source": "mimic_cxr",
        "root": None,
        "num_sites": 4,
        "protocol": "full",
        "seed": 0,
        "val_frac": 0.1,
        "test_frac": 0.2,
        "source_args": {"uncertain": "ignore", "view": "frontal", "official_split": True},
    },
}

DATASETS: tuple[Dataset, ...] = (
    Dataset(
        name="mimic_cxr",
        loader=f"{__name__}.loader:load_mimic_cxr",
        summary="MIMIC-CXR-JPG 2.0.0 (mimic-cxr-2.0.0-chexpert/-metadata/-split.csv(.gz), files/p1x/...)",
        presets={"mimic_cxr": PRESET},
        modality="DX",
        vocabulary="chexpert_synonyms",  # labelled by the CheXpert labeler: CheXpert's names
    ),
)
