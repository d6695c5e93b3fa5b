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


def cache_hint(path: str | os.PathLike | None) -> str:
    """``; set $FEDPARTIAL_CACHE to a writable folder`` when ``path`` lies in the cache folder, else nothing."""
    if path is None:
        return ""
    try:
        inside = Path(path).expanduser().resolve().is_relative_to(cache_dir().expanduser().resolve())
    except OSError:
        inside = False
    return f"; set ${CACHE_ENV} to a writable folder" if inside else ""


def os_error_line(e: OSError) -> str:
    """An ``OSError`` as one line: the file, what the system said, and the cache hint where it applies."""
    if e.filename is None or not e.strerror:
        return " ".join(str(e).split())
    return f"{e.filename}: {e.strerror}{cache_hint(e.filename)}"
