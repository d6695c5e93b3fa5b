"""Label vocabularies: hospitals name their classes differently (NIH ``Effusion``, CheXpert ``Pleural
Effusion``). A site's ``fedpartial_data.json`` entry may map its manifest's own column names to the job's global
classes and list columns to ignore::

    {"datasets": {"nih_cxr14": {"train": "train.csv",
                                "columns": {"Pleural Effusion": "Effusion"},
                                "ignore_columns": ["Support Devices", "No Finding"]}}}

:func:`map_header` applies that to a manifest header: a mapped column is read as its global class, an ignored
one is skipped, a global class name is itself, and any other column stays the "unknown class column" error of
:func:`fedpartial.data.manifest.read_manifest`. Two columns landing on one class are an error.

Named vocabularies (``VOCABULARIES``, global class -> the other vocabulary's column name) let
``fedpartial-prepare`` write a split where groups of sites use different names (``--vocabulary``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .catalog.chexpert import NIH_NAMES as CHEXPERT_NAMES
from .catalog.chexpert import SYNONYMS as CHEXPERT_SYNONYMS
from .catalog.ich import ABBREVIATIONS as ICH_ABBREVIATIONS

IGNORED = "\0ignored:"  # prefix of an ignored column in a mapped header (never a class name)

VOCABULARIES: dict[str, dict[str, str]] = {
    "chexpert": CHEXPERT_NAMES,
    "chexpert_synonyms": CHEXPERT_SYNONYMS,
    "ich_abbreviations": ICH_ABBREVIATIONS,
}


class VocabularyError(ValueError):
    """A bad vocabulary in a site configuration (names the site and the file)."""


def check_vocabulary(
    columns: Mapping[str, str] | None, ignore: Sequence[str] | None, classes: Sequence[str], where: str
) -> tuple[dict[str, str], list[str]]:
    """Validate a site's mapping against the job's classes; returns ``(columns, ignore)`` as plain types.

    Raises:
        VocabularyError: a mapping that is not ``{str: str}``, a target that is not a job class, a column both
            mapped and ignored, or two columns mapped onto one class.
    """
    columns, ignore = dict(columns or {}), list(ignore or [])
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise VocabularyError(f"{where}: 'columns' must map manifest column names to class names (strings)")
    if not all(isinstance(c, str) for c in ignore):
        raise VocabularyError(f"{where}: 'ignore_columns' must be a list of column names")
    bad = {k: v for k, v in columns.items() if v not in classes}
    if bad:
        raise VocabularyError(
            f"{where}: 'columns' maps {bad} onto no class of the job; the classes are {list(classes)}"
        )
    both = sorted(set(columns) & set(ignore))
    if both:
        raise VocabularyError(f"{where}: column(s) {both} are both mapped and ignored")
    targets: dict[str, str] = {}
    for k, v in columns.items():
        if v in targets:
            raise VocabularyError(f"{where}: columns {targets[v]!r} and {k!r} are both mapped onto class {v!r}")
        targets[v] = k
    return columns, ignore


def map_header(
    header: Sequence[str], classes: Sequence[str], columns: Mapping[str, str] | None, ignore: Sequence[str] | None
) -> tuple[list[str], dict[str, str]]:
    """A manifest header in the job's vocabulary: ``columns`` renamed, ``ignore`` skipped, and a column naming one
    of ``classes`` in another case (``nv`` for ``NV``) read as that class. The columns' order is free.

    Returns:
        ``(mapped header, renamed {global class: original column})``; an ignored column becomes
        ``IGNORED + name`` (skipped by the reader).

    Raises:
        VocabularyError: a column mapped onto a class the header also has under its own name.
    """
    columns, ignore = dict(columns or {}), set(ignore or ())
    lower: dict[str, list[str]] = {}
    for c in classes:
        lower.setdefault(c.lower(), []).append(c)
    out, renamed = [], {}
    for h in header:
        if h in ignore:
            out.append(IGNORED + h)
        elif h in columns:
            out.append(columns[h])
            renamed[columns[h]] = h
        elif h not in classes and len(lower.get(h.lower(), [])) == 1 and lower[h.lower()][0] not in header:
            out.append(lower[h.lower()][0])  # the job's class in another case ('nv' for 'NV')
            renamed[lower[h.lower()][0]] = h
        else:
            out.append(h)
    clash = sorted(c for c in renamed if c in header)
    if clash:
        raise VocabularyError(
            f"column(s) {[renamed[c] for c in clash]} are mapped onto {clash}, which the manifest "
            "also has as column(s) of their own"
        )
    return out, renamed


def invert(global_to_local: Mapping[str, str]) -> dict[str, str]:
    """``{global: local}`` (how prepare renames) -> ``{local: global}`` (what a site configuration holds)."""
    return {v: k for k, v in global_to_local.items()}


def resolve_vocabulary(spec: str | Mapping[str, str], classes: Sequence[str]) -> dict[str, str]:
    """A named vocabulary or a ``{global class: column name}`` dict, restricted to ``classes``."""
    if isinstance(spec, str):
        if spec not in VOCABULARIES:
            raise VocabularyError(f"unknown vocabulary {spec!r}; known: {sorted(VOCABULARIES)}")
        spec = VOCABULARIES[spec]
    unknown = [c for c in spec if c not in classes]
    if unknown and isinstance(spec, dict) and spec not in VOCABULARIES.values():
        raise VocabularyError(f"vocabulary renames unknown class(es) {unknown}; classes are {list(classes)}")
    return {g: l for g, l in spec.items() if g in classes and g != l}


def closest(name: str, names: Sequence[str]) -> str:
    """`` (closest: X)`` for a near-miss name, else ''."""
    import difflib

    lower = {n.lower(): n for n in names}
    hit = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return f" (closest: {lower[hit[0]]!r})" if hit else ""


def match_classes(wanted: Sequence[str], have: Sequence[str]) -> dict[str, str | None]:
    """``{wanted class: the column of ``have`` it names, or None}``: exact names first, then case-insensitively
    (HAM10000's folders ``nv`` / ``mel`` are the ISIC vocabulary's ``NV`` / ``MEL``)."""
    lower: dict[str, list[str]] = {}
    for h in have:
        lower.setdefault(h.lower(), []).append(h)
    out: dict[str, str | None] = {}
    for w in wanted:
        if w in have:
            out[w] = w
        else:
            hits = [h for h in lower.get(w.lower(), []) if h not in wanted]
            out[w] = hits[0] if len(hits) == 1 else None
    return out
