"""Source loaders: each turns a public dataset folder into one fully labelled :class:`SourceTable`.

``load_source(name, root, **kwargs)`` dispatches by name through ``SOURCES``. Every loader is imported lazily
inside its wrapper, so the registry works even while a loader module is missing or has heavy imports.
"""

from __future__ import annotations

import os
from typing import Callable

from .base import SourceTable


def _ham10000(root: str | os.PathLike, **kwargs) -> SourceTable:
    """HAM10000 (``HAM10000_metadata.csv`` + ``images/``)."""
    from .ham10000 import load_ham10000
    return load_ham10000(root, **kwargs)


def _isic2018(root: str | os.PathLike, **kwargs) -> SourceTable:
    """ISIC 2018 Task 3 (one-hot ground-truth CSV)."""
    from .ham10000 import load_isic2018
    return load_isic2018(root, **kwargs)


def _nih_cxr14(root: str | os.PathLike, **kwargs) -> SourceTable:
    """NIH ChestX-ray14 (official ``Data_Entry_2017.csv`` or a 0/1 ``labels.csv``)."""
    from .nih_cxr14 import load_nih_cxr14
    return load_nih_cxr14(root, **kwargs)


def _rsna_ich(root: str | os.PathLike, **kwargs) -> SourceTable:
    """RSNA intracranial haemorrhage detection (5 subtypes)."""
    from .rsna_ich import load_rsna_ich
    return load_rsna_ich(root, **kwargs)


def _ich_phantom(root: str | os.PathLike, **kwargs) -> SourceTable:
    """Synthetic ICH-like phantom, generated into ``root`` on first use."""
    from .ich_phantom import load_ich_phantom
    return load_ich_phantom(root, **kwargs)


SOURCES: dict[str, Callable[..., SourceTable]] = {
    "ham10000": _ham10000,
    "isic2018": _isic2018,
    "nih_cxr14": _nih_cxr14,
    "rsna_ich": _rsna_ich,
    "ich_phantom": _ich_phantom,
}


def load_source(name: str, root: str | os.PathLike, **kwargs) -> SourceTable:
    """Load source ``name`` from ``root``; ``kwargs`` go to the loader.

    Raises:
        ValueError: unknown source name.
    """
    try:
        loader = SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown source {name!r}; known: {sorted(SOURCES)}") from None
    return loader(root, **kwargs)


__all__ = ["SOURCES", "SourceTable", "load_source"]
