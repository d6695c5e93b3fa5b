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

Multilabel (one sigmoid per class, thresholded at ``threshold``):
    per class ``auc``, ``ap``, ``bacc`` ((TPR + TNR) / 2), ``f1``, ``precision``, ``recall``;
    macro ``auc``, ``map`` (mean per-class AP), ``bacc``, ``f1``, ``precision``, ``recall``.
    A class needs both outcomes among its (annotated) rows for ``auc`` / ``ap`` / ``bacc``; F1, precision and
    recall need at least one annotated row (``zero_division=0``).
Multiclass (softmax, argmax prediction):
    per class ``auc`` (one-vs-rest), ``sensitivity``, ``specificity``, ``f1``, ``precision``, ``recall``;
    macro ``auc``, ``accuracy``, ``bacc`` (balanced accuracy), ``f1``, ``precision``, ``recall`` (sklearn,
    ``labels=range(C)``, ``zero_division=0``, so absent classes count as 0), ``sensitivity``, ``specificity``
    (means over the classes where they are defined).

:func:`flatten_metrics` turns a result into ``{"auc": .., "auc/epidural": ..}`` (finite floats only) and
:func:`format_table` into a per-class table in percent.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    confusion_matrix,
    f1_score,
    precision_score,
    recall_score,
    roc_auc_score,
)

__all__ = ["multilabel_metrics", "multiclass_metrics", "compute_metrics", "flatten_metrics", "format_table"]

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
        raise ValueError(f"probs contains {len(bad)} NaN value(s) (first at row {bad[0][0]}, column {bad[0][1]}); "
                         "the model output diverged or the input was not normalised")
    if probs.size and (probs.min() < -1e-6 or probs.max() > 1 + 1e-6):
        raise ValueError(f"probs must lie in [0, 1] (got range [{probs.min():.4g}, {probs.max():.4g}]); "
                         "pass sigmoid / softmax outputs, not logits")
    return probs


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _result(task: str, n: int, classes: Sequence[str], per_class: dict, macro: dict, undefined_for: dict) -> dict:
    """Assemble the common result dict; ``undefined_for`` maps macro name -> per-class metric name."""
    undef = {m: [c for c in classes if per_class[c][pm] is None] for m, pm in undefined_for.items()}
    return {"task": task, "n": int(n), "macro": macro, "per_class": per_class,
            "n_undefined": {m: len(v) for m, v in undef.items()}, "undefined_classes": undef}


def multilabel_metrics(y_true: np.ndarray, probs: np.ndarray, classes: Sequence[str], threshold: float = 0.5,
                       mask: np.ndarray | None = None) -> dict:
    """Per-class and macro metrics for multilabel (one binary problem per class) predictions.

    Args:
        y_true: ``(N, C)`` 0/1 labels (values outside the mask are ignored).
        probs: ``(N, C)`` probabilities in [0, 1].
        classes: ``C`` class names, in column order.
        threshold: a class is predicted positive when its probability is ``>= threshold``.
        mask: optional ``(N, C)`` bool, True where the entry is annotated; class ``c`` is evaluated only over
            the rows where ``mask[:, c]`` is True.
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

    per_class: dict[str, dict[str, float | None]] = {}
    for c, name in enumerate(classes):
        rows = mask[:, c]
        yt, p = y_true[rows, c].astype(int), probs[rows, c]
        pred = (p >= threshold).astype(int)
        m: dict[str, float | None] = dict.fromkeys(ML_CLASS_METRICS)
        if len(yt):
            for key, fn in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score)):
                m[key] = float(fn(yt, pred, zero_division=0))
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
    return _result("multilabel", len(y_true), classes, per_class, macro, ML_MACRO)


def multiclass_metrics(y_true: np.ndarray, probs: np.ndarray, classes: Sequence[str],
                       mask: np.ndarray | None = None) -> dict:
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
    if y_true.ndim == 2:
        if y_true.shape != probs.shape or not (np.isin(y_true, (0, 1)).all() and (y_true.sum(1) == 1).all()):
            raise ValueError(f"2-D y_true must be one-hot with shape {probs.shape}")
        y_true = y_true.argmax(1)
    y_true = y_true.reshape(-1).astype(int) if y_true.size else np.zeros(0, int)
    if len(y_true) != len(probs):
        raise ValueError(f"y_true has {len(y_true)} rows, probs has {len(probs)}")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != y_true.shape:
            raise ValueError(f"multiclass mask must have shape (N,) = {y_true.shape}, got {mask.shape}")
        y_true, probs = y_true[mask], probs[mask]
    if len(y_true) and (y_true.min() < 0 or y_true.max() >= C):
        raise ValueError(f"y_true class indices must lie in [0, {C})")

    n = len(y_true)
    per_class = {name: dict.fromkeys(MC_CLASS_METRICS) for name in classes}
    macro: dict[str, float | None] = dict.fromkeys(
        ("auc", "accuracy", "bacc", "f1", "precision", "recall", "sensitivity", "specificity"))
    if n:
        pred = probs.argmax(1)
        labels = list(range(C))
        cm = confusion_matrix(y_true, pred, labels=labels)
        kw = dict(labels=labels, average=None, zero_division=0)
        f1, prec, rec = f1_score(y_true, pred, **kw), precision_score(y_true, pred, **kw), recall_score(y_true, pred, **kw)
        for c, name in enumerate(classes):
            tp, pos, pred_pos = cm[c, c], cm[c].sum(), cm[:, c].sum()
            tn = n - pos - pred_pos + tp
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
            f1=float(f1.mean()), precision=float(prec.mean()), recall=float(rec.mean()),
            sensitivity=_mean([per_class[c]["sensitivity"] for c in classes]),
            specificity=_mean([per_class[c]["specificity"] for c in classes]),
        )
    return _result("multiclass", n, classes, per_class, macro,
                   {"auc": "auc", "sensitivity": "sensitivity", "specificity": "specificity"})


def compute_metrics(task: str, y_true: np.ndarray, probs: np.ndarray, classes: Sequence[str],
                    mask: np.ndarray | None = None, threshold: float = 0.5) -> dict:
    """Dispatch on ``task``: ``"multilabel"`` -> :func:`multilabel_metrics` (``mask`` ``(N, C)``),
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
        cols = [("BACC", "bacc", "bacc"), ("AUC", "auc", "auc"), ("AP", "ap", "map"),
                ("F1", "f1", "f1"), ("Prec", "precision", "precision"), ("Rec", "recall", "recall")]
    else:
        cols = [("AUC", "auc", "auc"), ("Sens", "sensitivity", "sensitivity"), ("Spec", "specificity", "specificity"),
                ("F1", "f1", "f1"), ("Prec", "precision", "precision"), ("Rec", "recall", "recall")]

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
    out.append(f"n = {result['n']}" + ("; undefined, left out of the mean: " + ", ".join(
        f"{c} ({'/'.join(ks)})" for c, ks in undef.items()) if undef else ""))
    return "\n".join(out)
