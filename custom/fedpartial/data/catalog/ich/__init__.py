"""Intracranial haemorrhage on head CT: RSNA Intracranial Hemorrhage Detection 2019 and the package's phantom of
it (:mod:`.phantom`, the same layout at any size). One folder for both: the phantom shares the release's
classes, labels and CT windows and is read by the RSNA loader (:mod:`.loader`)."""

from __future__ import annotations

from ..spec import Dataset

CLASSES: list[str] = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
"""The five subtypes, in the release's order (the classes of every ICH job)."""

LABELS: tuple[str, ...] = (*CLASSES, "any")
"""The label names of ``stage_2_train.csv`` (its ``ID`` column is ``ID_<image>_<label>``)."""

ABBREVIATIONS: dict[str, str] = {
    "epidural": "EDH",
    "intraparenchymal": "IPH",
    "intraventricular": "IVH",
    "subarachnoid": "SAH",
    "subdural": "SDH",
}
"""Subtype -> its clinical abbreviation (the vocabulary ``ich_abbreviations``)."""

CT_WINDOWS: tuple[tuple[float, float], ...] = ((40, 80), (80, 200), (600, 2800))
"""(center, width) in HU of the three windows stacked as channels: brain, subdural, bone."""

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
"""The normalisation of the RSNA preset: ImageNet's, as the authors' code uses for the windowed slices."""

PHANTOM: dict = {
    "name": "ich_phantom",
    "task": "multilabel",
    "classes": CLASSES,
    "channels": 3,
    "image_size": 64,
    "ct_windows": [list(w) for w in CT_WINDOWS],
    "mean": None,
    "std": None,
    "prepare": {
        "source": "ich_phantom",
        "root": None,
        "num_sites": 5,
        "protocol": "missing_k",
        "k": 4,
        "seed": 0,
        "val_frac": 0.1,
        "test_frac": 0.2,
        "source_args": {"n_images": 1500, "size": 128, "seed": 0},
    },
}

RSNA: dict = {
    "name": "rsna_ich",
    "task": "multilabel",
    "classes": CLASSES,
    "channels": 3,
    "image_size": 224,
    "ct_windows": [list(w) for w in CT_WINDOWS],
    "mean": IMAGENET_MEAN,
    "std": IMAGENET_STD,
    "prepare": {
        "source": "rsna_ich",
        "root": None,
        "num_sites": 5,
        "protocol": "missing_k",
        "k": 4,
        "seed": 2023,
        "val_frac": 0.1,
        "test_frac": 0.3,
        "site_sizes": 5000,
    },
}

DATASETS: tuple[Dataset, ...] = (
    Dataset(
        name="rsna_ich",
        loader=f"{__name__}.loader:load_rsna_ich",
        summary="RSNA Intracranial Hemorrhage Detection 2019 (stage_2_train.csv + DICOM slices, 5 subtypes)",
        presets={"rsna_ich": RSNA},
        modality="CT",
    ),
    Dataset(
        name="ich_phantom",
        loader=f"{__name__}.phantom:load_ich_phantom",
        summary="synthetic ICH-like CT phantom in the RSNA layout, generated on first use",
        presets={"ich_phantom": PHANTOM},
        modality="CT",
        published=False,
    ),
)
