"""The declaration a named dataset's folder makes: :class:`Dataset` (standard library only, as the whole catalog)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Dataset:
    """One source name of a named dataset, as its folder declares it (``DATASETS = (Dataset(...), ...)`` in
    ``catalog/<folder>/__init__.py``); the source table, the presets, the published sources, the DICOM modalities
    and prepare's vocabulary grouping are derived from these.

    Attributes:
        name: the source name (``fedpartial-prepare --source NAME``, a preset's ``prepare.source``).
        loader: ``"module:function"``, the loader imported only when it runs (it imports pandas), e.g.
            ``f"{__name__}.loader:load_ham10000"`` in the folder's ``__init__.py``.
        summary: one line on the release and its layout (the ``--source`` help and the source table).
        presets: the presets this source backs, by preset name (a job's ``dataset.preset``).
        modality: the DICOM modality code of its images (``CT``, ``DX``, ``XC`` for external-camera photography);
            ``None``: none recorded.
        published: read from a release's folder (``--root`` required); ``False``: generated into the output folder.
        vocabulary: the name of a vocabulary (:data:`fedpartial.data.vocabulary.VOCABULARIES`, global class ->
            its column name) its multi-label columns are read in when it is federated with other releases.
        centres: the order of the centres its rows record (partition ``centre``), e.g. FLamby's index order.
    """

    name: str
    loader: str
    summary: str = ""
    presets: Mapping[str, dict] = field(default_factory=dict)
    modality: str | None = None
    published: bool = True
    vocabulary: str | None = None
    centres: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        module, colon, func = self.loader.partition(":")
        if not (module and colon and func):
            raise ValueError(f"dataset {self.name!r}: loader must be 'module:function', got {self.loader!r}")

    def load_function(self) -> Callable[..., Any]:
        """The loader itself (its module imported now); it returns a :class:`fedpartial.data.sources.SourceTable`."""
        module, _, func = self.loader.partition(":")
        return getattr(importlib.import_module(module), func)

    def load(self, root: str | os.PathLike, **kwargs: Any) -> Any:
        """Load this source from ``root``; ``kwargs`` go to the loader."""
        return self.load_function()(root, **kwargs)
