"""The named datasets the package knows, one folder each (FLamby-style): ``catalog/<folder>/__init__.py`` holds a
release's constants (its class names in its own order, the names other vocabularies give them, its normalisation,
the preset a job names: ``"dataset": {"preset": "ham10000", ...}``, see :mod:`fedpartial.data.presets`) and ends
with its declaration, ``DATASETS = (Dataset(...), ...)`` (:class:`~fedpartial.data.catalog.spec.Dataset`);
``catalog/<folder>/loader.py`` turns the release's folder into a :class:`fedpartial.data.sources.SourceTable`.

Everything else is derived from the declarations: :data:`PRESETS`, the source table of
:mod:`fedpartial.data.sources`, prepare's published sources, centre order and vocabulary grouping, and the DICOM
modality of an exported model. Adding a named dataset is adding its folder (and its row in ``docs/datasets.md``).
Importing the catalog imports the folders' ``__init__.py`` only (standard library); a loader module is imported
when its loader runs.

====================  ==========================================================================================
folder                sources (and presets)
====================  ==========================================================================================
``ich``               ``rsna_ich`` (RSNA Intracranial Hemorrhage 2019), ``ich_phantom`` (the synthetic CT phantom
                      of it, :mod:`.ich.phantom`): one folder, as both share the classes, labels and CT windows
``ham10000``          ``ham10000`` (HAM10000), ``isic2018`` (ISIC 2018 task 3, the same images; no preset)
``isic2019``          ``isic2019`` (ISIC 2019, Fed-ISIC2019 centres)
``nih_cxr14``         ``nih_cxr14`` (NIH ChestX-ray14)
``chexpert``          ``chexpert`` (CheXpert)
``mimic_cxr``         ``mimic_cxr`` (MIMIC-CXR-JPG)
====================  ==========================================================================================
"""

from __future__ import annotations

import importlib
import pkgutil

from .spec import Dataset


def _declared() -> dict[str, Dataset]:
    """Every folder's ``DATASETS``, by source name (folders in name order, each in its declaration order)."""
    out: dict[str, Dataset] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        declared = getattr(module, "DATASETS", None)
        if declared is None:
            raise ImportError(f"{module.__name__} declares no DATASETS (a tuple of fedpartial.data.catalog.Dataset)")
        for dataset in declared:
            if not isinstance(dataset, Dataset):
                raise TypeError(f"{module.__name__}.DATASETS holds {dataset!r}, not a Dataset")
            if dataset.name in out:
                raise ValueError(f"source {dataset.name!r} is declared twice (again in {module.__name__})")
            out[dataset.name] = dataset
    return out


DATASETS: dict[str, Dataset] = _declared()
"""Every named dataset's source by name (``fedpartial-prepare --source``)."""


def _presets() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for dataset in DATASETS.values():
        for preset, value in dataset.presets.items():
            if preset in out:
                raise ValueError(f"preset {preset!r} is declared twice (again by source {dataset.name!r})")
            out[preset] = value
    return out


PRESETS: dict[str, dict] = _presets()
"""Every preset by name (a job's ``dataset.preset``)."""

__all__ = ["DATASETS", "PRESETS", "Dataset"]
