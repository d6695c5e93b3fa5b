"""Per-class figures of a final model (method-agnostic; matplotlib's Agg canvas, no display needed).

- :func:`roc_pr_figures`: one small panel per class, ROC (TPR against FPR) and precision-recall curves, the
  operating point at each class's threshold marked and labelled;
- :func:`auc_ci_figure`: per-class AUROC with its bootstrap interval (``fedpartial.stats.bootstrap_auc_ci``), the
  macro mean last;
- :func:`site_heatmap_figure`: each site's test AUROC per class (rows = sites, columns = classes).

The curves come from scores (:func:`curves_from_scores`: ``fedpartial-evaluate``, which holds every probability)
or from a pooled score histogram (:func:`curves_from_histogram`: ``results.json``, where the probabilities stayed
at the sites and only label counts per bin of ``fedpartial.metrics.SCORE_GRID`` reached the server). Both give
``{class: Curve}``, so a figure does not know where its points came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .metrics import SCORE_GRID
from .tables import save_figure

__all__ = [
    "Curve",
    "binary_curve",
    "curves_from_scores",
    "curves_from_histogram",
    "roc_pr_figures",
    "auc_ci_figure",
    "site_heatmap_figure",
    "save_figure",
]

NCOLS = 4  # panels per row of the per-class figures


@dataclass
class Curve:
    """One class's binary problem, every candidate threshold (decreasing) with its rates.

    ``thresholds``, ``tpr``, ``fpr``, ``precision``: ``(K,)`` each (predict positive when ``score >= threshold``);
    ``positives`` / ``negatives``: the (weighted) counts of the class's rows.
    """

    thresholds: np.ndarray
    tpr: np.ndarray
    fpr: np.ndarray
    precision: np.ndarray
    positives: float
    negatives: float

    def at(self, threshold: float) -> tuple[float, float, float]:
        """``(fpr, tpr, precision)`` when predicting positive at ``score >= threshold``: the lowest candidate at
        or above ``threshold`` (nothing positive when every candidate is below it)."""
        above = np.flatnonzero(self.thresholds >= threshold - 1e-12)
        if not len(above):
            return 0.0, 0.0, 1.0
        k = int(above[-1])
        return float(self.fpr[k]), float(self.tpr[k]), float(self.precision[k])

    @property
    def auc(self) -> float:
        """Trapezoidal area under the ROC points, from (0, 0) to (1, 1)."""
        x, y = np.r_[0.0, self.fpr, 1.0], np.r_[0.0, self.tpr, 1.0]
        return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2))


def binary_curve(y: np.ndarray, scores: np.ndarray, weights: np.ndarray | None = None) -> Curve | None:
    """ROC and precision-recall points of one binary problem.

    Args:
        y: ``(N,)`` 0/1; scores: ``(N,)``; weights: optional ``(N,)`` non-negative counts.

    Returns:
        The :class:`Curve` (one point per distinct score, highest first), or None without both outcomes.
    """
    y = np.asarray(y).astype(int).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    keep = w > 0
    y, s, w = y[keep], s[keep], w[keep]
    pos, neg = float(w[y == 1].sum()), float(w[y == 0].sum())
    if pos <= 0 or neg <= 0:
        return None
    order = np.argsort(-s, kind="stable")
    s, y, w = s[order], y[order], w[order]
    last = np.r_[np.flatnonzero(np.diff(s) != 0), len(s) - 1]  # the last row of each distinct score
    tp = np.cumsum(w * (y == 1))[last]
    fp = np.cumsum(w * (y == 0))[last]
    return Curve(
        thresholds=s[last],
        tpr=tp / pos,
        fpr=fp / neg,
        precision=tp / np.maximum(tp + fp, 1e-300),
        positives=pos,
        negatives=neg,
    )


def curves_from_scores(
    y_true: np.ndarray, probs: np.ndarray, classes: Sequence[str], mask: np.ndarray | None = None
) -> dict[str, Curve | None]:
    """Per class, :func:`binary_curve` over its annotated rows. ``y_true``, ``probs``: ``(N, C)``; ``mask``:
    optional ``(N, C)`` bool. A single-label task passes one-hot labels: each class one-vs-rest."""
    probs = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y_true).reshape(probs.shape)
    m = np.ones(probs.shape, bool) if mask is None else np.asarray(mask, dtype=bool).reshape(probs.shape)
    return {c: binary_curve(y[m[:, k], k], probs[m[:, k], k]) for k, c in enumerate(classes)}


def curves_from_histogram(hist: Mapping) -> dict[str, Curve | None]:
    """Per class, :func:`binary_curve` of a score histogram (``{"classes", "pos", "neg"}``, bins of
    ``fedpartial.metrics.SCORE_GRID``): every bin is its lower edge weighted by its counts, as the validation
    thresholds are chosen (``fedpartial.metrics.thresholds_from_histogram``)."""
    y = np.r_[np.ones(len(SCORE_GRID)), np.zeros(len(SCORE_GRID))]
    s = np.r_[SCORE_GRID, SCORE_GRID]
    return {c: binary_curve(y, s, np.r_[pos, neg]) for c, pos, neg in zip(hist["classes"], hist["pos"], hist["neg"])}


def _grid(n: int, width: float = 3.0, height: float = 2.9):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(NCOLS, max(1, n))
    nrows = max(1, math.ceil(n / ncols))
    fig = Figure(figsize=(width * ncols, height * nrows + 0.6))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]
    return fig, axes


def _fmt_ci(ci: Sequence[float] | None) -> str:
    return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def roc_pr_figures(
    curves: Mapping[str, Curve | None],
    thresholds: Mapping[str, float | None] | None = None,
    ci: Mapping[str, Sequence[float] | None] | None = None,
    title: str = "",
    default_threshold: float | None = 0.5,
    auc: Mapping[str, float | None] | None = None,
    note: str = "",
):
    """Two figures, ROC and precision-recall, one panel per class (4 per row).

    Args:
        curves: ``{class: Curve | None}`` (None: the class lacks an outcome; its panel says so).
        thresholds: ``{class: threshold | None}`` marked on the curves (a filled dot and ``t=...``); a class
            without one is marked at ``default_threshold`` (an open dot), unless that is None (single-label: the
            argmax decides, no threshold is marked).
        ci: ``{class: [low, high] | None}``: the AUROC's bootstrap interval, shown in the ROC panel's title.
        auc: ``{class: AUROC}`` shown in the titles instead of the area under ``curves`` (a curve from a score
            histogram is binned; the exact AUROC comes from the scores).
        note: said under the title (e.g. that the curves are binned).

    Returns:
        ``(roc_figure, pr_figure)``.
    """
    thresholds, ci, auc = dict(thresholds or {}), dict(ci or {}), dict(auc or {})
    figs = []
    for kind in ("roc", "pr"):
        fig, axes = _grid(len(curves))
        for ax, (name, cur) in zip(axes, curves.items()):
            ax.set_xlim(-0.02, 1.02)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize="x-small")
            if cur is None:
                ax.set_title(f"{name}\n(one outcome only, or kept at the sites)", fontsize="small")
                ax.text(0.5, 0.5, "n/a", ha="center", va="center", color="grey", fontsize="large")
                continue
            if kind == "roc":
                ax.plot([0, 1], [0, 1], ":", color="grey", linewidth=1)
                ax.plot(
                    np.r_[0.0, cur.fpr],
                    np.r_[0.0, cur.tpr],
                    color="C0",
                    linewidth=1.6,
                    marker="." if len(cur.fpr) < 30 else None,
                    label="ROC",
                )
                ax.set_xlabel("1 - specificity (FPR)", fontsize="small")
                ax.set_ylabel("sensitivity (TPR)", fontsize="small")
                value = auc.get(name, cur.auc)
                value = "n/a" if value is None else f"{value:.2f}"
                ax.set_title(f"{name}\nAUROC {value}{_fmt_ci(ci.get(name))}", fontsize="small")
            else:
                prevalence = cur.positives / (cur.positives + cur.negatives)
                ax.axhline(prevalence, linestyle=":", color="grey", linewidth=1)
                ax.plot(
                    cur.tpr,
                    cur.precision,
                    color="C1",
                    linewidth=1.6,  # (no made-up point at recall 0)
                    marker="." if len(cur.tpr) < 30 else None,
                    label="PR",
                )
                ax.set_xlabel("recall (TPR)", fontsize="small")
                ax.set_ylabel("precision (PPV)", fontsize="small")
                ax.set_title(f"{name}\nprevalence {prevalence:.2f}", fontsize="small")
            t, chosen = thresholds.get(name), True
            if t is None:
                t, chosen = default_threshold, False
            if t is not None:
                fpr, tpr, prec = cur.at(t)
                x, yv = (fpr, tpr) if kind == "roc" else (tpr, prec)
                ax.plot(
                    [x],
                    [yv],
                    "o",
                    markersize=7,
                    color="C3",
                    markerfacecolor="C3" if chosen else "white",
                    label=f"t={t:.2f}" + ("" if chosen else " (default)"),
                )
                ax.annotate(
                    f"t={t:.2f}",
                    (x, yv),
                    xytext=(6, -12 if kind == "roc" else 6),
                    textcoords="offset points",
                    fontsize="x-small",
                    color="C3",
                )
        what = "ROC curves" if kind == "roc" else "precision-recall curves"
        marks = (
            ""
            if default_threshold is None and not thresholds
            else " (dot: operating threshold"
            + (f"; open: {default_threshold:g} where none was chosen)" if default_threshold is not None else ")")
        )
        fig.suptitle(f"{title + ': ' if title else ''}{what}{marks}" + (f"\n{note}" if note else ""), fontsize="medium")
        fig.tight_layout()
        figs.append(fig)
    return figs[0], figs[1]


def auc_ci_figure(result: Mapping, title: str = ""):
    """Per-class AUROC (dots) with its bootstrap interval (bars), the macro mean last (a diamond), the chance
    level 0.5 dotted. ``result``: a ``fedpartial.metrics`` result with ``ci`` (``bootstrap_auc_ci``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    per_class = result.get("per_class") or {}
    ci = (result.get("ci") or {}).get("auc") or {}
    names = list(per_class) + ["macro"]
    values = [(per_class[c] or {}).get("auc") for c in per_class] + [(result.get("macro") or {}).get("auc")]
    intervals = [(ci.get("per_class") or {}).get(c) for c in per_class] + [ci.get("macro")]
    fig = Figure(figsize=(7.0, 0.45 * len(names) + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ys = np.arange(len(names))[::-1]
    for y, name, v, iv in zip(ys, names, values, intervals):
        marker = "D" if name == "macro" else "o"
        if v is None or not math.isfinite(v):
            ax.text(
                0.5,
                y,
                "n/a (one outcome only, or kept at the sites)",
                va="center",
                ha="center",
                color="grey",
                fontsize="small",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
            )
            continue
        if iv:  # (an interval is shown only beside a defined value)
            ax.plot(iv, [y, y], color="C0", linewidth=2.5, alpha=0.6, solid_capstyle="butt")
        ax.plot([v], [y], marker, color="C0" if name != "macro" else "black", markersize=7)
        ax.text(1.01, y, f"{v:.3f}" + _fmt_ci(iv), va="center", fontsize="small", transform=ax.get_yaxis_transform())
    ax.axvline(0.5, linestyle=":", color="grey", linewidth=1)
    ax.set_yticks(ys)
    ax.set_yticklabels(names)
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.set_xlabel("AUROC (dot) with its 95 % bootstrap interval (bar)")
    ax.grid(axis="x", alpha=0.3)
    n = result.get("n")
    ax.set_title((title + ", " if title else "") + (f"n = {n}" if n is not None else ""), fontsize="medium")
    fig.tight_layout()
    fig.subplots_adjust(right=0.72)
    return fig


def site_heatmap_figure(
    per_site: Mapping[str, Mapping | None],
    classes: Sequence[str],
    metric: str = "auc",
    title: str = "",
    annotated: Mapping[str, Sequence[str]] | None = None,
):
    """Each site's ``metric`` per class as a heat map (rows = sites, columns = classes, value written in each
    cell; ``n/a``: undefined there or kept at the site by its minimum count). ``per_site``: ``{site: result}``
    (``fedpartial.metrics`` results). ``annotated``: ``{site: [classes it labels]}``, such cells are framed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    sites = list(per_site)
    values = np.full((len(sites), len(classes)), np.nan)
    for i, s in enumerate(sites):
        pc = (per_site[s] or {}).get("per_class") or {}
        for j, c in enumerate(classes):
            v = (pc.get(c) or {}).get(metric)
            if v is not None and math.isfinite(v):
                values[i, j] = v
    fig = Figure(figsize=(max(5.0, 1.0 * len(classes) + 2.5), 0.55 * len(sites) + 2.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = _cmap()
    im = ax.imshow(
        np.ma.masked_invalid(values), cmap=cmap, vmin=0.5 if metric == "auc" else 0.0, vmax=1.0, aspect="auto"
    )
    for i in range(len(sites)):
        for j in range(len(classes)):
            v = values[i, j]
            r, g, b, _ = cmap(im.norm(v)) if math.isfinite(v) else (0.87, 0.87, 0.87, 1.0)
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # white text on a dark cell
            ax.text(
                j,
                i,
                "n/a" if not math.isfinite(v) else f"{v:.2f}",
                ha="center",
                va="center",
                fontsize="small",
                color="white" if dark else "black",
                fontweight="bold",
            )
            if annotated and classes[j] in (annotated.get(sites[i]) or []):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.5))
    ax.set_xticks(range(len(classes)))
    ax.set_xticklabels(classes, rotation=30, ha="right", fontsize="small")
    ax.set_yticks(range(len(sites)))
    ax.set_yticklabels(sites, fontsize="small")
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02).set_label(
        "AUROC (0.5 and below: darkest)" if metric == "auc" else metric
    )
    note = " (framed: classes the site annotates)" if annotated else ""
    ax.set_title((title or f"test {metric.upper()} per site and class") + note, fontsize="medium")
    fig.tight_layout()
    return fig


def _cmap():
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="#dddddd")


# ------------------------------------------------------------------------------------- a run's final model

FIGURE_NAMES = {"roc": "roc.png", "pr": "pr.png", "auc_ci": "auc_ci.png", "sites": "site_auc.png"}


def _annotated(results: Mapping, classes: Sequence[str]) -> dict[str, list[str]]:
    return {
        s: [classes[k] for k in (i.get("annotated") or []) if k < len(classes)]
        for s, i in (((results.get("data") or {}).get("sites")) or {}).items()
    }


def final_figures(results: Mapping, model_file: str, split: str = "test") -> dict[str, object]:
    """The figures of one final model of a ``results.json``: ``auc_ci`` (per-class AUROC with its bootstrap
    interval), ``sites`` (each site's AUROC per class; a set several sites share is one row, named by the site
    that scored it), and ``roc`` / ``pr`` when the run kept its pooled score histogram (``<split>_score_hist``),
    the validation thresholds marked. Returns ``{name: Figure}`` (empty when the run has no such model)."""
    final = ((results.get("final") or {}).get(model_file)) or {}
    res = final.get(split)
    if not res:
        return {}
    classes = list(res.get("per_class") or {})
    label = f"{results.get('method', '?')} on {results.get('dataset', '?')}, {model_file}, {split}"
    figs: dict[str, object] = {"auc_ci": auc_ci_figure(res, title=label)}
    per_site = final.get("per_site") or {}
    if per_site:
        rows = {s: (r or {}).get(split) for s, r in per_site.items()}
    else:
        scorers = final.get("sites") or []
        shared = [
            g
            for g in (((results.get("data") or {}).get("shared_eval_sets")) or {}).get(split, [])
            if scorers and scorers[0] in g
        ]
        name = (
            (
                f"{scorers[0]} (set shared by {len(shared[0])} sites)"
                if shared
                else (scorers[0] if len(scorers) == 1 else "pooled")
            )
            if scorers
            else "pooled"
        )
        rows = {name: res}
    annotated = _annotated(results, classes) if per_site else None  # a shared set belongs to no one site
    figs["sites"] = site_heatmap_figure(
        rows, classes, "auc", title=f"{split} AUROC per site and class ({model_file})", annotated=annotated
    )
    hist = final.get(f"{split}_score_hist")
    if hist and res.get("task", "multilabel") == "multilabel":
        thr = ((final.get("thresholds") or {}).get("thresholds")) or {}
        ci = (((res.get("ci") or {}).get("auc") or {}).get("per_class")) or {}
        exact = {c: (m or {}).get("auc") for c, m in (res.get("per_class") or {}).items()}
        figs["roc"], figs["pr"] = roc_pr_figures(
            curves_from_histogram(hist),
            thr,
            ci,
            title=label,
            auc=exact,
            note="curves from the sites' pooled score histograms (bins of 0.1 in logit); AUROC from the sites' scores",
        )
    return figs


def write_final_figures(
    results: Mapping, model_file: str, folder, prefix: str = "", split: str = "test"
) -> dict[str, str]:
    """:func:`final_figures` as PNG files ``folder/<prefix><name>.png``; returns ``{name: path}``."""
    from pathlib import Path

    out = {}
    for name, fig in final_figures(results, model_file, split).items():
        out[name] = save_figure(fig, Path(folder) / f"{prefix}{FIGURE_NAMES[name]}")
    return out
