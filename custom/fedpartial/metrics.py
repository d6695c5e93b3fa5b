"""Evaluation metrics (numpy in, plain python floats / dicts out).

Every ``*_metrics`` function returns the same structure::

    {
        "task": "multilabel" | "multiclass",
        "n": N,                                         # number of samples evaluated
        "macro": {metric: float | None},                # means over the classes where the metric is defined
        "per_class": {class: {metric: float | None}},   # None = undefined for that class
        "n_undefined": {metric: int},                   # classes left out of that macro mean
        "undefined_classes": {metric: [class, ...]},
    }

Multilabel (one sigmoid per class, thresholded at ``threshold``, 0.5 unless given):
    per class ``auc``, ``ap``, ``bacc`` ((TPR + TNR) / 2), ``f1``, ``precision``, ``recall``;
    macro ``auc``, ``map`` (mean per-class AP), ``bacc``, ``f1``, ``precision``, ``recall``.
    A class needs both outcomes among its (annotated) rows for ``auc`` / ``ap`` / ``bacc``; F1, precision and
    recall need at least one annotated row (``zero_division=0``).
    The result also holds ``score_hist``: per class, how many positive / negative annotated rows fall in each
    bin of the fixed score grid ``SCORE_GRID`` (see "Operating thresholds" below).
Multiclass (softmax, argmax prediction):
    per class ``auc`` (one-vs-rest), ``sensitivity``, ``specificity``, ``f1``, ``precision``, ``recall``;
    macro ``auc``, ``accuracy``, ``bacc`` (balanced accuracy), ``f1``, ``precision``, ``recall`` (sklearn,
    ``labels=range(C)``, ``zero_division=0``, so absent classes count as 0), ``sensitivity``, ``specificity``
    (means over the classes where they are defined).

:func:`flatten_metrics` turns a result into ``{"auc": .., "auc/epidural": ..}`` (finite floats only) and
:func:`format_table` into a per-class table in percent.

Operating thresholds (multi-label only; a single-label prediction is the argmax, no threshold applies):
:func:`best_threshold` / :func:`select_thresholds` choose per class the threshold that maximises Youden's J
(``"youden"``; ``"bacc"`` is the same choice, balanced accuracy being ``(1 + J) / 2``) or F1 (``"f1"``) among
the candidates of ``sklearn.metrics.roc_curve``. In a federation the sites' probabilities stay at the sites:
each evaluation sends ``score_hist`` (label counts per bin of ``SCORE_GRID``, edges ``0`` and
``sigmoid(-8, -7.9, ..., 8)``, ``0.5`` among them), the server adds the validation histograms of the sites,
chooses the thresholds on them (:func:`thresholds_from_histogram`: the same :func:`best_threshold` on the bin
edges weighted by the counts, so the chosen thresholds are grid values) and scores every validation / test
set at them exactly from its histogram (:func:`histogram_metrics`): ``bacc_val_thr``, ``f1_val_thr``,
``precision_val_thr``, ``recall_val_thr`` (:func:`apply_validation_thresholds`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

# ------------------------------------------------------------------ scikit-learn's definitions, in NumPy
# The functions below compute what scikit-learn's functions of the same name compute (precision_recall_f1: its
# precision_score / recall_score / f1_score with zero_division=0, from counts), for the calls made here (binary
# labels 0/1, or class indices with ``labels=range(C)``), with the same operations in the same order: the
# same floats (tests/test_metrics.py compares them bit for bit on random scores with ties and weights). Importing
# ``sklearn.metrics`` loads SciPy's statistics in every site and server process at the first evaluation, for these
# few lines (``python benchmarks/import_cost.py`` measures what it costs).


def _ranked_counts(y_true, y_score, sample_weight=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fps, tps, thresholds)`` at each distinct score, highest first: the positives and negatives (weighted)
    scoring at least that much (``sklearn.metrics.confusion_matrix_at_thresholds``); zero weights are left out."""
    y = (np.asarray(y_true).reshape(-1) == 1).astype(np.float64)
    s = np.asarray(y_score).reshape(-1)
    w = None if sample_weight is None else np.asarray(sample_weight, dtype=np.float64).reshape(-1)
    if w is not None:
        keep = w != 0
        y, s, w = y[keep], s[keep], w[keep]
    order = len(s) - 1 - np.argsort(s[::-1], kind="stable")[::-1]  # descending, ties in their order
    y, s = y[order], s[order]
    idx = np.r_[np.nonzero(np.diff(s))[0], len(y) - 1]
    if w is None:
        tps = np.cumsum(y * 1.0, dtype=np.float64)[idx]
        fps = 1 + idx.astype(np.float64) - tps
    else:
        w = w[order]
        tps = np.cumsum(y * w, dtype=np.float64)[idx]
        fps = np.cumsum((1 - y) * w, dtype=np.float64)[idx]
    return fps, tps, s[idx]


