"""The label-structure figure of a prepared folder (``label_structure.png``): positives / annotated negatives /
unlabelled per class, one panel per site. :func:`fedpartial.data.prepare.prepare` draws it when asked
(``figure=True``, the default; ``fedpartial-prepare --no-figure`` leaves it out). matplotlib is imported here only,
when the figure is drawn, so neither the library of :mod:`fedpartial.data.prepare` nor a site loads it; without
matplotlib there is no figure and no error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_structure(info: dict, file: Path) -> Path | None:
    """Bar chart of positives / annotated negatives / unlabelled per class, one panel per site (matplotlib,
    imported here only); None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sites = list(info["structure"])
    classes = info["classes"]
    fig, axes = plt.subplots(
        len(sites), 1, figsize=(max(6, 0.6 * len(classes) + 2), 1.8 * len(sites) + 0.8), sharex=True, squeeze=False
    )
    x = np.arange(len(classes))
    for ax, site in zip(axes[:, 0], sites):
        per = info["structure"][site]
        pos = np.array([per[c]["positives"] for c in classes])
        neg = np.array([per[c]["annotated"] - per[c]["positives"] for c in classes])
        unl = np.array([per[c]["unlabelled"] for c in classes])
        ax.bar(x, pos, color="tab:red", label="positive")
        ax.bar(x, neg, bottom=pos, color="tab:blue", label="negative")
        ax.bar(x, unl, bottom=pos + neg, color="lightgrey", label="unlabelled")
        centre = (info.get("centres") or {}).get(site)
        ax.set_ylabel(f"{site}\n{centre}" if centre else site, rotation=0, ha="right", va="center")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[-1, 0].set_xticks(x, classes, rotation=45, ha="right")
    fig.suptitle(
        f"{info['source']}: label structure per site ({info['protocol']}, {info.get('partition', 'iid')})",
        fontsize="medium",
    )
    top = 1 - 0.9 / fig.get_figheight()
    fig.legend(
        handles,
        labels,
        ncol=3,
        fontsize="small",
        loc="upper center",
        bbox_to_anchor=(0.5, top + 0.35 / fig.get_figheight()),
    )
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(file, dpi=100)
    plt.close(fig)
    return file
