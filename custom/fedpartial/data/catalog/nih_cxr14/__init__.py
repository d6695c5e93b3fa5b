"""NIH ChestX-ray14: 112,120 frontal chest X-rays, 14 findings mined from the reports."""

from __future__ import annotations

from ..spec import Dataset

CLASSES: list[str] = [
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
    "Consolidation",
    "Edema",
    "Emphysema",
    "Fibrosis",
    "Pleural_Thickening",
    "Hernia",
]
"""The release's 14 findings, in its order (``Data_Entry_2017.csv``'s ``Finding Labels``)."""

TOP8: list[str] = [
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumothorax",
    "Consolidation",
]
"""FedMLP: "the eight categories with the highest incidence" (NIH's published frequencies)."""

PRESET: dict = {
    "name": "nih_cxr14",
    "task": "multilabel",
    "classes": TOP8,
    "channels": 1,
    "image_size": 64,
    "ct_windows": None,
    "mean": [0.506],
    "std": [0.252],
    "prepare": {
        "source": "nih_cxr14",
        "root": "../shared/data/nih_cxr14_1000",
        "num_sites": 4,
        "protocol": "missing_k",
        "k": 6,
        "seed": 0,
        "val_frac": 0.1,
        "test_frac": 0.2,
        "classes": TOP8,
    },
}

DATASETS: tuple[Dataset, ...] = (
    Dataset(
        name="nih_cxr14",
        loader=f"{__name__}.loader:load_nih_cxr14",
        summary="NIH ChestX-ray14 (official Data_Entry_2017.csv or a 0/1 labels.csv)",
        presets={"nih_cxr14": PRESET},
        modality="DX",
    ),
)