def roc_curve(y_true, y_score, *, sample_weight=None, drop_intermediate: bool = True):
    """``(fpr, tpr, thresholds)`` with a first point ``(0, 0)`` at threshold ``inf`` (``sklearn.metrics.roc_curve``);
    both outcomes must be present."""
    fps, tps, thr = _ranked_counts(y_true, y_score, sample_weight)
    if drop_intermediate and len(fps) > 2:  # points collinear with their neighbours: no corner, no area
        keep = np.where(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])[0]
        fps, tps, thr = fps[keep], tps[keep], thr[keep]
    tps, fps = np.r_[0.0, tps], np.r_[0.0, fps]
    thr = np.r_[np.inf, thr.astype(np.float64)]
    return fps / fps[-1], tps / tps[-1], thr


def roc_auc_score(y_true, y_score) -> float:
    """Area under the ROC curve by the trapezoidal rule (binary ``sklearn.metrics.roc_auc_score``)."""
    fpr, tpr, _ = roc_curve(y_true, y_score)
    return float((np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0).sum())


def average_precision_score(y_true, y_score) -> float:
    """Sum over the thresholds of (recall step) x precision (binary ``sklearn.metrics.average_precision_score``)."""
    fps, tps, _ = _ranked_counts(y_true, y_score)
    ps = tps + fps
    precision = np.r_[np.where(ps != 0, tps / ps, 0.0)[::-1], 1.0]
    recall = np.r_[(tps / tps[-1])[::-1], 0.0]
    return float(max(0.0, -np.sum(np.diff(recall) * precision[:-1])))


def confusion_matrix(y_true, y_pred, *, labels: Sequence[int]) -> np.ndarray:
    """``(C, C)`` int64 counts, row = true class index, column = predicted (``labels`` = ``range(C)``)."""
    C = len(labels)
    return np.bincount(np.asarray(y_true) * C + np.asarray(y_pred), minlength=C * C).reshape(C, C)


def _divide(num, den) -> np.ndarray:
    """``num / den``, 0 where ``den`` is 0 (scikit-learn's ``zero_division=0``)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    out = np.zeros(np.broadcast(num, den).shape)
    np.divide(num, den, out=out, where=den != 0)
    return out


def precision_recall_f1(tp, true, pred) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision TP / predicted, recall TP / true and F1 2 TP / (true + predicted), 0 where undefined
    (scikit-learn's ``precision_score`` / ``recall_score`` / ``f1_score`` with ``zero_division=0``), from the counts
    of true positives, positives and predicted positives (scalars or one per class)."""
    return _divide(tp, pred), _divide(tp, true), _divide(2 * tp, true + pred)


def binary_counts(y_true, y_pred) -> tuple[int, int, int]:
    """``(TP, positives, predicted positives)`` of 0/1 labels and predictions."""
    y, p = np.asarray(y_true).reshape(-1) == 1, np.asarray(y_pred).reshape(-1) == 1
    return int(np.sum(y & p)), int(np.sum(y)), int(np.sum(p))


def accuracy_score(y_true, y_pred) -> float:
    """The fraction of rows predicted right (``sklearn.metrics.accuracy_score``)."""
    return float(np.average(np.asarray(y_true) == np.asarray(y_pred)))


__all__ = [
    "multilabel_metrics",
    "multiclass_metrics",
    "compute_metrics",
    "flatten_metrics",
    "format_table",
    "best_threshold",
    "select_thresholds",
    "score_histogram",
    "thresholds_from_histogram",
    "histogram_metrics",
    "apply_validation_thresholds",
    "format_thresholds",
    "SCORE_GRID",
]

DEFAULT_THRESHOLD = 0.5
ML_CLASS_METRICS = ("auc", "ap", "bacc", "f1", "precision", "recall", "bce")
ML_MACRO = {"auc": "auc", "map": "ap", "bacc": "bacc", "f1": "f1", "precision": "precision", "recall": "recall"}
MC_CLASS_METRICS = ("auc", "sensitivity", "specificity", "f1", "precision", "recall")


