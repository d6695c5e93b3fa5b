"""Source loaders: each turns a public dataset folder into one fully labelled :class:`SourceTable`.

``load_source(name, root, **kwargs)`` dispatches by name through ``SOURCES``. Every loader is imported lazily
inside its wrapper, so the registry works even while a loader module is missing or has heavy imports.
"""

from __future__ import annotations

import os
from typing import Callable

from .base import SourceError, SourceTable


def _ham10000(root: str | os.PathLike, **kwargs) -> SourceTable:
    """HAM10000 (``HAM10000_metadata.csv`` + ``images/``)."""
    from .ham10000 import load_ham10000  # imported where used: each loader loads pandas

    return load_ham10000(root, **kwargs)


def _isic2018(root: str | os.PathLike, **kwargs) -> SourceTable:
    """ISIC 2018 Task 3 (one-hot ground-truth CSV)."""
    from .ham10000 import load_isic2018  # imported where used: each loader loads pandas

    return load_isic2018(root, **kwargs)


def _isic2019(root: str | os.PathLike, **kwargs) -> SourceTable:
    """ISIC 2019 training set (FLamby's Fed-ISIC2019 centres)."""
    from .isic2019 import load_isic2019  # imported where used: each loader loads pandas

    return load_isic2019(root, **kwargs)


def _chexpert(root: str | os.PathLike, **kwargs) -> SourceTable:
    """CheXpert-v1.0 / CheXpert-v1.0-small (``train.csv``, ``Path``, uncertainty labels)."""
    from .chexpert import load_chexpert  # imported where used: each loader loads pandas

    return load_chexpert(root, **kwargs)


def _mimic_cxr(root: str | os.PathLike, **kwargs) -> SourceTable:
    """MIMIC-CXR-JPG 2.0.0 (``mimic-cxr-2.0.0-chexpert/-metadata/-split.csv(.gz)``, ``files/p1x/...``)."""
    from .mimic_cxr import load_mimic_cxr  # imported where used: each loader loads pandas

    return load_mimic_cxr(root, **kwargs)


def _nih_cxr14(root: str | os.PathLike, **kwargs) -> SourceTable:
    """NIH ChestX-ray14 (official ``Data_Entry_2017.csv`` or a 0/1 ``labels.csv``)."""
    from .nih_cxr14 import load_nih_cxr14  # imported where used: each loader loads pandas

    return load_nih_cxr14(root, **kwargs)


def _rsna_ich(root: str | os.PathLike, **kwargs) -> SourceTable:
    """RSNA intracranial haemorrhage detection (5 subtypes)."""
    from .rsna_ich import load_rsna_ich  # imported where used: each loader loads pandas

    return load_rsna_ich(root, **kwargs)


def _ich_phantom(root: str | os.PathLike, **kwargs) -> SourceTable:
    """Synthetic ICH-like phantom, generated into ``root`` on first use."""
    from .ich_phantom import load_ich_phantom  # imported where used: each loader loads pandas

    return load_ich_phantom(root, **kwargs)


def _csv(root: str | os.PathLike, **kwargs) -> SourceTable:
    """Any label CSV: an image column, one column per class or a label-name column, a patient column."""
    from .csv_source import load_csv  # imported where used: each loader loads pandas

    return load_csv(root, **kwargs)


def _folder(root: str | os.PathLike, **kwargs) -> SourceTable:
    """One sub-folder per class (single-label)."""
    from .folder_source import load_folder  # imported where used: each loader loads pandas

    return load_folder(root, **kwargs)


SOURCES: dict[str, Callable[..., SourceTable]] = {
    "ham10000": _ham10000,
    "isic2018": _isic2018,
    "isic2019": _isic2019,
    "chexpert": _chexpert,
    "mimic_cxr": _mimic_cxr,
    "nih_cxr14": _nih_cxr14,
    "rsna_ich": _rsna_ich,
    "ich_phantom": _ich_phantom,
    "csv": _csv,
    "folder": _folder,
}


def load_source(name: str, root: str | os.PathLike, **kwargs) -> SourceTable:
    """Load source ``name`` from ``root``; ``kwargs`` go to the loader.

    Raises:
        SourceError: unknown source name, or an option the loader does not take.
    """
    import inspect

    try:
        loader = SOURCES[name]
    except KeyError:
        raise SourceError(f"unknown source {name!r}; known: {sorted(SOURCES)}") from None
    target = _LOADERS.get(name)
    if target is not None:
        params = inspect.signature(target()).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # a loader of typed options checks its own keys
            return loader(root, **kwargs)
        unknown = sorted(k for k in kwargs if k not in params)
        if unknown:
            options = [p for p in params if p not in ("root", "name")]
            raise SourceError(f"source {name!r} takes no option(s) {unknown}; its options are {options}")
    return loader(root, **kwargs)


def _loader(module: str, func: str) -> Callable[[], Callable]:
    def get():
        import importlib

        return getattr(importlib.import_module(f".{module}", __name__), func)

    return get


_LOADERS: dict[str, Callable[[], Callable]] = {
    "ham10000": _loader("ham10000", "load_ham10000"),
    "isic2018": _loader("ham10000", "load_isic2018"),
    "isic2019": _loader("isic2019", "load_isic2019"),
    "chexpert": _loader("chexpert", "load_chexpert"),
    "mimic_cxr": _loader("mimic_cxr", "load_mimic_cxr"),
    "nih_cxr14": _loader("nih_cxr14", "load_nih_cxr14"),
    "csv": _loader("csv_source", "load_csv"),
    "folder": _loader("folder_source", "load_folder"),
}


__all__ = ["SOURCES", "SourceError", "SourceTable", "load_source"]
