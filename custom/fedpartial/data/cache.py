"""Where prepared data are kept between job starts: one cache root outside any simulator workspace.

``$FEDPARTIAL_CACHE`` when set, else ``~/.cache/fedpartial``. Under it: the simulator's prepared splits
(``<source>-<protocol>-<hash>/``, :func:`fedpartial.data.prepare.ensure_prepared`), the image stores
(``stores/``, :mod:`fedpartial.data.store`) and the decode-check cache of ``fedpartial-prepare``
(``decoded.sqlite``). NVFlare's simulator deletes a job's run folder at every start; this root survives.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FEDPARTIAL_CACHE"
STORES = "stores"


def cache_dir() -> Path:
    """The cache root (see the module docstring)."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "fedpartial")).expanduser()


def store_root(folder: str | os.PathLike | None = None) -> Path:
    """The folder of the image stores: ``folder`` when given (a dataset's ``cache_dir``), else
    ``<cache root>/stores``."""
    return Path(folder).expanduser() if folder else cache_dir() / STORES