def _check_probs(probs: Any, n_classes: int) -> np.ndarray:
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim == 1 and probs.size == 0:
        probs = probs.reshape(0, n_classes)
    if probs.ndim != 2 or probs.shape[1] != n_classes:
        raise ValueError(f"probs must have shape (N, {n_classes}), got {probs.shape}")
    if np.isnan(probs).any():
        bad = np.argwhere(np.isnan(probs))
        raise ValueError(
            f"probs contains {len(bad)} NaN value(s) (first at row {bad[0][0]}, column {bad[0][1]}); "
            "the model output diverged or the input was not normalised"
        )
    if probs.size and (probs.min() < -1e-6 or probs.max() > 1 + 1e-6):
        raise ValueError(
            f"probs must lie in [0, 1] (got range [{probs.min():.4g}, {probs.max():.4g}]); "
            "pass sigmoid / softmax outputs, not logits"
        )
    return probs


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _result(task: str, n: int, classes: Sequence[str], per_class: dict, macro: dict, undefined_for: dict) -> dict:
    """Assemble the common result dict; ``undefined_for`` maps macro name -> per-class metric name. The metric
    functions add ``counts``: per class the scored positives (``pos``), negatives (``neg``) and predicted
    positives (``pred``; at the threshold, or the argmax), which pool across sets by summing."""
    undef = {m: [c for c in classes if per_class[c][pm] is None] for m, pm in undefined_for.items()}
    return {
        "task": task,
        "n": int(n),
        "macro": macro,
        "per_class": per_class,
        "n_undefined": {m: len(v) for m, v in undef.items()},
        "undefined_classes": undef,
    }


def multilabel_metrics(
    y_true: np.ndarray,
    probs: np.ndarray,
    classes: Sequence[str],
    threshold: float | Sequence[float | None] = 0.5,
    mask: np.ndarray | None = None,
    histogram: bool = True,
) -> dict:
    """Per-class and macro metrics for multilabel (one binary problem per class) predictions.

    Args:
        y_true: ``(N, C)`` 0/1 labels (values outside the mask are ignored).
        probs: ``(N, C)`` probabilities in [0, 1].
        classes: ``C`` class names, in column order.
        threshold: a class is predicted positive when its probability is ``>= threshold``; one value for every
            class, or ``C`` values (None = 0.5), e.g. the thresholds chosen on validation.
        mask: optional ``(N, C)`` bool, True where the entry is annotated; class ``c`` is evaluated only over
            the rows where ``mask[:, c]`` is True.
        histogram: also return ``score_hist`` (:func:`score_histogram`).
    """
    classes = list(classes)
    C = len(classes)
    probs = _check_probs(probs, C)
    y_true = np.asarray(y_true, dtype=np.float64).reshape(-1, C) if np.size(y_true) == 0 else np.asarray(y_true)
    if y_true.shape != probs.shape:
        raise ValueError(f"y_true shape {y_true.shape} != probs shape {probs.shape}")
    mask = np.ones(y_true.shape, bool) if mask is None else np.asarray(mask, dtype=bool).reshape(y_true.shape)
    if not np.isin(y_true[mask], (0, 1)).all():
        raise ValueError("y_true must be 0/1 on the annotated entries")

    thr = _per_class_thresholds(threshold, C)
    per_class: dict[str, dict[str, float | None]] = {}
    counts: dict[str, dict[str, int]] = {}
    for c, name in enumerate(classes):
        rows = mask[:, c]
        yt, p = y_true[rows, c].astype(int), probs[rows, c]
        pred = (p >= thr[c]).astype(int)
        counts[name] = {"pos": int(yt.sum()), "neg": int(len(yt) - yt.sum()), "pred": int(pred.sum())}
        m: dict[str, float | None] = dict.fromkeys(ML_CLASS_METRICS)
        if len(yt):
            prec, rec, f1 = precision_recall_f1(*binary_counts(yt, pred))
            m.update(f1=float(f1), precision=float(prec), recall=float(rec))
        if len(yt):  # binary cross-entropy of the annotated entries (surgical aggregation's model selection)
            q = np.clip(p, 1e-7, 1 - 1e-7)
            m["bce"] = float(-np.mean(yt * np.log(q) + (1 - yt) * np.log(1 - q)))
        if 0 < yt.sum() < len(yt):  # both outcomes present
            m["auc"] = float(roc_auc_score(yt, p))
            m["ap"] = float(average_precision_score(yt, p))
            tpr = float((pred[yt == 1] == 1).mean())
            tnr = float((pred[yt == 0] == 0).mean())
            m["bacc"] = (tpr + tnr) / 2
        per_class[name] = m

    macro = {k: _mean([per_class[c][pm] for c in classes]) for k, pm in ML_MACRO.items()}
    macro["bce"] = _mean([per_class[c]["bce"] for c in classes])
    out = _result("multilabel", len(y_true), classes, per_class, macro, ML_MACRO)
    out["counts"] = counts
    if histogram:
        out["score_hist"] = score_histogram(y_true, probs, classes, mask)
    return out


