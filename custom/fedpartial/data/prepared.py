"""A prepared folder (``fedpartial-prepare``'s output) as the rest of the data layer reads it: its
``dataset.json``, where it lives in the cache (keyed by the spec) and whether its source files changed since.

:mod:`fedpartial.data.prepare` writes these folders; this module only reads them (no source loading, no
splitting), so a site that reads its manifests imports nothing of the preparation.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .sources.base import SourceError

DATASET_JSON = "dataset.json"
NOT_HASHED = ("verbose", "overwrite", "refresh")  # spec keys that do not change the data


def site_name(i: int) -> str:
    """0-based site index -> NVFlare simulator client name ('site-1', ...)."""
    return f"site-{i + 1}"


@dataclass
class PreparedDataset:
    """A prepared dataset folder, as read by :func:`load_prepared`.

    Attributes:
        classes: global class list (manifest column order).
        task: 'multilabel' or 'multiclass'.
        data_root: absolute folder the manifests' image paths are relative to.
        sites: ``{'site-1': manifest path, ...}``.
        val: validation manifest (fully labelled).
        test: test manifest (fully labelled).
        info: the whole ``dataset.json``.
        path: the prepared folder.
    """

    classes: list[str]
    task: str
    data_root: Path
    sites: dict[str, Path]
    val: Path
    test: Path
    info: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def site_classes(self) -> dict[str, list[str]]:
        """Annotated class names per site."""
        return {k: list(v) for k, v in self.info.get("sites", {}).items()}


def file_stamps(files: Sequence[str]) -> dict[str, list[int]]:
    """``{file: [size, mtime_ns, ctime_ns]}`` of the source's label files (what the prepared-data cache checks;
    the ctime, which ``touch`` cannot put back, tells a file replaced with its size and mtime restored)."""
    out = {}
    for f in files:
        p = Path(f)
        if p.is_file():
            st = p.stat()
            out[str(p.resolve())] = [int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns)]
    return out


def load_prepared(out_dir: str | os.PathLike) -> PreparedDataset:
    """Read a folder written by :func:`prepare`."""
    folder = Path(out_dir).expanduser().resolve()
    meta = folder / DATASET_JSON
    if not meta.is_file():
        raise FileNotFoundError(f"{meta} not found: not a prepared dataset (run fedpartial-prepare)")
    info = json.loads(meta.read_text(encoding="utf-8-sig"))
    data_root = Path(info["data_root"])
    data_root = data_root if data_root.is_absolute() else (folder / data_root).resolve()
    files = info["files"]
    return PreparedDataset(
        classes=list(info["classes"]),
        task=info["task"],
        data_root=data_root,
        sites={s: folder / files[s] for s in info["sites"]},
        val=folder / files["val"],
        test=folder / files["test"],
        info=info,
        path=folder,
    )


def canonical_spec(spec: dict) -> dict:
    """The spec with roots made absolute (so equal data give equal hashes whatever the working folder) and
    without the keys that do not change the data (``verbose``, ``overwrite``, ``refresh``)."""
    spec = {k: v for k, v in spec.items() if k not in NOT_HASHED}
    if "source_root" in spec and "root" not in spec:
        spec["root"] = spec.pop("source_root")
    if "protocol" not in spec or not (spec.get("source") or spec.get("sources")):
        raise ValueError(f"dataset spec needs 'protocol' and 'source' (or 'sources'): {spec}")
    if not spec.get("sources") and "num_sites" not in spec and spec.get("partition") != "centre":
        raise ValueError(f"dataset spec lacks 'num_sites': {spec}")
    if spec.get("root") is not None:
        spec["root"] = str(Path(spec["root"]).expanduser().resolve())
    if spec.get("sources"):
        spec["sources"] = [
            {**s, "root": str(Path(s["root"]).expanduser().resolve())} if s.get("root") else dict(s)
            for s in spec["sources"]
        ]
    return spec


def spec_hash(spec: dict, length: int = 12) -> str:
    """Short sha256 of the canonical JSON of the spec."""
    text = json.dumps(canonical_spec(spec), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _spec_name(spec: dict) -> str:
    return spec.get("source") or "+".join(s.get("source", "?") for s in spec["sources"])


def prepared_path(spec: dict, cache_dir: str | os.PathLike) -> Path:
    """Where :func:`ensure_prepared` keeps the split of ``spec``: ``cache_dir/<source>-<protocol>-<hash>``."""
    spec = canonical_spec(spec)
    return Path(cache_dir).expanduser().resolve() / f"{_spec_name(spec)}-{spec['protocol']}-{spec_hash(spec)}"


def stale_sources(folder: Path) -> list[str]:
    """The source label files recorded in ``folder``'s dataset.json whose size, mtime or ctime changed (or that
    are gone) since it was prepared."""
    try:
        info = json.loads((folder / DATASET_JSON).read_text(encoding="utf-8-sig"))
    except (OSError, json.JSONDecodeError):
        return [str(folder / DATASET_JSON)]
    recorded = info.get("source_files") or {}
    now = file_stamps(list(recorded))
    return [f for f, st in recorded.items() if now.get(f) != list(st)]


def check_job_classes(prepared: "PreparedDataset", classes: Sequence[str] | None, where: str = "") -> None:
    """Raise when a prepared split's classes differ from a job's fixed class list (e.g. ``top_k_classes``
    picked other classes from these data than the job names). The order is free: the sites read their manifests'
    columns by name, as the job orders them."""
    if classes is None or sorted(prepared.classes) == sorted(classes):
        return
    spec = prepared.info
    extra = [c for c in prepared.classes if c not in classes]
    missing = [c for c in classes if c not in prepared.classes]
    how = f"top_k_classes={spec.get('top_k_classes')} picked them from the data; " if spec.get("top_k_classes") else ""
    raise SourceError(
        f"{where}the prepared data ({prepared.path}) have classes {list(prepared.classes)} but the "
        f"job's class list is {list(classes)} (only in the data: {extra}; only in the job: "
        f"{missing}); {how}prepare with the job's classes",
        hint="give the job's class list to prepare ('classes') instead of 'top_k_classes', or set the "
        "job's 'classes' to the prepared ones",
    )
