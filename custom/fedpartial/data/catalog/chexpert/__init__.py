"""CheXpert (Stanford): chest X-rays labelled by the CheXpert labeler (1 positive, 0 negative, -1 uncertain, blank
not mentioned)."""

from __future__ import annotations

from ..spec import Dataset

COLUMNS: list[str] = [
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
]
"""The 14 label columns of ``train.csv`` in the release's order."""

FINDINGS: list[str] = COLUMNS[1:]
"""The 13 observations (``No Finding`` left out, as torchxrayvision does); the default class list."""

NIH_NAMES: dict[str, str] = {
    "Effusion": "Pleural Effusion",
    "Pleural_Thickening": "Pleural Other",
    "Mass": "Lung Lesion",
    "Infiltration": "Lung Opacity",
}
"""NIH ChestX-ray14 names -> CheXpert's (the vocabulary ``chexpert``): the shared findings CheXpert names
differently (Atelectasis, Cardiomegaly, Consolidation, Edema, Pneumonia, Pneumothorax are spelled alike) and the
closest CheXpert column of a few NIH findings (used as "CheXpert's own" classes when only NIH images are at hand)."""

SYNONYMS: dict[str, str] = {"Effusion": "Pleural Effusion"}
"""The one NIH finding CheXpert (and MIMIC-CXR, labelled by the CheXpert labeler) spells differently for the same
observation (the vocabulary ``chexpert_synonyms``); the other shared findings (Atelectasis, Cardiomegaly,
Consolidation, Edema, Pneumonia, Pneumothorax) are spelled alike. Used when NIH and CheXpert / MIMIC-CXR sites are
federated from their published releases: NIH's name is the global class."""

PRESET: dict = {
    "name": "chexpert",
    "task": "multilabel",
    "classes": FINDINGS,
    "channels": 1,
    "image_size": 64,
    "ct_windows": None,
    "mean": None,
    "std": None,
    "prepare": {
        "source": "chexpert",
        "root": None,
        "num_sites": 4,
        "protocol": "full",
        "seed": 0,
        "val_frac": 0.1,
        "test_frac": 0.2,
        "source_args": {"uncertain": "ignore", "view": "frontal"},
    },
}

DATASETS: tuple[Dataset, ...] = (
    Dataset(
        name="chexpert",
        loader=f"{__name__}.loader:load_chexpert",
        summary="CheXpert-v1.0 / CheXpert-v1.0-small (train.csv, Path, uncertainty labels)",
        presets={"chexpert": PRESET},
        modality="DX",
        vocabulary="chexpert_synonyms",  # federated with NIH sites: NIH's Effusion is its Pleural Effusion
    ),
)