def _per_class_thresholds(threshold: float | Sequence[float | None], n_classes: int) -> list[float]:
    """One threshold per class (None -> 0.5)."""
    if np.ndim(threshold) == 0:
        return [DEFAULT_THRESHOLD if threshold is None else float(threshold)] * n_classes
    thr = [DEFAULT_THRESHOLD if t is None else float(t) for t in threshold]
    if len(thr) != n_classes:
        raise ValueError(f"got {len(thr)} thresholds for {n_classes} classes")
    return thr


def multiclass_metrics(
    y_true: np.ndarray, probs: np.ndarray, classes: Sequence[str], mask: np.ndarray | None = None
) -> dict:
    """Per-class and macro metrics for single-label multiclass predictions (argmax of ``probs``).

    Args:
        y_true: ``(N,)`` int class indices, or ``(N, C)`` one-hot.
        probs: ``(N, C)`` softmax probabilities.
        classes: ``C`` class names.
        mask: optional ``(N,)`` bool, the rows to evaluate.
    """
    classes = list(classes)
    C = len(classes)
    probs = _check_probs(probs, C)
    y_true = np.asarray(y_true)
    if len(y_true) != len(probs):
        raise ValueError(f"y_true has {len(y_true)} rows, probs has {len(probs)}")
    if mask is not None:  # the scored rows first: an unscored row (unlabelled, or of a class not annotated) has none
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (len(y_true),):
            raise ValueError(f"multiclass mask must have shape (N,) = ({len(y_true)},), got {mask.shape}")
        y_true, probs = y_true[mask], probs[mask]
    if y_true.ndim == 2:
        if y_true.shape[1:] != probs.shape[1:] or not (np.isin(y_true, (0, 1)).all() and (y_true.sum(1) == 1).all()):
            raise ValueError(f"2-D y_true must be one-hot with shape {probs.shape}")
        y_true = y_true.argmax(1)
    y_true = y_true.reshape(-1).astype(int) if y_true.size else np.zeros(0, int)
    if len(y_true) and (y_true.min() < 0 or y_true.max() >= C):
        raise ValueError(f"y_true class indices must lie in [0, {C})")

    n = len(y_true)
    per_class = {name: dict.fromkeys(MC_CLASS_METRICS) for name in classes}
    counts = {name: {"pos": 0, "neg": n, "pred": 0} for name in classes}
    macro: dict[str, float | None] = dict.fromkeys(
        ("auc", "accuracy", "bacc", "f1", "precision", "recall", "sensitivity", "specificity")
    )
    if n:
        pred = probs.argmax(1)
        labels = list(range(C))
        cm = confusion_matrix(y_true, pred, labels=labels)
        prec, rec, f1 = precision_recall_f1(np.diag(cm), cm.sum(1), cm.sum(0))  # per class, labels=range(C)
        for c, name in enumerate(classes):
            tp, pos, pred_pos = cm[c, c], cm[c].sum(), cm[:, c].sum()
            tn = n - pos - pred_pos + tp
            counts[name] = {"pos": int(pos), "neg": int(n - pos), "pred": int(pred_pos)}
            m = per_class[name]
            m.update(f1=float(f1[c]), precision=float(prec[c]), recall=float(rec[c]))
            if pos:
                m["sensitivity"] = float(tp / pos)
            if n - pos:
                m["specificity"] = float(tn / (n - pos))
            if 0 < pos < n:
                m["auc"] = float(roc_auc_score(y_true == c, probs[:, c]))
        macro.update(
            auc=_mean([per_class[c]["auc"] for c in classes]),
            accuracy=float(accuracy_score(y_true, pred)),
            bacc=_mean([per_class[c]["sensitivity"] for c in classes]),  # == sklearn balanced_accuracy_score
            f1=float(f1.mean()),
            precision=float(prec.mean()),
            recall=float(rec.mean()),
            sensitivity=_mean([per_class[c]["sensitivity"] for c in classes]),
            specificity=_mean([per_class[c]["specificity"] for c in classes]),
        )
    out = _result(
        "multiclass",
        n,
        classes,
        per_class,
        macro,
        {"auc": "auc", "sensitivity": "sensitivity", "specificity": "specificity"},
    )
    out["counts"] = counts
    # one class against the rest, as the per-class AUROC above: the sets' histograms pool into the AUROC of their
    # union (fedpartial.fl.results.across_sites) and the ROC / PR curves; no threshold is chosen on them (argmax)
    out["score_hist"] = score_histogram(np.eye(len(classes), dtype=int)[y_true], probs, classes)
    return out


