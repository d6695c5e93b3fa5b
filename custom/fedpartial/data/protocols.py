"""Label protocols: which classes each site annotates.

Every protocol is a pure function returning ``list[list[int]]``: for site ``k`` (0-based; ``site-{k+1}`` on
disk) the sorted indices of the classes it annotates. Randomised protocols depend only on their ``seed``.
:func:`assign` dispatches by name (``PROTOCOLS``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from .settings import PROTOCOL_ARGS

FEDLSM_ISIC_TABLE: dict[str, list[str]] = {
    "site-1": ["BKL", "VASC", "NV"],
    "site-2": ["NV", "DF", "BCC"],
    "site-3": ["MEL", "DF", "BCC"],
    "site-4": ["AKIEC", "BCC", "DF"],
    "site-5": ["BCC", "BKL", "AKIEC"],
}
"""FedLSM's fixed ISIC 2018 table (5 clients; the paper's c0..c4 = site-1..site-5)."""

NAMED_TABLES: dict[str, dict[str, list[str]]] = {"fedlsm_isic": FEDLSM_ISIC_TABLE}
"""Tables usable by name in ``assign('table', ..., table='<name>')`` and the CLI's ``--table``."""


def _check_counts(num_classes: int, num_sites: int) -> None:
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")


def missing_k(num_classes: int, num_sites: int, k: int, seed: int = 0) -> list[list[int]]:
    """Every site misses exactly ``k`` classes; every class is annotated somewhere (FedMLP "missing k").

    Each site annotates ``n = C - k`` classes. Sites take consecutive blocks of ``n`` classes of a seeded class
    permutation, cyclically (site ``i`` gets positions ``i*n .. i*n+n-1`` mod ``C``), so each class is
    annotated by ``floor`` or ``ceil`` of ``num_sites * n / C`` sites.

    Special case (FedMLP's released runs): ``k = C - 1`` with ``num_sites == C`` gives site ``i`` exactly
    class ``i`` for every seed.

    Raises:
        ValueError: ``k < 0``, ``k >= C`` (a site would annotate nothing) or ``num_sites * (C - k) < C`` (some
            class could not be covered).
    """
    _check_counts(num_classes, num_sites)
    if not 0 <= k < num_classes:
        raise ValueError(f"missing_k: k must be in 0..{num_classes - 1} for {num_classes} classes, got {k}")
    n = num_classes - k
    if num_sites * n < num_classes:
        raise ValueError(
            f"missing_k: {num_sites} sites annotating {n} class(es) each cannot cover {num_classes} classes "
            f"(need num_sites * (C - k) >= C)"
        )
    if n == 1 and num_sites == num_classes:
        return [[i] for i in range(num_classes)]
    perm = np.random.default_rng(seed).permutation(num_classes)
    return [sorted(int(perm[(i * n + j) % num_classes]) for j in range(n)) for i in range(num_sites)]


def random_s(num_classes: int, num_sites: int, s: int, seed: int = 0) -> list[list[int]]:
    """FedLSM's random subsets: each site annotates ``s`` distinct classes, the union covers every class.

    Shuffle the classes with the seed, deal them round-robin over the sites, then top up every site to ``s``
    classes drawn at random from the ones it lacks. (The released FedLSM code can draw a class a site already
    has, leaving it with fewer than ``s``; this does not.)

    Raises:
        ValueError: ``s < 1``, ``s > C`` or ``num_sites * s < C``.
    """
    _check_counts(num_classes, num_sites)
    if not 1 <= s <= num_classes:
        raise ValueError(f"random_s: s must be in 1..{num_classes}, got {s}")
    if num_sites * s < num_classes:
        raise ValueError(f"random_s: {num_sites} sites x {s} classes cannot cover {num_classes} classes")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_classes)
    sites: list[set[int]] = [set() for _ in range(num_sites)]
    for pos, c in enumerate(perm):
        sites[pos % num_sites].add(int(c))
    for have in sites:
        lacking = [c for c in range(num_classes) if c not in have]
        extra = rng.choice(lacking, size=s - len(have), replace=False) if len(have) < s else []
        have.update(int(c) for c in extra)
    return [sorted(have) for have in sites]


def labeled_unlabeled(num_classes: int, num_sites: int, m: int) -> list[list[int]]:
    """FedIRM: the first ``m`` sites annotate every class, the others annotate nothing.

    Raises:
        ValueError: ``m`` outside ``1..num_sites``.
    """
    _check_counts(num_classes, num_sites)
    if not 1 <= m <= num_sites:
        raise ValueError(f"labeled_unlabeled: m must be in 1..{num_sites}, got {m}")
    return [list(range(num_classes)) if i < m else [] for i in range(num_sites)]


