"""Source loaders: each turns a dataset folder into one fully labelled :class:`SourceTable`.

``load_source(name, root, **kwargs)`` dispatches by name through ``SOURCES``: the named datasets, each declared in
its folder of :mod:`fedpartial.data.catalog` (whose ``loader.py`` reads it), and the generic sources of this
package (``csv``: any label CSV, ``folder``: one sub-folder per class). Every loader is imported lazily when it
runs, so the registry works even while a loader module is missing or has heavy imports.
"""

from __future__ import annotations

import os
from typing import Callable

from ..catalog import DATASETS
from .base import SourceError, SourceTable


def _csv(root: str | os.PathLike, **kwargs) -> SourceTable:
    """Any label CSV: an image column, one column per class or a label-name column, a patient column."""
    from .csv_source import load_csv  # imported where used: each loader loads pandas

    return load_csv(root, **kwargs)


def _folder(root: str | os.PathLike, **kwargs) -> SourceTable:
    """One sub-folder per class (single-label)."""
    from .folder_source import load_folder  # imported where used: each loader loads pandas

    return load_folder(root, **kwargs)


SOURCES: dict[str, Callable[..., SourceTable]] = {
    **{name: dataset.load for name, dataset in DATASETS.items()},
    "csv": _csv,
    "folder": _folder,
}
"""Every source by name: the named datasets of :mod:`fedpartial.data.catalog` and the two generic ones."""


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
    **{name: dataset.load_function for name, dataset in DATASETS.items()},
    "csv": _loader("csv_source", "load_csv"),
    "folder": _loader("folder_source", "load_folder"),
}
"""The loader function of each source (imported when called), whose parameters ``load_source`` checks options
against."""


__all__ = ["SOURCES", "SourceError", "SourceTable", "load_source"]