def compute_metrics(
    task: str,
    y_true: np.ndarray,
    probs: np.ndarray,
    classes: Sequence[str],
    mask: np.ndarray | None = None,
    threshold: float | Sequence[float | None] = 0.5,
) -> dict:
    """Dispatch on ``task``: ``"multilabel"`` -> :func:`multilabel_metrics` (``mask`` ``(N, C)``, ``threshold`` one
    value or ``C``),
    ``"multiclass"`` -> :func:`multiclass_metrics` (``y_true`` ``(N,)`` indices or ``(N, C)`` one-hot,
    ``mask`` ``(N,)``)."""
    if task == "multilabel":
        return multilabel_metrics(y_true, probs, classes, threshold=threshold, mask=mask)
    if task == "multiclass":
        return multiclass_metrics(y_true, probs, classes, mask=mask)
    raise ValueError(f"unknown task {task!r}; expected 'multilabel' or 'multiclass'")


def _finite(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float, np.floating)) and math.isfinite(v)


def flatten_metrics(result: dict, prefix: str = "") -> dict[str, float]:
    """``{prefix+"auc": .., prefix+"auc/<class>": ..}`` with finite floats only (undefined entries dropped)."""
    flat = {f"{prefix}{k}": float(v) for k, v in result["macro"].items() if _finite(v)}
    for cls, ms in result["per_class"].items():
        flat.update({f"{prefix}{k}/{cls}": float(v) for k, v in ms.items() if _finite(v)})
    return flat


def format_table(result: dict, title: str = "") -> str:
    """Per-class table in percent (2 decimals), one row per class plus a ``mean`` row; ``n/a`` = undefined."""
    if result["task"] == "multilabel":
        cols = [
            ("BACC", "bacc", "bacc"),
            ("AUC", "auc", "auc"),
            ("AP", "ap", "map"),
            ("F1", "f1", "f1"),
            ("Prec", "precision", "precision"),
            ("Rec", "recall", "recall"),
        ]
    else:
        cols = [
            ("AUC", "auc", "auc"),
            ("Sens", "sensitivity", "sensitivity"),
            ("Spec", "specificity", "specificity"),
            ("F1", "f1", "f1"),
            ("Prec", "precision", "precision"),
            ("Rec", "recall", "recall"),
        ]

    def fmt(v: Any) -> str:
        return f"{100 * v:.2f}" if _finite(v) else "n/a"

    rows = [[c] + [fmt(ms[pk]) for _, pk, _ in cols] for c, ms in result["per_class"].items()]
    rows.append(["mean"] + [fmt(result["macro"].get(mk)) for _, _, mk in cols])
    header = ["class"] + [h for h, _, _ in cols]
    w0 = max(len(r[0]) for r in rows + [header])
    w = max(7, *(len(h) for h in header[1:]))
    line = lambda r: f"{r[0]:<{w0}}  " + "  ".join(f"{x:>{w}}" for x in r[1:])  # noqa: E731
    sep = "-" * len(line(header))
    out = ([title] if title else []) + [line(header), sep, *map(line, rows[:-1]), sep, line(rows[-1])]
    if result["task"] == "multiclass":
        out.append(f"accuracy: {fmt(result['macro']['accuracy'])}   balanced accuracy: {fmt(result['macro']['bacc'])}")
    undef = {c: [k for k, v in result["undefined_classes"].items() if c in v] for c in result["per_class"]}
    undef = {c: ks for c, ks in undef.items() if ks}
    out.append(
        f"n = {result['n']}"
        + (
            "; undefined, left out of the mean: " + ", ".join(f"{c} ({'/'.join(ks)})" for c, ks in undef.items())
            if undef
            else ""
        )
    )
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ operating thresholds

