"""What a site's statistics may be, and the check of every contribution against it (NVFlare-free).

Beside its weights, a site sends metadata its method's server rule reads: class counts (FedLSM's ``q``, CBAFed's
counts), prototypes (FedMLP), per-class losses (FedNoRo), relation matrices (FedIRM), the classes it annotates,
... A method declares what each of them may be with :class:`StatSpec` (``LocalTrainer.statistics``; the
per-class statistics it declares for the privacy filters, ``LocalTrainer.per_class_metadata``, get a default
:func:`spec_of_class_stat`), and the server checks every contribution against the declarations when it arrives
(:func:`check_statistics`), before the rule sees it: a site whose statistics break them is refused with the reason,
and the round goes on with the others.

Shapes and bounds are written in terms of the job (:class:`JobSize`): ``C`` classes, ``D`` feature dimension (the
model's pooled features), ``K`` sites of the data check, and ``n_train``, the training images the site reported in
the data check. A bound is a number or a product of those names and numbers (``"n_train"``, ``"C * n_train"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np

from .privacy import ClassStat

__all__ = ["StatSpec", "JobSize", "check_statistics", "spec_of_class_stat", "statistic_specs", "ANNOTATED"]

Bound = float | int | str | None

ANNOTATED = "annotated"  # the (C,) classes a site annotates, sent with every update (fedpartial.fl.keys.META_ANNOTATED)


@dataclass(frozen=True)
class StatSpec:
    """What one metadata entry a site sends may be.

    Attributes:
        key: the metadata key.
        shape: its shape, each axis an int or a job size (``"C"``, ``"D"``, ``"K"``); ``()`` for a number.
        dtype: ``float`` (any real number), ``int`` (whole numbers, in any numeric type) or ``bool`` (True /
            False or 0 / 1).
        low, high: inclusive bounds of every value (number, job quantity such as ``"n_train"``, or None: none).
        max_row_norm: bound on the L2 norm of each row (the last axis) of a ``(..., D)`` statistic, e.g. prototypes.
        nan_where_zero: NaN is allowed exactly in the rows whose count in this other entry (``(C,)``) is 0 (a row
            the site does not hold, e.g. FedNoRo's per-class loss of a class without a sample); elsewhere every value
            must be finite. None: every value must be finite.
        required: every contribution must carry it (the rule reads it unconditionally).
        needs: entries that must come with it (the rule reads them together).
    """

    key: str
    shape: tuple[int | str, ...] = ()
    dtype: Literal["float", "int", "bool"] = "float"
    low: Bound = None
    high: Bound = None
    max_row_norm: float | None = None
    nan_where_zero: str | None = None
    required: bool = False
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobSize:
    """The job quantities a declaration's shapes and bounds refer to (None: unknown, that check is skipped).

    Attributes:
        C: classes; D: the model's feature dimension; K: sites of the data check; n_train: the sending site's
            training images as it reported them in the data check.
    """

    C: int | None = None
    D: int | None = None
    K: int | None = None
    n_train: float | None = None

    def value(self, bound: Bound) -> float | None:
        """A bound as a number (None when it names an unknown quantity, or is None)."""
        if bound is None or isinstance(bound, (int, float)):
            return None if bound is None else float(bound)
        out = 1.0
        for part in str(bound).split("*"):
            name = part.strip()
            try:
                out *= float(name)
                continue
            except ValueError:
                pass
            v = getattr(self, name, None) if name in ("C", "D", "K", "n_train") else None
            if v is None:
                if name not in ("C", "D", "K", "n_train"):
                    raise ValueError(f"unknown job quantity {name!r} in bound {bound!r}")
                return None
            out *= float(v)
        return out

    def describe(self, bound: Bound) -> str:
        v = self.value(bound)
        text = f"{v:g}"
        if bound == "n_train":
            text += " (the site's training images in the data check)"
        elif isinstance(bound, str) and "n_train" in bound:
            text += f" ({bound}, n_train: the site's training images in the data check)"
        elif isinstance(bound, str):
            text += f" ({bound})"
        return text


def spec_of_class_stat(stat: ClassStat, columns: int = 0) -> StatSpec:
    """The default declaration of a per-class statistic declared for the privacy filters: a ``count`` is
    ``(C,)`` (``(C, columns)`` when a ``mean`` statistic reads its columns) of counts in ``[0, n_train]`` (noised
    counts are not whole numbers); a ``mean`` is ``(C, D)`` finite rows (``fill`` NaN: NaN where its count is 0)
    with its counts alongside."""
    if stat.kind == "count":
        return StatSpec(stat.key, ("C", columns) if columns else ("C",), "float", 0.0, "n_train")
    needs = () if stat.counts in (None, "support") else (stat.counts,)
    nan = (
        stat.counts
        if (math.isnan(stat.fill) and stat.counts not in (None, "support") and stat.column is None)
        else None
    )
    return StatSpec(
        stat.key, ("C", "D"), "float", needs=needs + ((stat.valid,) if stat.valid else ()), nan_where_zero=nan
    )


def statistic_specs(
    per_class: Sequence[ClassStat] = (), declared: Sequence[StatSpec] = (), required: Iterable[str] = ()
) -> dict[str, StatSpec]:
    """Every declaration of a method by key: the classes a site annotates (``(C,)`` bool, every method), the
    defaults of its per-class statistics (:func:`spec_of_class_stat`), then its own declarations (a key declared
    both ways takes its own), with the keys its rule reads from every contribution (``required``) made required."""
    columns: dict[str, int] = {}
    for s in per_class:
        if s.kind == "mean" and s.counts not in (None, "support") and s.column is not None:
            columns[s.counts] = max(columns.get(s.counts, 0), s.column + 1)
    out: dict[str, StatSpec] = {ANNOTATED: StatSpec(ANNOTATED, ("C",), "bool")}
    for s in per_class:
        out[s.key] = spec_of_class_stat(s, columns.get(s.key, 0))
    for s in declared:
        out[s.key] = s
    for key in required:
        out[key] = replace(out.get(key) or StatSpec(key), required=True)
    return out


def _where(flat_index: int, shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat_index, shape)) + "]" if shape else ""


def _as_array(value) -> np.ndarray | None:
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged nested lists, ...
        return None
    return a if a.dtype.kind in "biuf" else None


def check_one(value, spec: StatSpec, job: JobSize, meta: Mapping | None = None) -> str | None:
    """Why ``value`` breaks ``spec`` (one line naming the entry, what is wrong and an example), or None."""
    name = f"statistic '{spec.key}'"
    a = _as_array(value)
    if a is None:
        return f"{name} is not an array of numbers ({type(value).__name__})"
    want = []
    for axis in spec.shape:
        want.append(axis if isinstance(axis, int) else getattr(job, axis))
    if a.ndim != len(want) or any(w is not None and int(w) != n for w, n in zip(want, a.shape)):
        shown = (
            "("
            + ", ".join(
                f"{ax}={w}" if isinstance(ax, str) and w is not None else str(ax) for ax, w in zip(spec.shape, want)
            )
            + ("," if len(want) == 1 else "")
            + ")"
        )
        return f"{name} has shape {tuple(a.shape)}, expected {shown}"
    if a.size == 0:
        return None
    x = a.astype(np.float64, copy=False)
    bad = ~np.isfinite(x)
    if bad.any():
        allowed = np.zeros_like(bad)
        if spec.nan_where_zero and meta is not None and spec.nan_where_zero in meta:
            counts = _as_array(meta[spec.nan_where_zero])
            if counts is not None and counts.shape == a.shape[:1]:
                allowed = np.isnan(x) & (counts == 0).reshape((-1,) + (1,) * (a.ndim - 1))
        wrong = bad & ~allowed
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            extra = f" (NaN only where '{spec.nan_where_zero}' is 0)" if spec.nan_where_zero else ""
            return f"{name} has {int(wrong.sum())} non-finite value(s){extra}, e.g. {x.flat[i]} at {_where(i, a.shape)}"
        x = np.where(bad, 0.0, x)
    if spec.dtype == "bool" and not np.isin(x, (0.0, 1.0)).all():
        i = int(np.flatnonzero(~np.isin(x, (0.0, 1.0)))[0])
        return f"{name} must be True / False (0 / 1), got {x.flat[i]:g} at {_where(i, a.shape)}"
    if spec.dtype == "int" and not (x == np.round(x)).all():
        i = int(np.flatnonzero(x != np.round(x))[0])
        return f"{name} must hold whole numbers, got {x.flat[i]:g} at {_where(i, a.shape)}"
    for bound, side in ((spec.low, "below"), (spec.high, "above")):
        v = job.value(bound)
        if v is None:
            continue
        out = x < v if side == "below" else x > v
        if out.any():
            i = int(np.flatnonzero(out)[0])
            return (
                f"{name} has {int(out.sum())} value(s) {side} {job.describe(bound)}, e.g. {x.flat[i]:g} at "
                f"{_where(i, a.shape)}"
            )
    if spec.max_row_norm is not None and a.ndim >= 1:
        with np.errstate(over="ignore"):
            norms = np.linalg.norm(x, axis=-1)  # inf where the squares overflow: above any bound
        over = norms > float(spec.max_row_norm)
        if np.any(over):
            i = int(np.flatnonzero(over)[0])
            return (
                f"{name} has {int(np.sum(over))} row(s) of L2 norm above {spec.max_row_norm:g}, e.g. "
                f"{float(np.ravel(norms)[i]):.4g} at row {_where(i, norms.shape) or '[]'}"
            )
    return None


def check_statistics(meta: Mapping, specs: Mapping[str, StatSpec] | Sequence[StatSpec], job: JobSize) -> str | None:
    """Why a contribution's metadata breaks its method's declarations, or None.

    Every declared entry present is checked (:func:`check_one`); a ``required`` entry, or one another present entry
    ``needs``, must be there.

    Args:
        meta: the contribution's metadata (numbers, lists, numpy arrays).
        specs: the method's declarations (:func:`statistic_specs`).
        job: the job's sizes and the site's data-check counts.
    """
    specs = specs if isinstance(specs, Mapping) else {s.key: s for s in specs}
    for key, spec in specs.items():
        if key not in meta:
            if spec.required:
                return f"statistic '{key}' is missing (the method's server rule reads it from every site)"
            continue
        for other in spec.needs:
            if other not in meta:
                return f"statistic '{key}' came without '{other}', which the server reads with it"
        why = check_one(meta[key], spec, job, meta)
        if why:
            return why
    return None
