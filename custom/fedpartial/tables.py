"""Result tables in the layout of the papers (method-agnostic).

FedMLP's Tables 1-2: one row per method, for each partial-annotation setting ("missing k classes") the macro
BACC, AUC and mAP of the last-round global model on the test set, then their average over the settings.
Single-label tasks (FedLSM's ISIC table) use AUC, accuracy, F1, precision and recall instead. With several
seeds a cell reads ``mean ± std`` (population std over seeds), in percent.

    >>> paper_table({"FedAvg": {"missing 4 classes": [{"bacc": .5, "auc": .76, "map": .33}]}}, "multilabel")
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

import numpy as np

TABLE_METRICS: dict[str, tuple[tuple[str, str], ...]] = {
    "multilabel": (("BACC", "bacc"), ("AUC", "auc"), ("mAP", "map")),
    "multiclass": (("AUC", "auc"), ("Acc", "accuracy"), ("F1", "f1"), ("Prec", "precision"), ("Rec", "recall")),
}


def setting_label(annotated: np.ndarray | Sequence[Sequence[bool]]) -> str:
    """Name a partial-annotation setting from the sites' annotated classes ``(K, C)`` bool: "missing k classes"
    when every site misses the same number of classes (FedMLP's settings), "full labels" when none misses one,
    otherwise "K sites x a..b classes"."""
    a = np.asarray(annotated, dtype=bool)
    if a.ndim != 2 or a.size == 0:
        return "unknown"
    missing = a.shape[1] - a.sum(1)
    if (missing == 0).all():
        return "full labels"
    if (missing == missing[0]).all():
        k = int(missing[0])
        return f"missing {k} class{'es' if k > 1 else ''}"
    lo, hi = int(a.sum(1).min()), int(a.sum(1).max())
    return f"{a.shape[0]} sites x {lo}..{hi} classes"


def mean_std(values: Sequence[float | None]) -> tuple[float, float, int] | None:
    """``(mean, population std, count)`` of the finite values (None and NaN skipped); None when there is none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None
    return statistics.mean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0), len(vals)


def cell(values: Sequence[float | None]) -> str:
    """Percent with 2 decimals; ``mean ± std`` when there are several values; ``n/a`` when none is defined."""
    s = mean_std(values)
    if s is None:
        return "n/a"
    mean, std, n = s
    return f"{100 * mean:.2f}" if n == 1 else f"{100 * mean:.2f} ± {100 * std:.2f}"


def paper_table(results: Mapping[str, Mapping[str, Sequence[Mapping[str, float | None]]]], task: str,
                settings: Sequence[str] | None = None, average: bool = True) -> str:
    """Markdown table: rows = methods, column groups = settings (each with the task's metrics), plus an
    ``Average`` group over the settings (per seed index, then mean ± std) when there are several settings.

    Args:
        results: ``{method: {setting: [macro metric dict per seed]}}`` (``fedpartial.metrics`` macro layout).
        task: 'multilabel' or 'multiclass' (selects the metrics).
        settings: column order (default: order of first appearance).
    """
    metrics = TABLE_METRICS[task]
    if settings is None:
        settings = list(dict.fromkeys(s for per in results.values() for s in per))
    groups = list(settings) + (["Average"] if average and len(settings) > 1 else [])
    head = ["Method"] + [f"{g}: {name}" for g in groups for name, _ in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, per in results.items():
        cells = [method]
        for g in groups:
            for _, key in metrics:
                if g == "Average":
                    runs = [per.get(s, []) for s in settings]
                    n = min((len(r) for r in runs), default=0)
                    vals = []
                    for i in range(n):  # the average over settings of seed i
                        s = mean_std([r[i].get(key) for r in runs])
                        vals.append(None if s is None or s[2] < len(runs) else s[0])
                else:
                    vals = [m.get(key) for m in per.get(g, [])]
                cells.append(cell(vals))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_class_table(results: Mapping[str, Sequence[Mapping]], metric_keys: Sequence[tuple[str, str]] | None = None,
                    task: str = "multilabel") -> str:
    """Markdown table of per-class metrics, rows = methods, columns = ``class: metric`` plus the macro mean.

    Args:
        results: ``{method: [full metric result per seed]}`` (``fedpartial.metrics`` layout with ``per_class``).
        metric_keys: ``(label, per-class key)`` pairs, default AUC only for multi-label (FedLSM's CXR table).
    """
    metric_keys = metric_keys or ((("AUC", "auc"),) if task == "multilabel" else (("F1", "f1"),))
    macro_of = {"ap": "map"}
    first = next(iter(results.values()))[0]
    classes = list(first["per_class"])
    head = ["Method"] + [f"{c}: {lab}" for c in classes for lab, _ in metric_keys] + [f"mean: {lab}" for lab, _ in metric_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in results.items():
        cells = [method]
        cells += [cell([r["per_class"][c].get(k) for r in runs]) for c in classes for _, k in metric_keys]
        cells += [cell([r["macro"].get(macro_of.get(k, k)) for r in runs]) for _, k in metric_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
