"""The datasets the package knows, one small module of constants each (FLamby-style): a release's class names in
its own order, the names other vocabularies give them, its normalisation, and the preset a job names
(``"dataset": {"preset": "ham10000", ...}``, see :mod:`fedpartial.data.presets`). The loaders in
:mod:`fedpartial.data.sources`, the presets, the vocabularies and the DICOM windows read them from here; nothing
here imports anything but the standard library.

====================  ==========================================================================================
module                presets
====================  ==========================================================================================
:mod:`.ich`           ``ich_phantom`` (the synthetic CT phantom), ``rsna_ich`` (RSNA Intracranial Hemorrhage 2019)
:mod:`.ham10000`      ``ham10000`` (HAM10000 / ISIC 2018 task 3)
:mod:`.isic2019`      ``isic2019`` (ISIC 2019, Fed-ISIC2019 centres)
:mod:`.nih_cxr14`     ``nih_cxr14`` (NIH ChestX-ray14)
:mod:`.chexpert`      ``chexpert`` (CheXpert)
:mod:`.mimic_cxr`     ``mimic_cxr`` (MIMIC-CXR-JPG)
====================  ==========================================================================================
"""

from __future__ import annotations

from . import chexpert, ham10000, ich, isic2019, mimic_cxr, nih_cxr14

PRESETS: dict[str, dict] = {
    **ich.PRESETS,
    "ham10000": ham10000.PRESET,
    "nih_cxr14": nih_cxr14.PRESET,
    # the published releases below have no root here: a job (or fedpartial_data.json) names where they live
    "isic2019": isic2019.PRESET,
    "chexpert": chexpert.PRESET,
    "mimic_cxr": mimic_cxr.PRESET,
}
"""Every preset by name (a job's ``dataset.preset``)."""
