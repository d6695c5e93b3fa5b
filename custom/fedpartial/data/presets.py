"""Dataset presets (FLamby-style constants): classes, task, image pipeline defaults and the source used to
prepare a simulated split. A job names a preset and overrides what it needs::

    "dataset": {"preset": "ich_phantom", "image_size": 64, "prepare": {"protocol": "missing_k", "k": 4}}

Everything here is method-agnostic.
"""

from __future__ import annotations

import copy

ICH_CLASSES = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
ISIC_CLASSES = ["MEL", "NV", "BCC", "AKIEC", "BKL", "DF", "VASC"]
NIH_CLASSES = [
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
# FedMLP: "the eight categories with the highest incidence" (NIH's published frequencies)
NIH_TOP8 = [
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumothorax",
    "Consolidation",
]
ISIC2019_CLASSES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]  # UNK has no training image
CHEXPERT_FINDINGS = [
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
MIMIC_FINDINGS = [
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Enlarged Cardiomediastinum",
    "Fracture",
    "Lung Lesion",
    "Lung Opacity",
    "Pleural Effusion",
    "Pleural Other",
    "Pneumonia",
    "Pneumothorax",
    "Support Devices",
]
CT_WINDOWS = [[40, 80], [80, 200], [600, 2800]]  # brain, subdural, bone (center, width) in HU
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

PRESETS: dict[str, dict] = {
    "ich_phantom": {
        "name": "ich_phantom",
        "task": "multilabel",
        "classes": ICH_CLASSES,
        "channels": 3,
        "image_size": 64,
        "ct_windows": CT_WINDOWS,
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
    },
    "rsna_ich": {
        "name": "rsna_ich",
        "task": "multilabel",
        "classes": ICH_CLASSES,
        "channels": 3,
        "image_size": 224,
        "ct_windows": CT_WINDOWS,
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
    },
    "ham10000": {
        "name": "ham10000",
        "task": "multiclass",
        "classes": ISIC_CLASSES,
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
    },
    "nih_cxr14": {
        "name": "nih_cxr14",
        "task": "multilabel",
        "classes": NIH_TOP8,
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
            "classes": NIH_TOP8,
        },
    },
    # the published releases below have no root here: a job (or fedpartial_data.json) names where they live
    "isic2019": {
        "name": "isic2019",
        "task": "multiclass",
        "classes": ISIC2019_CLASSES,
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
    },
    "chexpert": {
        "name": "chexpert",
        "task": "multilabel",
        "classes": CHEXPERT_FINDINGS,
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
    },
    "mimic_cxr": {
        "name": "mimic_cxr",
        "task": "multilabel",
        "classes": MIMIC_FINDINGS,
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
    },
}


def deep_merge(base: dict, over: dict) -> dict:
    """A copy of ``base`` with ``over`` merged in, nested dicts merged key by key."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def resolve_dataset(cfg: dict | str) -> dict:
    """A job's dataset config -> full dataset config (preset merged with the job's overrides)."""
    cfg = {"preset": cfg} if isinstance(cfg, str) else dict(cfg)
    preset = cfg.pop("preset", None)
    if preset is None:
        base = {}
    elif preset in PRESETS:
        base = PRESETS[preset]
    else:
        raise ValueError(f"unknown dataset preset {preset!r}; available: {sorted(PRESETS)}")
    full = deep_merge(base, cfg)
    for key in ("name", "task", "classes", "channels", "image_size"):
        if key not in full:
            raise ValueError(f"dataset config lacks '{key}' (and no preset provides it)")
    return full