def full(num_classes: int, num_sites: int) -> list[list[int]]:
    """Every site annotates every class (the fully supervised upper bound)."""
    _check_counts(num_classes, num_sites)
    return [list(range(num_classes)) for _ in range(num_sites)]


def _site_sort_key(name: str) -> tuple:
    """Natural order: 'site-2' < 'site-10'."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(name)))


def resolve_table(
    per_site: str | Sequence[Sequence[str]] | Mapping[str, Sequence[str]],
) -> list[list[str]] | Mapping[str, Sequence[str]]:
    """A table given by name (``NAMED_TABLES``) or JSON file path, else the table itself."""
    if isinstance(per_site, (str, Path)):
        if str(per_site) in NAMED_TABLES:
            return NAMED_TABLES[str(per_site)]
        path = Path(per_site)
        if path.is_file():
            return json.loads(path.read_text())
        raise ValueError(f"unknown table {str(per_site)!r}: not one of {sorted(NAMED_TABLES)} nor a JSON file")
    return per_site


def table(
    classes: Sequence[str], per_site: str | Sequence[Sequence[str]] | Mapping[str, Sequence[str]]
) -> list[list[int]]:
    """Explicit class names per site -> class indices.

    Args:
        classes: the global class list.
        per_site: a list of class-name lists (site order), a dict ``{site name: class names}`` (sites in natural
            name order, so ``site-2`` precedes ``site-10``), a name from ``NAMED_TABLES`` (e.g.
            ``'fedlsm_isic'``) or a path to a JSON file holding either form.

    Raises:
        ValueError: an unknown or repeated class name, or an empty table.
    """
    per_site = resolve_table(per_site)
    if isinstance(per_site, Mapping):
        rows = [per_site[k] for k in sorted(per_site, key=_site_sort_key)]
    else:
        rows = list(per_site)
    if not rows:
        raise ValueError("table: no sites given")
    pos = {c: j for j, c in enumerate(classes)}
    out = []
    for i, names in enumerate(rows):
        if isinstance(names, str):
            raise ValueError(f"table: site {i + 1} must be a list of class names, got the string {names!r}")
        unknown = [c for c in names if c not in pos]
        if unknown:
            raise ValueError(f"table: site {i + 1} names unknown class(es) {unknown}; classes are {list(classes)}")
        if len(set(names)) != len(names):
            raise ValueError(f"table: site {i + 1} repeats a class: {list(names)}")
        out.append(sorted(pos[c] for c in names))
    return out


PROTOCOLS: dict[str, Callable[..., list[list[int]]]] = {
    "missing_k": missing_k,
    "random_s": random_s,
    "table": table,
    "labeled_unlabeled": labeled_unlabeled,
    "full": full,
}


def assign(protocol: str, classes: Sequence[str] | int, num_sites: int, seed: int = 0, **params) -> list[list[int]]:
    """Annotated class indices per site for a protocol given by name.

    Args:
        protocol: one of ``PROTOCOLS``.
        classes: the class names (required by ``table``) or just their number.
        num_sites: number of sites.
        seed: seed of the randomised protocols (``missing_k``, ``random_s``).
        **params: the protocol's parameter: ``k`` (missing_k), ``s`` (random_s), ``m`` (labeled_unlabeled),
            ``table`` (table: a name, a JSON path, a list or a dict).

    Raises:
        ValueError: unknown protocol, missing / unexpected parameters, or a table whose number of sites is not
            ``num_sites``.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {sorted(PROTOCOLS)}")
    expected = PROTOCOL_ARGS[protocol]
    missing = [p for p in expected if params.get(p) is None]
    unexpected = [p for p in params if p not in expected]
    if missing or unexpected:
        raise ValueError(
            f"protocol {protocol!r} takes parameter(s) {list(expected)}; missing {missing}, unexpected {unexpected}"
        )
    num_classes = classes if isinstance(classes, int) else len(classes)
    if protocol == "table":
        if isinstance(classes, int):
            raise ValueError("protocol 'table' needs the class names, not their number")
        out = table(classes, params["table"])
        if len(out) != num_sites:
            raise ValueError(f"table has {len(out)} sites but num_sites is {num_sites}")
        return out
    if protocol == "missing_k":
        return missing_k(num_classes, num_sites, int(params["k"]), seed)
    if protocol == "random_s":
        return random_s(num_classes, num_sites, int(params["s"]), seed)
    if protocol == "labeled_unlabeled":
        return labeled_unlabeled(num_classes, num_sites, int(params["m"]))
    return full(num_classes, num_sites)
