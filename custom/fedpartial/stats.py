"""Evaluation statistics of the surgical-aggregation paper, for every job and the benchmark tool (numpy /
scipy only, no NVFlare):

- :func:`bootstrap_auc_ci`: per-class AUROC with a bootstrap confidence interval (percentile method; 100
  resamples of the evaluated images with replacement, seeded; the same resamples for every class, so the macro
  mean gets one too). A resample in which a class lacks positives or negatives leaves that class out of that
  resample.
- :func:`paired_comparison`: two runs compared over their per-class AUROCs: paired t-test (``scipy.stats.
  ttest_rel``) with the Shapiro-Wilk test of the differences (the t-test assumes they are normal) and the
  Wilcoxon signed-rank test as the distribution-free check.
- :func:`own_class_scores`: for methods whose sites keep their own task block (PFL, individually trained),
  class c scored by the sites annotating c only (the paper's "evaluated per site on its classes").
- :func:`add_run_statistics`: what ``fl/results.py`` adds to ``results.json`` (one call).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

N_RESAMPLES = 100
LEVEL = 0.95


def _st():
    """``scipy.stats``, imported on first use (not at a site's start-up)."""
    from scipy import stats

    return stats


def weighted_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC of the rows of a resampled set given as multiplicities.

    Args:
        scores: ``(n,)`` predicted scores; labels: ``(n,)`` 0/1; weights: ``(B, n)`` non-negative multiplicities
            (row b = resample b: how often each image was drawn).

    Returns:
        ``(B,)`` ``P(s_pos > s_neg) + P(s_pos = s_neg) / 2`` over the weighted pairs (= ``roc_auc_score`` on the
        resampled rows); NaN where a resample has no positive or no negative.
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    uniq, inv = np.unique(scores, return_inverse=True)  # tied scores share a bin
    pos = np.zeros((w.shape[0], len(uniq)))
    neg = np.zeros((w.shape[0], len(uniq)))
    np.add.at(pos.T, inv[labels], w[:, labels].T)
    np.add.at(neg.T, inv[~labels], w[:, ~labels].T)
    neg_below = np.cumsum(neg, axis=1) - neg
    n_pos, n_neg = pos.sum(1), neg.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = (pos * (neg_below + 0.5 * neg)).sum(1) / (n_pos * n_neg)
    return np.where((n_pos > 0) & (n_neg > 0), auc, np.nan)


def resample_counts(n: int, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """``(B, n)`` multiplicities of ``B`` bootstrap resamples of ``n`` rows (``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_resamples, n))
    counts = np.zeros((n_resamples, n))
    np.add.at(counts, (np.repeat(np.arange(n_resamples), n), idx.ravel()), 1.0)
    return counts


def bootstrap_auc_ci(
    y_true: np.ndarray,
    probs: np.ndarray,
    classes: Sequence[str],
    mask: np.ndarray | None = None,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> dict:
    """Bootstrap confidence intervals of the per-class and macro AUROC.

    Args:
        y_true: ``(N, C)`` 0/1; probs: ``(N, C)`` scores; classes: C names;
        mask: ``(N, C)`` bool, the annotated entries (class c uses the drawn rows annotated for c).

    Returns:
        ``{"auc": {"per_class": {class: [low, high] | None}, "macro": [low, high] | None}, "n_resamples",
        "seed", "level"}``: percentiles ``(1 - level) / 2`` and ``(1 + level) / 2`` of the resampled AUROCs;
        None where the class's AUROC is undefined on the whole set. The macro resample value is the mean over
        the classes defined in that resample among those defined on the whole set.
    """
    y = np.asarray(y_true, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    m = np.ones(y.shape, bool) if mask is None else np.asarray(mask, dtype=bool)
    n = len(y)
    counts = resample_counts(n, n_resamples, seed) if n else np.zeros((n_resamples, 0))
    lo_q, hi_q = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    per_class, draws = {}, []
    for c, name in enumerate(classes):
        rows = m[:, c]
        yc = y[rows, c]
        if not (0 < yc.sum() < len(yc)):
            per_class[name] = None
            continue
        a = weighted_auc(p[rows, c], yc, counts[:, rows])
        draws.append(a)
        per_class[name] = _interval(a, lo_q, hi_q)
    macro = None
    if draws:
        with np.errstate(invalid="ignore"), _quiet():
            mean = np.nanmean(np.stack(draws), axis=0)
        macro = _interval(mean, lo_q, hi_q)
    return {
        "auc": {"per_class": per_class, "macro": macro},
        "n_resamples": int(n_resamples),
        "seed": int(seed),
        "level": float(level),
    }


def _interval(values: np.ndarray, lo_q: float, hi_q: float) -> list[float] | None:
    v = values[np.isfinite(values)]
    return [float(np.percentile(v, lo_q)), float(np.percentile(v, hi_q))] if len(v) else None


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def wilson_interval(k: float, n: int, z: float = 1.959964) -> list[float] | None:
    """95 % Wilson score interval ``[lo, hi]`` of a proportion ``k / n`` (sensitivity = TP / positives,
    specificity = TN / negatives); None for ``n`` = 0. Unlike the normal approximation it stays inside [0, 1] and
    is not empty at 0 / n or n / n (8 of 8 positives found: [0.676, 1])."""
    if not n:
        return None
    p = float(k) / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, centre - half), min(1.0, centre + half)]


def f1_interval(
    sensitivity: float, specificity: float, n_pos: int, n_neg: int, draws: int = 2000, seed: int = 0
) -> list[float] | None:
    """95 % parametric-bootstrap interval of a class's F1 from its confusion counts: ``TP ~ Bin(n_pos, sens)``,
    ``FP ~ Bin(n_neg, 1 - spec)``, F1 = 2 TP / (2 TP + FP + FN) per draw (seeded); None without positives."""
    if not n_pos or sensitivity is None or specificity is None:
        return None
    rng = np.random.default_rng(seed)
    tp = rng.binomial(n_pos, min(max(sensitivity, 0.0), 1.0), draws)
    fp = rng.binomial(n_neg, min(max(1.0 - specificity, 0.0), 1.0), draws) if n_neg else np.zeros(draws, int)
    den = 2 * tp + fp + (n_pos - tp)
    f1 = np.where(den > 0, 2 * tp / np.maximum(den, 1), 0.0)
    return [float(np.quantile(f1, 0.025)), float(np.quantile(f1, 0.975))]


def per_class_auc(result: Mapping) -> dict[str, float]:
    """``{class: auc}`` of a ``fedpartial.metrics`` result, defined classes only."""
    return {
        c: float(v["auc"])
        for c, v in (result.get("per_class") or {}).items()
        if v.get("auc") is not None and math.isfinite(v["auc"])
    }


def paired_comparison(a: Mapping[str, float], b: Mapping[str, float], alpha: float = 0.05) -> dict:
    """Compare two runs over the classes both score (paired by class).

    Args:
        a, b: ``{class: AUROC}`` (e.g. :func:`per_class_auc` of two runs' test results).

    Returns:
        ``{"classes", "n", "mean_a", "mean_b", "mean_diff" (a - b), "t", "p" (two-sided paired t-test),
        "shapiro_w", "shapiro_p" (None for n < 3), "normal" (shapiro_p >= alpha), "wilcoxon_p",
        "significant" (p < alpha)}``; statistics None where undefined (n < 2, or all differences equal).
    """
    classes = [c for c in a if c in b and a[c] is not None and b[c] is not None]
    x = np.asarray([a[c] for c in classes], dtype=np.float64)
    y = np.asarray([b[c] for c in classes], dtype=np.float64)
    d = x - y
    out = {
        "classes": classes,
        "n": len(classes),
        "mean_a": _f(x.mean()) if len(x) else None,
        "mean_b": _f(y.mean()) if len(y) else None,
        "mean_diff": _f(d.mean()) if len(d) else None,
        "t": None,
        "p": None,
        "shapiro_w": None,
        "shapiro_p": None,
        "normal": None,
        "wilcoxon_p": None,
        "significant": None,
    }
    if len(d) >= 2 and np.ptp(d) > 0:
        t = _st().ttest_rel(x, y)
        out.update(t=_f(t.statistic), p=_f(t.pvalue), significant=bool(t.pvalue < alpha))
    if len(d) >= 3 and np.ptp(d) > 0:
        s = _st().shapiro(d)
        out.update(shapiro_w=_f(s.statistic), shapiro_p=_f(s.pvalue), normal=bool(s.pvalue >= alpha))
    if len(d) >= 1 and np.any(d != 0):
        out["wilcoxon_p"] = _f(_st().wilcoxon(x, y).pvalue)
    return out


def _f(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def stars(p: float | None) -> str:
    """The paper's notation: ns, * (< 0.05), ** (< 0.01), *** (< 0.001)."""
    if p is None:
        return "n/a"
    return "***" if p < 1e-3 else "**" if p < 1e-2 else "*" if p < 0.05 else "ns"


def own_class_scores(
    per_site: Mapping[str, Mapping],
    annotated: Mapping[str, Sequence[bool]],
    classes: Sequence[str],
    metric: str = "auc",
) -> dict:
    """Class c scored by the sites that annotate it: the mean of their own models' ``metric`` on c.

    Args:
        per_site: ``{site: metrics result}`` (each site's own model on its evaluation data).
        annotated: ``{site: (C,) bool}`` the classes each site trains on.

    Returns:
        ``{"per_class": {class: mean | None}, "macro": mean over the scored classes | None, "sites":
        {class: [sites]}}``.
    """
    per_class, who = {}, {}
    for j, c in enumerate(classes):
        vals, sites = [], []
        for s, res in per_site.items():
            v = ((res or {}).get("per_class") or {}).get(c, {}).get(metric)
            if s in annotated and bool(annotated[s][j]) and v is not None:
                vals.append(float(v))
                sites.append(s)
        per_class[c] = float(np.mean(vals)) if vals else None
        who[c] = sites
    defined = [v for v in per_class.values() if v is not None]
    return {"per_class": per_class, "macro": float(np.mean(defined)) if defined else None, "sites": who}


def add_run_statistics(results: dict, sites: Mapping[str, Mapping] | None = None) -> dict:
    """Complete a run's ``results.json`` content in place (called once by ``fl/results.py``):

    - a pooled evaluation built from several sites' sets cannot carry one site's bootstrap interval: its
      ``ci`` becomes None there (each site's own interval stays in its per-site result);
    - when the sites keep their own task block (``local_parts`` has ``classifier``) or their whole model
      (``individual``), ``final[model]["own_classes"]`` = :func:`own_class_scores` of the per-site test results.

    ``sites``: the data summary's ``{site: {"annotated": (C,) bool, ...}}``.
    """
    pooled = [r.get(s) for r in results.get("rounds", []) for s in ("val", "test")]
    pooled += [f.get(s) for f in (results.get("final") or {}).values() for s in ("val", "test")]
    for res in pooled:
        if res and "ci" in res and res.get("n_sites", 1) > 1:
            res["ci"] = None
    own = "classifier" in (results.get("local_parts") or []) or results.get("method") == "individual"
    if own and sites:
        annotated = {s: list(info.get("annotated", [])) for s, info in sites.items()}
        for f in (results.get("final") or {}).values():
            per_site = {s: (r or {}).get("test") for s, r in (f.get("per_site") or {}).items()}
            test = f.get("test") or {}
            classes = list((test.get("per_class") or {}).keys())
            if per_site and classes:
                f["own_classes"] = own_class_scores(per_site, annotated, classes)
    return results