THRESHOLD_CRITERIA = ("youden", "bacc", "f1")
# score-histogram bin edges: 0, then sigmoid of -8 .. 8 in steps of 0.1 (fine near 0 and 1, 0.5 = sigmoid(0))
SCORE_GRID = np.concatenate(([0.0], 1.0 / (1.0 + np.exp(-np.arange(-80, 81) / 10.0))))
VAL_THR_METRICS = ("bacc", "f1", "precision", "recall")
VAL_THR = "_val_thr"  # suffix of the metrics at the thresholds chosen on validation, e.g. "bacc_val_thr"


def best_threshold(
    y_true: Any, scores: Any, criterion: str = "youden", sample_weight: Any | None = None
) -> float | None:
    """The operating threshold of one binary problem (predict positive when ``score >= threshold``) that
    maximises ``criterion``, among the thresholds of ``sklearn.metrics.roc_curve`` (the distinct scores).

    Args:
        y_true: ``(N,)`` 0/1.
        scores: ``(N,)`` probabilities.
        criterion: ``"youden"``: J = TPR + TNR - 1; ``"bacc"``: (TPR + TNR) / 2 = (1 + J) / 2, so the same
            threshold; ``"f1"``: 2 TP / (2 TP + FP + FN).
        sample_weight: optional ``(N,)`` non-negative weights (the counts of a score histogram).

    Returns:
        The threshold (one of ``scores``), or None when the rows do not hold both outcomes. ``roc_curve``'s
        extra first point (threshold above every score: nothing positive) is not a candidate: its J (0) and F1
        (0) never beat "everything positive" (the lowest score: J = 0, F1 > 0). Ties: the highest maximising
        threshold (the fewest positive predictions).
    """
    if criterion not in THRESHOLD_CRITERIA:
        raise ValueError(f"unknown threshold criterion {criterion!r}; expected one of {THRESHOLD_CRITERIA}")
    y = np.asarray(y_true).astype(int).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    w = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64).reshape(-1)
    keep = w > 0
    y, s, w = y[keep], s[keep], w[keep]
    pos, neg = w[y == 1].sum(), w[y == 0].sum()
    if pos <= 0 or neg <= 0:
        return None
    fpr, tpr, thr = roc_curve(y, s, sample_weight=w, drop_intermediate=False)
    fpr, tpr, thr = fpr[1:], tpr[1:], thr[1:]  # thresholds decreasing
    if criterion == "f1":
        tp, fp = tpr * pos, fpr * neg
        value = 2 * tp / (tp + fp + pos)  # 2 TP + FP + FN = TP + FP + P
    else:
        value = tpr - fpr
    return float(thr[int(np.flatnonzero(value >= value.max() - 1e-12)[0])])


def select_thresholds(
    y_true: Any, probs: Any, mask: Any | None = None, criterion: str = "youden"
) -> list[float | None]:
    """Per class, :func:`best_threshold` over its annotated rows.

    Args:
        y_true: ``(N, C)`` 0/1; probs: ``(N, C)``; mask: optional ``(N, C)`` bool (annotated entries).

    Returns:
        ``C`` thresholds (None where the class lacks an outcome: use 0.5).
    """
    probs = np.asarray(probs, dtype=np.float64)
    y_true = np.asarray(y_true).reshape(probs.shape)
    mask = np.ones(probs.shape, bool) if mask is None else np.asarray(mask, dtype=bool).reshape(probs.shape)
    return [best_threshold(y_true[mask[:, c], c], probs[mask[:, c], c], criterion) for c in range(probs.shape[1])]


def score_histogram(y_true: Any, probs: Any, classes: Sequence[str], mask: Any | None = None) -> dict:
    """Per class, the annotated positives / negatives in each bin of ``SCORE_GRID`` (bin ``j`` holds the scores
    ``SCORE_GRID[j] <= p < SCORE_GRID[j + 1]``, the last bin up to 1), so ``p >= SCORE_GRID[j]`` exactly when
    ``p`` lies in bin ``j`` or above.

    Args:
        y_true: ``(N, C)`` 0/1; probs: ``(N, C)``; classes: ``C`` names; mask: optional ``(N, C)`` bool.

    Returns:
        ``{"classes": [C names], "pos": C lists of B ints, "neg": C lists of B ints}`` (B = ``len(SCORE_GRID)``).
    """
    probs = np.asarray(probs, dtype=np.float64).reshape(-1, len(classes))
    y_true = np.asarray(y_true).reshape(probs.shape)
    mask = np.ones(probs.shape, bool) if mask is None else np.asarray(mask, dtype=bool).reshape(probs.shape)
    n_bins = len(SCORE_GRID)
    bins = np.clip(np.searchsorted(SCORE_GRID, probs, side="right") - 1, 0, n_bins - 1)
    out: dict = {"classes": list(classes), "pos": [], "neg": []}
    for c in range(probs.shape[1]):
        b, y = bins[mask[:, c], c], y_true[mask[:, c], c]
        out["pos"].append(np.bincount(b[y == 1], minlength=n_bins).astype(int).tolist())
        out["neg"].append(np.bincount(b[y == 0], minlength=n_bins).astype(int).tolist())
    return out


