"""A site's own data configuration: ``local/fedpartial_data.json`` (or the file ``$FEDPARTIAL_SITE_CONFIG`` names)
read into a :class:`SiteData`, the data anchor relative paths resolve against, and what a site's data are
(:func:`data_source`). :mod:`fedpartial.data.site_config` decides which data a site uses (this file, or in the
simulator a prepared split); ``fedpartial-store --site-config`` reads the file directly."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .vocabulary import VocabularyError, check_vocabulary

SITE_CONFIG_ENV = "FEDPARTIAL_SITE_CONFIG"
SITE_CONFIG_FILE = "fedpartial_data.json"
DATA_DIR_ENV = "FEDPARTIAL_DATA_DIR"


class SiteDataError(RuntimeError):
    """A site cannot find its data; the message names the site and what to do."""


@dataclass
class SiteData:
    site: str
    dataset: str
    data_root: Path
    train: Path
    val: Path | None
    test: Path | None
    origin: str  # "site-config:<file>" or "simulated:<folder>"
    synthetic: bool = False
    columns: dict[str, str] = field(default_factory=dict)  # the site's column name -> global class
    ignore_columns: list[str] = field(default_factory=list)
    source: dict = field(default_factory=dict)  # what the data are: data_source() of its prepared folder

    @property
    def vocabulary(self) -> dict:
        """Keyword arguments of :func:`~fedpartial.data.manifest.read_manifest` for this site's manifests."""
        return {"columns": dict(self.columns), "ignore_columns": list(self.ignore_columns)}


def data_anchor() -> tuple[Path, str]:
    """``(folder, what it is)``: where relative data roots of a job resolve (see the module docstring)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve(), f"${DATA_DIR_ENV}"
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "jobs").is_dir() and (checkout / "custom" / "fedpartial").is_dir():
        return checkout, "the checkout"
    return Path.cwd(), "the working folder"


def resolve_path(p: str | os.PathLike | None, base: Path | None = None) -> Path | None:
    """Absolute paths as they are; relative ones against ``base``, else the data anchor (:func:`data_anchor`)."""
    if p is None:
        return None
    p = Path(p).expanduser()
    if p.is_absolute():
        return p
    root = base or data_anchor()[0]
    return (root / p).resolve()


def data_source(train: Path | None, info: dict | None = None) -> dict:
    """What a site's data are, as results name them: ``{"source", "file", "fingerprint"}`` from the prepared
    folder's ``dataset.json`` (the source's name, e.g. ``csv`` or a ``source_name``; the export's file name; the
    manifests' fingerprint), else ``{"source": "manifest", "file": <the train manifest's name>}``."""
    if info is None and train is not None:
        meta = Path(train).parent / "dataset.json"
        try:
            info = json.loads(meta.read_text(encoding="utf-8-sig")) if meta.is_file() else None
        except (OSError, json.JSONDecodeError):
            info = None
    if not info:
        return {"source": "manifest", "file": Path(train).name if train else None}
    files = list(info.get("source_files") or {})
    root = str(info.get("data_root") or ".")
    name = Path(files[0]).name if files else (Path(root).name if root != "." else None)  # a folder source: its name
    return {"source": str(info.get("source")), "file": name, "fingerprint": info.get("fingerprint")}


def missing_root(site: str, dataset: str, key: str, value: str, path: Path) -> SiteDataError:
    anchor, what = data_anchor()
    how = f"relative to {anchor} ({what})" if not Path(value).expanduser().is_absolute() else "absolute"
    return SiteDataError(
        f"site '{site}': dataset '{dataset}': {key} {value!r} -> {path} does not exist ({how}); set "
        f"${DATA_DIR_ENV} (job.py: --data-dir) to the folder it is relative to, or give an absolute path"
    )


def read_site_config(site: str, name: str, file: Path, classes=None) -> SiteData:
    """Dataset ``name``'s entry of a site's data configuration file (paths relative to the file's folder; the
    site's column names mapped to the job's ``classes`` where given)."""
    if not file.is_file():
        raise SiteDataError(f"site '{site}': data config file {file} (from ${SITE_CONFIG_ENV}) does not exist")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8-sig"))  # a BOM (Windows editors) is fine
    except json.JSONDecodeError as e:
        raise SiteDataError(f"site '{site}': {file} is not valid JSON ({e})") from e
    entry = (cfg.get("datasets") or {}).get(name)
    if entry is None:
        raise SiteDataError(
            f"site '{site}': {file} has no entry for dataset '{name}' (it lists {sorted((cfg.get('datasets') or {}))})"
        )
    if "train" not in entry:
        raise SiteDataError(f"site '{site}': dataset '{name}' in {file} lacks the 'train' manifest")
    base = file.parent.resolve()
    root = resolve_path(entry.get("data_root", "."), base)
    columns, ignore = _vocabulary(entry, classes, f"site '{site}', {file}, dataset '{name}'")
    train = resolve_path(entry["train"], base)
    return SiteData(
        site,
        name,
        root,
        train,
        resolve_path(entry.get("val"), base),
        resolve_path(entry.get("test"), base),
        origin=f"site-config:{file}",
        columns=columns,
        ignore_columns=ignore,
        source=data_source(train),
    )


def _vocabulary(entry: dict, classes, where: str) -> tuple[dict, list]:
    try:
        return (
            check_vocabulary(entry.get("columns"), entry.get("ignore_columns"), classes or [], where)
            if classes is not None
            else (dict(entry.get("columns") or {}), list(entry.get("ignore_columns") or []))
        )
    except VocabularyError as e:
        raise SiteDataError(str(e)) from None
