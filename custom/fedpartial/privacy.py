"""What leaves a site: per-class statistics, their minimum count, clipping and the Gaussian mechanism.

NVFlare-free maths; :mod:`fedpartial.fl.privacy` wires it into the site's privacy policy (NVFlare scopes).

A method declares the per-class statistics it sends (``LocalTrainer.per_class_metadata``, a tuple of
:class:`ClassStat`); everything here works from those declarations, never from method names.

Minimum count (every site, every job): a row of a per-class statistic computed from fewer than ``min_count``
images (but at least one) does not leave the site (:func:`suppress_small`).

Differential privacy (a site's ``strict`` scope): the privacy unit is one training image of the site, neighbouring
data sets differ by adding or removing one image. Each declared statistic is released with the Gaussian mechanism
(:func:`release`):

- ``count`` statistics (``(C,)`` or ``(C, 2)``): one image adds at most 1 to one entry per class, so the L2
  sensitivity is ``sqrt(C)``; the noised counts are clamped to ``[0, n_train]``.
- ``mean`` statistics (rows = means of per-image vectors, e.g. FedMLP's prototypes): the method clips every
  vector to L2 norm ``B`` (the scope's ``feature_clip``) before the mean, the site noises the row sums
  ``mean * count`` (L2 sensitivity ``B * sqrt(C)``: one image enters one row per class) and divides by the
  already noised counts (post-processing).
- after the noise, rows whose noised count is below ``min_count`` are dropped (thresholding after the noise,
  so the decision itself is private).

Every statistic released in a round is one Gaussian event with noise multiplier ``z`` (std = ``z`` x
sensitivity). ``z`` is set once per job from the site's (epsilon, delta) budget over the planned rounds and the
number of statistics the method declares (:func:`noise_multiplier`, Google's ``dp-accounting``: RDP accountant
and its calibration); the budget spent is computed from the events actually released (:func:`epsilon_spent`),
so a site that sits rounds out spends less. No subsampling amplification is claimed (statistics are computed
over the site's whole training set).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, Sequence

import numpy as np

__all__ = [
    "ClassStat",
    "suppress_small",
    "suppress_metrics",
    "noise_multiplier",
    "epsilon_spent",
    "release",
    "clip_rows",
    "stat_sensitivity",
    "as_dicts",
    "from_dicts",
    "strip_paths",
    "DEFAULT_MIN_COUNT",
]

DEFAULT_MIN_COUNT = 5


@dataclass(frozen=True)
class ClassStat:
    """One per-class statistic a method sends in its round metadata.

    Attributes:
        key: the metadata key.
        kind: ``count`` (per-class image counts, ``(C,)`` or ``(C, 2)``), ``mean`` (``(C, D)`` rows: the mean of
            per-image vectors of norm at most ``feature_clip`` over the images counted by ``counts``).
        counts: for ``mean``: the metadata key of the counts behind each row (``column`` picks a column of a
            ``(C, 2)`` count), or ``"support"``: the site's annotated training positives of each class (when the
            method sends no counts; a filled row, per ``valid``, of a class with fewer annotated positives than
            the minimum, e.g. one from pseudo labels, is not sent). None for ``count`` (its own values).
        column: column of ``counts`` (None: ``counts`` is ``(C,)``).
        valid: optional metadata key of a ``(C,)`` 0/1 list marking the rows the site filled (set to 0 for a
            suppressed row).
        dp: whether the method clips per image so that the Gaussian mechanism applies; a site whose policy asks
            for noise stops a method with a statistic that cannot be noised.
        fill: the value of a dropped ``mean`` row (0, or NaN where the server reads NaN as "no value").
    """

    key: str
    kind: Literal["count", "mean"]
    counts: str | None = None
    column: int | None = None
    valid: str | None = None
    dp: bool = True
    fill: float = 0.0


def as_dicts(stats: Sequence[ClassStat]) -> list[dict]:
    """The declarations as plain dicts (they travel with the round's metadata, for the site's filters)."""
    return [asdict(s) for s in stats]


def from_dicts(items: Sequence[dict]) -> list[ClassStat]:
    return [ClassStat(**d) for d in items or ()]


# ------------------------------------------------------------------------------------------ minimum count
def _row_counts(meta: dict, stat: ClassStat, support: np.ndarray | None) -> np.ndarray | None:
    """``(C,)`` images behind each row of ``stat`` (None when unknown)."""
    if stat.counts == "support":
        return None if support is None else np.asarray(support, dtype=np.float64)
    if stat.counts is None or stat.counts not in meta:
        return None
    c = np.asarray(meta[stat.counts], dtype=np.float64)
    return c[:, stat.column] if stat.column is not None else c


def suppress_small(
    meta: dict, stats: Sequence[ClassStat], min_count: int, support: np.ndarray | None = None
) -> tuple[dict, list[str]]:
    """Drop every row of a declared statistic computed from fewer than ``min_count`` images (but at least one).

    ``count`` entries in ``(0, min_count)`` become 0; ``mean`` rows whose count is in ``(0, min_count)`` become
    zero rows (their ``valid`` flag 0). The server leaves a row with count 0 out, as one the site does not hold.

    Args:
        meta: the round's metadata (not modified).
        stats: the method's declarations.
        support: ``(C,)`` the site's annotated training positives (for statistics declared ``counts="support"``).

    Returns:
        ``(new meta, ["key[c]" or "key[c, j]", ...] dropped)``.
    """
    out, dropped = dict(meta), []
    if min_count <= 1:
        return out, dropped
    for s in stats:  # rows first, from the counts as the method computed them
        if s.kind != "mean" or s.key not in meta:
            continue
        n = _row_counts(meta, s, support)
        if n is None:
            continue
        small = (n > 0) & (n < min_count)
        if s.counts == "support" and s.valid and s.valid in meta:  # a filled row the site holds too few labels
            small = (n < min_count) & (np.asarray(meta[s.valid]) > 0)  # of (e.g. from pseudo labels): not sent
        if small.any():
            raw = meta[s.key]
            v = np.array(raw, dtype=np.float64 if np.isnan(s.fill) else np.asarray(raw).dtype, copy=True)
            v[small] = s.fill
            out[s.key] = v.tolist() if isinstance(raw, list) else v
            if s.valid and s.valid in meta:
                valid = np.array(meta[s.valid], copy=True)
                valid[small] = 0
                out[s.valid] = valid.tolist() if isinstance(meta[s.valid], list) else valid
            dropped += [f"{s.key}[{c}]" for c in np.flatnonzero(small)]
    behind = {s.counts for s in stats if s.kind == "mean" and s.key in meta}  # dropped rows are named above
    for s in stats:
        if s.kind != "count" or s.key not in meta:
            continue
        raw = meta[s.key]
        v = np.array(raw, dtype=np.asarray(raw).dtype, copy=True)
        small = (v > 0) & (v < min_count)
        if small.any():
            v[small] = 0
            if s.key not in behind:
                dropped += [f"{s.key}[{', '.join(map(str, idx))}]" for idx in zip(*np.nonzero(small))]
        out[s.key] = v.tolist() if isinstance(raw, list) else v
    return out, dropped


def suppress_metrics(
    result: dict, positives: np.ndarray, negatives: np.ndarray, min_count: int
) -> tuple[dict, list[str]]:
    """A multi-label evaluation result (:mod:`fedpartial.metrics` layout) without what comes from fewer than
    ``min_count`` annotated positives or negatives of a class: the class's per-class metrics and its bootstrap
    interval become None, its score-histogram row zeros, and the macro averages are recomputed over the classes
    left (the macro interval, resampled over every class, becomes None: it cannot be recomputed here).

    Args:
        positives, negatives: ``(C,)`` annotated positives / negatives of the evaluated set, per class.

    Returns:
        ``(new result, suppressed class names)``.
    """
    classes = list(result.get("per_class", {}))
    if min_count <= 1 or not classes:
        return result, []
    pos, neg = np.asarray(positives), np.asarray(negatives)
    small = [c for i, c in enumerate(classes) if (0 < pos[i] < min_count) or (0 < neg[i] < min_count)]
    if not small:
        return result, []
    out = dict(result)
    out["per_class"] = {c: (dict.fromkeys(m) if c in small else m) for c, m in result["per_class"].items()}
    macro = dict(result.get("macro") or {})
    for k in macro:
        vals = [
            m.get(k)
            for m in out["per_class"].values()
            if isinstance(m.get(k), (int, float)) and math.isfinite(m.get(k))
        ]
        if any(k in m for m in result["per_class"].values()):
            macro[k] = float(np.mean(vals)) if vals else None
    out["macro"] = macro
    ci = result.get("ci")
    if ci and isinstance(ci.get("auc"), dict):
        auc = ci["auc"]
        out["ci"] = {
            **ci,
            "auc": {
                **auc,
                "macro": None,
                "per_class": {c: (None if c in small else v) for c, v in (auc.get("per_class") or {}).items()},
            },
        }
    if isinstance(result.get("counts"), dict):
        out["counts"] = {c: (dict.fromkeys(v) if c in small else v) for c, v in result["counts"].items()}
    if "score_hist" in result:
        h = dict(result["score_hist"])
        for key in ("pos", "neg"):
            h[key] = [[0] * len(row) if name in small else row for name, row in zip(h["classes"], h[key])]
        out["score_hist"] = h
    return out, small


# ------------------------------------------------------------------------------------------ accounting
def _accountant():
    from dp_accounting.rdp import RdpAccountant

    return RdpAccountant()


def _gaussian_events(multipliers: Sequence[float]):
    """The composition of Gaussian mechanisms, equal multipliers grouped (one self-composed event each)."""
    from collections import Counter

    import dp_accounting

    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), n)
            for z, n in sorted(Counter(float(z) for z in multipliers).items())
        ]
    )


def noise_multiplier(epsilon: float, delta: float, rounds: int, releases_per_round: int) -> float:
    """The Gaussian noise multiplier ``z`` such that ``rounds * releases_per_round`` Gaussian mechanisms of
    multiplier ``z`` spend exactly ``(epsilon, delta)`` (RDP accountant, ``dp_accounting.calibrate_dp_mechanism``)."""
    import dp_accounting

    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError(f"privacy budget: need epsilon > 0 and 0 < delta < 1, got ({epsilon}, {delta})")
    k = max(int(rounds), 1) * max(int(releases_per_round), 1)
    return float(
        dp_accounting.calibrate_dp_mechanism(
            _accountant,
            lambda z: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), k),
            float(epsilon),
            float(delta),
            bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
        )
    )


def epsilon_spent(multipliers: Sequence[float], delta: float) -> float:
    """Epsilon (at ``delta``) of the Gaussian events released so far (one multiplier per release; 0 releases: 0;
    a release without noise (multiplier 0): infinity)."""
    zs = [float(z) for z in multipliers]
    if not zs:
        return 0.0
    if min(zs) <= 0:
        return math.inf
    acc = _accountant()
    acc.compose(_gaussian_events(zs))
    return float(acc.get_epsilon(delta))


# ------------------------------------------------------------------------------------------ release
def clip_rows(x, bound: float | None):
    """Each row of ``x`` (``(N, D)`` tensor or array) scaled down to L2 norm at most ``bound`` (None / <= 0: as is)."""
    if not bound or bound <= 0:
        return x
    if hasattr(x, "norm"):  # torch
        norms = x.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return x * (bound / norms).clamp(max=1.0)
    a = np.asarray(x, dtype=np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    return a * np.minimum(bound / norms, 1.0)


def stat_sensitivity(stat: ClassStat, num_classes: int, feature_clip: float | None) -> float:
    """L2 sensitivity of one release of ``stat`` to adding or removing one image: ``sqrt(C)`` for counts (one
    image counts once per class), ``B * sqrt(C)`` for the row sums of a ``mean`` (one image enters one row per class)."""
    if stat.kind == "count":
        return math.sqrt(num_classes)
    if not feature_clip or feature_clip <= 0:
        raise ValueError(f"statistic '{stat.key}' is a mean of per-image vectors: it needs a feature_clip > 0")
    return float(feature_clip) * math.sqrt(num_classes)


def release(
    meta: dict,
    stats: Sequence[ClassStat],
    z: float,
    n_train: int,
    min_count: int,
    feature_clip: float | None,
    rng: np.random.Generator,
    support: np.ndarray | None = None,
) -> tuple[dict, list[dict]]:
    """The Gaussian mechanism on every declared statistic present in ``meta`` (see the module docstring).

    Args:
        z: noise multiplier (std = ``z`` x sensitivity).
        n_train: the site's training images (bound of a noised count).
        min_count: rows whose noised count is below it are dropped after the noise.
        feature_clip: the L2 bound the method clipped per-image vectors to (``mean`` statistics).

    Returns:
        ``(new meta, ledger entries)``; an entry per released statistic: ``name``, ``shape``, ``min_count``,
        ``noise_std``, ``noise_multiplier``, ``sensitivity``.

    Raises:
        ValueError: a statistic declared without per-image clipping (``dp=False``), or with unknown counts.
    """
    out, ledger = dict(meta), []
    present = [s for s in stats if s.key in meta]
    blocked = [s.key for s in present if not s.dp]
    if blocked:
        raise ValueError(
            f"statistic(s) {blocked} cannot be released with noise (the method does not clip them per image)"
        )
    true = {s.key: np.asarray(meta[s.key], dtype=np.float64) for s in present}
    noised: dict[str, np.ndarray] = {}
    for s in present:  # counts first: the means are divided by the noised counts
        if s.kind != "count":
            continue
        v = true[s.key]
        C = v.shape[0]
        sens = stat_sensitivity(s, C, feature_clip)
        noisy = np.clip(v + rng.normal(0.0, z * sens, size=v.shape), 0.0, float(n_train))
        noised[s.key] = noisy
        ledger.append(_entry(s, v.shape, min_count, z, sens))
    for s in present:
        if s.kind != "mean":
            continue
        v = true[s.key]
        C = v.shape[0]
        if s.counts == "support" or s.counts not in true:
            raise ValueError(
                f"statistic '{s.key}': its counts '{s.counts}' are not released with it; a mean needs "
                "released counts to be noised"
            )
        n_true = true[s.counts][:, s.column] if s.column is not None else true[s.counts]
        n_noisy = noised[s.counts][:, s.column] if s.column is not None else noised[s.counts]
        sens = stat_sensitivity(s, C, feature_clip)
        sums = v * n_true[:, None]
        noisy = (sums + rng.normal(0.0, z * sens, size=v.shape)) / np.maximum(n_noisy, 1.0)[:, None]
        noisy[n_noisy < max(min_count, 1)] = 0.0
        out[s.key] = noisy.astype(np.asarray(meta[s.key]).dtype)
        ledger.append(_entry(s, v.shape, min_count, z, sens))
    for key, noisy in noised.items():  # thresholded after the noise; counts stay whole numbers
        noisy = np.rint(noisy)
        noisy[noisy < max(min_count, 1)] = 0.0
        raw = meta[key]
        arr = noisy.astype(np.asarray(raw).dtype)
        out[key] = arr.tolist() if isinstance(raw, list) else arr
    for s in present:
        if s.kind == "mean" and s.valid and s.valid in meta:
            n_noisy = noised[s.counts][:, s.column] if s.column is not None else noised[s.counts]
            out[s.valid] = [int(v and n >= max(min_count, 1)) for v, n in zip(meta[s.valid], n_noisy)]
    return out, ledger


def _entry(s: ClassStat, shape, min_count: int, z: float, sens: float) -> dict:
    return {
        "name": s.key,
        "shape": list(shape),
        "min_count": int(min_count),
        "noise_multiplier": float(z),
        "sensitivity": float(sens),
        "noise_std": float(z * sens),
    }


# ------------------------------------------------------------------------------------------ paths
def strip_paths(text: str, roots: Sequence[str] = ()) -> str:
    """``text`` with every path under one of ``roots`` made relative to it and every other absolute path cut to
    its file name (what leaves a site never says where its files live)."""
    import os
    import re

    for r in sorted({str(r) for r in roots if r and str(r) != os.sep}, key=len, reverse=True):
        text = text.replace(r.rstrip(os.sep) + os.sep, "")
    return re.sub(r"(?<![\w.~-])(?:/[^/\s'\"`,;:()\[\]{}<>]+)+/([^/\s'\"`,;:()\[\]{}<>]+)", r"\1", text)