def _check_hist(hist: Mapping) -> None:
    for key in ("pos", "neg"):
        if any(len(row) != len(SCORE_GRID) for row in hist[key]):
            raise ValueError(f"score histogram rows must have {len(SCORE_GRID)} bins (SCORE_GRID)")


def pool_histograms(hists: Sequence[Mapping]) -> dict:
    """The sum of several sets' score histograms (same classes): the histogram of their union."""
    first = hists[0]
    for h in hists:
        _check_hist(h)
        if list(h["classes"]) != list(first["classes"]):
            raise ValueError(f"score histograms of different classes: {h['classes']} != {first['classes']}")
    return {
        "classes": list(first["classes"]),
        **{k: np.sum([np.asarray(h[k], dtype=np.int64) for h in hists], axis=0).tolist() for k in ("pos", "neg")},
    }


def histogram_auroc(hist: Mapping) -> dict[str, float | None]:
    """Per class, the AUROC of a score histogram: the chance that a positive scores above a negative, a pair in
    the same bin counting one half (the Mann-Whitney statistic of the binned scores); None where the class lacks
    an outcome. The AUROC of several sets pooled (:func:`pool_histograms`), which a site's own AUROC cannot give."""
    _check_hist(hist)
    out: dict[str, float | None] = {}
    for name, pos, neg in zip(hist["classes"], hist["pos"], hist["neg"]):
        p, n = np.asarray(pos, np.float64), np.asarray(neg, np.float64)
        if p.sum() == 0 or n.sum() == 0:
            out[name] = None
            continue
        below = np.cumsum(n) - n  # negatives in the bins under each bin
        out[name] = float((p * below).sum() + 0.5 * (p * n).sum()) / float(p.sum() * n.sum())
    return out


def thresholds_from_histogram(hist: Mapping, criterion: str = "youden") -> list[float | None]:
    """Per class, :func:`best_threshold` on a score histogram: every bin is its lower edge weighted by its
    counts, so each chosen threshold is a ``SCORE_GRID`` value (the lower edge of the lowest bin predicted
    positive). None where the class lacks an outcome."""
    _check_hist(hist)
    y = np.r_[np.ones(len(SCORE_GRID)), np.zeros(len(SCORE_GRID))]
    scores = np.r_[SCORE_GRID, SCORE_GRID]
    return [best_threshold(y, scores, criterion, np.r_[pos, neg]) for pos, neg in zip(hist["pos"], hist["neg"])]


def histogram_metrics(hist: Mapping, thresholds: Sequence[float | None]) -> dict[str, dict[str, float | None]]:
    """Per class ``bacc``, ``f1``, ``precision``, ``recall`` at ``thresholds`` (``C`` values, None = 0.5) from a
    score histogram, with :func:`multilabel_metrics`' definitions (``bacc`` needs both outcomes, the others one
    row, ``zero_division=0``). Exact when each threshold is a ``SCORE_GRID`` value (as chosen by
    :func:`thresholds_from_histogram`, and 0.5); another value acts as the next grid value above it."""
    _check_hist(hist)
    thr = _per_class_thresholds(thresholds, len(hist["classes"]))
    out = {}
    for name, pos, neg, t in zip(hist["classes"], hist["pos"], hist["neg"], thr):
        j = int(np.searchsorted(SCORE_GRID, t, side="left"))
        tp, fn, fp, tn = sum(pos[j:]), sum(pos[:j]), sum(neg[j:]), sum(neg[:j])
        m: dict[str, float | None] = dict.fromkeys(VAL_THR_METRICS)
        if tp + fn + fp + tn:
            m["precision"] = tp / (tp + fp) if tp + fp else 0.0
            m["recall"] = tp / (tp + fn) if tp + fn else 0.0
            m["f1"] = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
        if tp + fn and fp + tn:
            m["bacc"] = (tp / (tp + fn) + tn / (fp + tn)) / 2
        out[name] = m
    return out


