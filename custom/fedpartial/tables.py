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


def paper_table(
    results: Mapping[str, Mapping[str, Sequence[Mapping[str, float | None]]]],
    task: str,
    settings: Sequence[str] | None = None,
    average: bool = True,
    not_ranked: Sequence[str] = (),
) -> str:
    """Markdown table: rows = methods, column groups = settings (each with the task's metrics), plus an
    ``Average`` group over the settings (per seed index, then mean ± std) when there are several settings. As in
    the papers, the best mean of each column is **bold** and the second best _underlined_ (italic in markdown),
    among the rows not in ``not_ranked`` (e.g. the all-labels upper bound) and only when 3 or more rows compete.

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
    columns: list[list[list[float | None]]] = []  # per column, per row: the values over seeds
    for g in groups:
        for _, key in metrics:
            col = []
            for per in results.values():
                if g == "Average":
                    runs = [per.get(s, []) for s in settings]
                    n = min((len(r) for r in runs), default=0)
                    vals = []
                    for i in range(n):  # the average over settings of seed i
                        s = mean_std([r[i].get(key) for r in runs])
                        vals.append(None if s is None or s[2] < len(runs) else s[0])
                else:
                    vals = [m.get(key) for m in per.get(g, [])]
                col.append(vals)
            columns.append(col)
    names = list(results)
    ranked = [i for i, name in enumerate(names) if name not in set(not_ranked)]
    marks = [[""] * len(names) for _ in columns]
    for c, col in enumerate(columns):
        means = {i: mean_std(col[i]) for i in ranked}
        order = sorted((i for i in ranked if means[i] is not None), key=lambda i: -round(means[i][0], 6))
        if len(order) >= 3:
            best = round(means[order[0]][0], 6)
            second = next((round(means[i][0], 6) for i in order if round(means[i][0], 6) < best), None)
            for i in order:
                m = round(means[i][0], 6)
                marks[c][i] = "**" if m == best else ("_" if m == second else "")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, method in enumerate(names):
        cells = [method] + [
            f"{marks[c][r]}{cell(col[r])}{marks[c][r]}" if cell(col[r]) != "n/a" else "n/a"
            for c, col in enumerate(columns)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_class_table(
    results: Mapping[str, Sequence[Mapping]],
    metric_keys: Sequence[tuple[str, str]] | None = None,
    task: str = "multilabel",
) -> str:
    """Markdown table of per-class metrics, rows = methods, columns = ``class: metric`` plus the macro mean.

    Args:
        results: ``{method: [full metric result per seed]}`` (``fedpartial.metrics`` layout with ``per_class``).
        metric_keys: ``(label, per-class key)`` pairs, default AUC only for multi-label (FedLSM's CXR table).
    """
    metric_keys = metric_keys or ((("AUC", "auc"),) if task == "multilabel" else (("F1", "f1"),))
    macro_of = {"ap": "map"}
    classes = list(dict.fromkeys(c for runs in results.values() for r in runs for c in r["per_class"]))  # a class
    # whose metrics a run's sites kept (fewer than the minimum count) is absent from that run: "n/a" there
    head = (
        ["Method"]
        + [f"{c}: {lab}" for c in classes for lab, _ in metric_keys]
        + [f"mean: {lab}" for lab, _ in metric_keys]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, runs in results.items():
        cells = [method]
        cells += [cell([(r["per_class"].get(c) or {}).get(k) for r in runs]) for c in classes for _, k in metric_keys]
        cells += [cell([r["macro"].get(macro_of.get(k, k)) for r in runs]) for _, k in metric_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ plots
# matplotlib is imported inside the plotting functions (the server imports this module for its tables). The
# figures are built with matplotlib's object API on the Agg canvas: no display, no pyplot state.

PLOT_LAST, PLOT_BEST = "FL_global_model.pt", "best_FL_global_model.pt"  # = fedpartial.fl.keys LAST / BEST_MODEL


def run_curve(run: Mapping, metric: str, split: str = "val") -> tuple[list[int], list[float | None]]:
    """One run's per-round macro ``metric`` on ``split``: ``(rounds, values)`` from ``rounds[i][split].macro``
    (a full ``results.json``) or ``curves[i][split]`` (a benchmark's ``--compact`` run); None where the round has
    no such evaluation."""
    if run.get("rounds"):
        points = [(r["round"], ((r.get(split) or {}).get("macro") or {}).get(metric)) for r in run["rounds"]]
    else:
        points = [(c["round"], (c.get(split) or {}).get(metric)) for c in run.get("curves") or []]
    return [int(r) for r, _ in points], [None if v is None else float(v) for _, v in points]


def curve_stats(runs: Sequence[Mapping], metric: str, split: str = "val") -> dict[str, list]:
    """Over the seeds (runs) of one configuration, per round: the mean and population std of :func:`run_curve`
    (the seeds holding a value; rounds without any left out). Returns ``{"rounds", "mean", "std", "n"}``."""
    by_round: dict[int, list[float | None]] = {}
    for run in runs:
        for r, v in zip(*run_curve(run, metric, split)):
            by_round.setdefault(r, []).append(v)
    out: dict[str, list] = {"rounds": [], "mean": [], "std": [], "n": []}
    for r in sorted(by_round):
        s = mean_std(by_round[r])
        if s is not None:
            for key, value in zip(("rounds", "mean", "std", "n"), (r, *s)):
                out[key].append(value)
    return out


def final_stats(
    runs: Mapping[str, Sequence[Mapping]], metric: str, model: str = PLOT_LAST, split: str = "test"
) -> dict[str, tuple[float, float, int] | None]:
    """Per configuration, :func:`mean_std` over seeds of the final ``model``'s macro ``metric`` on ``split``."""
    return {
        name: mean_std(
            [(((r.get("final") or {}).get(model) or {}).get(split) or {}).get("macro", {}).get(metric) for r in rs]
        )
        for name, rs in runs.items()
    }


def _figure(width: float = 7.0, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def curves_figure(runs: Mapping[str, Sequence[Mapping]], metric: str = "auc", split: str = "val"):
    """Every configuration's per-round macro ``metric`` on ``split`` (mean over seeds, a band of ± one
    population std), one line per configuration labelled with its name. Returns the matplotlib ``Figure``."""
    fig, ax = _figure()
    for name, rs in runs.items():
        s = curve_stats(rs, metric, split)
        if not s["rounds"]:
            continue
        (line,) = ax.plot(s["rounds"], s["mean"], marker="o", markersize=3, label=name)
        if any(n > 1 for n in s["n"]):
            lo = [m - d for m, d in zip(s["mean"], s["std"])]
            hi = [m + d for m, d in zip(s["mean"], s["std"])]
            ax.fill_between(s["rounds"], lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("round (global model received)")
    _integer_rounds(ax)
    ax.set_ylabel(f"macro {metric} ({split})")
    ax.set_title(f"{split} {metric} per round, mean ± std over seeds")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def final_bar_figure(
    runs: Mapping[str, Sequence[Mapping]],
    metric: str = "auc",
    models: Sequence[tuple[str, str]] = ((PLOT_LAST, "last round"), (PLOT_BEST, "best on val")),
):
    """Bars of the final test macro ``metric`` per configuration (one bar per model of ``models``, labelled with
    its label), height = mean over seeds, error bar = population std. Returns the matplotlib ``Figure``."""
    fig, ax = _figure(max(6.0, 1.2 * len(runs) + 2), 4.5)
    names = list(runs)
    width = 0.8 / max(1, len(models))
    for i, (model, label) in enumerate(models):
        stats = final_stats(runs, metric, model)
        if all(s is None for s in stats.values()):
            continue
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(names))]
        means = [float("nan") if stats[n] is None else stats[n][0] for n in names]
        stds = [0.0 if stats[n] is None else stats[n][1] for n in names]
        ax.bar(xs, means, width, yerr=stds, capsize=4, label=label)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize="small")
    ax.set_ylabel(f"test macro {metric}")
    ax.set_title(f"final test {metric}, mean ± std over seeds")
    ax.grid(axis="y", alpha=0.3)
    if ax.containers:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def run_figure(result: Mapping, metrics: Sequence[str] | None = None):
    """One run (a ``results.json``): per round its validation macro metrics (solid lines, labelled ``val
    <metric>``) and test ones where measured (dashed, ``test <metric>``), the best-on-validation round marked.
    ``metrics`` default: the task's table metrics. Returns the matplotlib ``Figure``."""
    task = next((r[s]["task"] for r in result.get("rounds", []) for s in ("val", "test") if r.get(s)), "multilabel")
    metrics = list(metrics or [key for _, key in TABLE_METRICS[task]])
    fig, ax = _figure()
    for metric in metrics:
        color = None
        for split, style in (("val", "-"), ("test", "--")):
            rounds, values = run_curve(result, metric, split)
            pts = [(r, v) for r, v in zip(rounds, values) if v is not None]
            if pts:
                (line,) = ax.plot(
                    [r for r, _ in pts],
                    [v for _, v in pts],
                    style,
                    marker="o",
                    markersize=3,
                    color=color,
                    label=f"{split} {metric}",
                )
                color = line.get_color()
    best = (result.get("best") or {}).get("trained_rounds")
    if best is not None:
        ax.axvline(best, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("round (global model received)")
    _integer_rounds(ax)
    ax.set_ylabel("macro metric")
    ax.set_title(
        f"{result.get('method', '?')} on {result.get('dataset', '?')}"
        + (f" (best on validation: round {best})" if best is not None else "")
    )
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def save_figure(fig, path) -> str:
    """Write ``fig`` as PNG to ``path`` (folders created), in a 256-colour palette (a line plot looks the same at
    about a third of the bytes: the benchmark figures are kept in the repository); returns the path."""
    import io
    from pathlib import Path

    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, format="PNG", optimize=True)
    return str(path)


def across_sites_line(name: str, a: dict, warning: bool = True) -> str:
    """One line: the test AUROC within each site, their mean and all sites pooled (``final[model].across_sites``),
    then its warning, if any, as a paragraph of its own (``warning=False``: the line alone, for a page that shows
    the warning elsewhere)."""
    sites = ", ".join(f"{s} {100 * v:.1f}" for s, v in a["within_site_auc"].items())
    pooled = (
        "not available (a site sent no score histogram)" if a["pooled_auc"] is None else f"{100 * a['pooled_auc']:.1f}"
    )
    line = (
        f"{name}: test AUROC within each site {sites}; their mean {100 * a['mean_within_site_auc']:.1f}; "
        f"all sites pooled {pooled}"
    )
    return line + (f"\n\nWARNING: {a['warning']}." if warning and a.get("warning") else "")