def with_threshold_metrics(result: Mapping, thresholds: Sequence[float | None], hist: Mapping | None = None) -> dict:
    """A copy of a multi-label ``result`` with ``<metric>_val_thr`` (``VAL_THR_METRICS`` at ``thresholds``) added
    to ``per_class`` and ``macro`` (mean over the classes where defined), from ``hist`` (default: the result's
    own ``score_hist``), without ``score_hist``."""
    hist = hist if hist is not None else result["score_hist"]
    at = histogram_metrics(hist, thresholds)
    out = {k: v for k, v in result.items() if k != "score_hist"}
    out["per_class"] = {
        c: {**ms, **{m + VAL_THR: at[c][m] for m in VAL_THR_METRICS}} for c, ms in result["per_class"].items()
    }
    out["macro"] = {**result["macro"], **{m + VAL_THR: _mean([at[c][m] for c in at]) for m in VAL_THR_METRICS}}
    return out


def apply_validation_thresholds(
    per_site: Mapping[str, Mapping | None], criterion: str = "youden"
) -> tuple[dict, dict | None]:
    """Choose per-class thresholds on the pooled validation histograms of ``per_site`` and score every set at
    them.

    Args:
        per_site: ``{site: {"val": result | None, "test": result | None}}`` (multi-label results carry
            ``score_hist``; each evaluation set appears once, see ``fedpartial.fl.executor``).
        criterion: see :func:`best_threshold`.

    Returns:
        ``(per_site copy, record)``: every result without ``score_hist``, and with ``<metric>_val_thr``
        (:func:`with_threshold_metrics`) when thresholds were chosen; ``record`` = ``{"criterion",
        "thresholds": {class: threshold | None (0.5 used)}, "n_val": {class: annotated validation rows},
        "val_sets": number of validation sets pooled}``, or None when no validation set has a histogram
        (single-label task, or no validation data).
    """
    hists = [  # multi-label only: a single-label model predicts the argmax (its histograms are one-vs-rest)
        r["val"]["score_hist"]
        for r in per_site.values()
        if r
        and isinstance(r.get("val"), Mapping)
        and r["val"].get("score_hist")
        and r["val"].get("task") != "multiclass"
    ]
    record, thr = None, None
    if hists:
        pooled = pool_histograms(hists)
        thr = thresholds_from_histogram(pooled, criterion)
        n_val = {c: int(sum(p) + sum(n)) for c, p, n in zip(pooled["classes"], pooled["pos"], pooled["neg"])}
        record = {
            "criterion": criterion,
            "thresholds": dict(zip(pooled["classes"], thr)),
            "n_val": n_val,
            "val_sets": len(hists),
        }
    out = {}
    for site, r in per_site.items():
        if not isinstance(r, Mapping):
            out[site] = r
            continue
        out[site] = {}
        for split, res in r.items():
            if isinstance(res, Mapping) and "score_hist" in res:
                res = (
                    with_threshold_metrics(res, thr)
                    if thr is not None
                    else {k: v for k, v in res.items() if k != "score_hist"}
                )
            out[site][split] = res
    return out, record


def format_thresholds(result: Mapping, record: Mapping, title: str = "") -> str:
    """Per class: the threshold chosen on validation and the BACC / F1 of ``result`` (e.g. the test set) at 0.5
    and at that threshold, in percent; ``n/a`` = undefined."""

    def fmt(v: Any) -> str:
        return f"{100 * v:.2f}" if _finite(v) else "n/a"

    lines = ([title] if title else []) + [
        f"thresholds chosen on validation ({record['criterion']}; none chosen = 0.5):",
        "",
        "| class | threshold | BACC @ 0.5 | BACC @ thr | F1 @ 0.5 | F1 @ thr |",
        "|---|---|---|---|---|---|",
    ]
    rows = [(c, ms, record["thresholds"].get(c)) for c, ms in result["per_class"].items()]
    rows.append(("mean", result["macro"], None))
    for c, ms, t in rows:
        thr = "" if c == "mean" else ("0.5 (none)" if t is None else f"{t:.4g}")
        lines.append(
            f"| {c} | {thr} | {fmt(ms.get('bacc'))} | {fmt(ms.get('bacc' + VAL_THR))} | "
            f"{fmt(ms.get('f1'))} | {fmt(ms.get('f1' + VAL_THR))} |"
        )
    return "\n".join(lines)
