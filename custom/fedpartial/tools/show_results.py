"""Print the results of a finished simulator / POC run and plot its curves:

    python -m fedpartial.tools.show_results WS [--plot PATH | --no-plot]

``WS`` is a workspace, run folder or ``results.json``. Besides printing the tables, the per-round validation
(solid) and test (dashed) macro metrics of the run are drawn to ``results_curves.png`` next to ``results.json``
(or to ``--plot PATH``); the best-on-validation round is the dotted vertical line. Beside it go the final model's
figures (the best-on-validation model, else the last; ``fedpartial.plots``): ``results_auc_ci.png`` (per-class
test AUROC with its bootstrap interval), ``results_site_auc.png`` (each site's test AUROC per class) and, when
the run kept its pooled test score histogram, ``results_roc.png`` / ``results_pr.png`` (the validation thresholds
marked); ``results.md`` gets a "Figures" section showing them. A run whose method sends per-class statistics ends
with its privacy ledger per site (statistics released, minimum count, privacy scope, epsilon spent; see
docs/privacy.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..fl.keys import BEST_MODEL, LAST_MODEL
from ..fl.report import RESULTS_FILE, TABLE_FILE, degradation, render_tables
from ..plots import write_final_figures as plot_final_figures
from ..tables import run_figure, save_figure

CURVES_FILE = "results_curves.png"
FIGURE_PREFIX = "results_"  # the final model's figures: results_auc_ci.png, results_site_auc.png, ...
FIGURES_HEADING = "## Figures"


def degraded_lines(results: dict) -> list[str]:
    """``DEGRADED: <reason>`` lines of a run that lost or refused sites (``results.json`` ``degraded``, else
    computed from its rounds); ``fedpartial-admin results`` prints the same."""
    info = results.get("degraded", None) if "degraded" in results else degradation(results)
    return [f"DEGRADED: {r}" for r in (info or {}).get("reasons", [])]


def find_results(path: Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    hits = sorted(path.rglob(RESULTS_FILE))
    if not hits:
        raise FileNotFoundError(f"no {RESULTS_FILE} under {path}")
    return hits[0]


def write_curves(results: dict, path: str | Path, metrics: list[str] | None = None) -> str:
    """The run's curves (``fedpartial.tables.run_figure``) as PNG at ``path``."""
    return save_figure(run_figure(results, metrics), path)


def write_final_figures(results: dict, folder: str | Path) -> tuple[str | None, dict[str, str]]:
    """The final model's figures (``fedpartial.plots.write_final_figures``) of the best-on-validation model, else
    the last, as ``folder/results_<name>.png``. Returns ``(model file, {name: path})``."""

    for model in (BEST_MODEL, LAST_MODEL):
        if ((results.get("final") or {}).get(model) or {}).get("test"):
            return model, plot_final_figures(results, model, folder, FIGURE_PREFIX)
    return None, {}


def add_figures_section(md: Path, images: dict[str, str], model: str | None) -> None:
    """Append (or replace) ``results.md``'s "Figures" section: the curves and the final model's figures, by
    relative path."""
    text = md.read_text() if md.is_file() else ""
    text = text.split("\n" + FIGURES_HEADING + "\n")[0].rstrip("\n") + "\n"
    captions = {
        "curves": "per-round macro metrics (validation solid, test dashed)",
        "auc_ci": f"{model}: per-class test AUROC with its 95 % bootstrap interval",
        "sites": f"{model}: test AUROC per site and class",
        "roc": f"{model}: test ROC curves, validation thresholds marked",
        "pr": f"{model}: test precision-recall curves, validation thresholds marked",
    }
    lines = ["", FIGURES_HEADING, ""]
    for name, path in images.items():
        lines += [f"![{captions.get(name, name)}]({Path(path).name})", ""]
    md.write_text(text + "\n".join(lines))


def privacy_table(results: dict) -> str:
    """Per site: the privacy scope, the minimum count, the per-class statistics released (and in how many
    rounds) and the epsilon spent (``inf``: statistics left without noise, no formal guarantee)."""
    ledger = results.get("privacy") or {}
    if not ledger:
        return ""
    lines = [
        "Privacy ledger (per-class statistics that left each site):",
        f"{'site':<14}{'scope':<10}{'min count':>10}{'released':>10}{'rounds':>8}{'epsilon':>10}{'delta':>9}",
    ]
    for site, t in sorted(ledger.items()):
        eps = "inf" if t.get("epsilon") is None else f"{t['epsilon']:.3g}"
        delta = f"{t['delta']:.0e}" if t.get("delta") else "-"
        lines.append(
            f"{site:<14}{(t.get('scope') or '-'):<10}{str(t.get('min_count')):>10}{t['releases']:>10}"
            f"{t['rounds']:>8}{eps:>10}{delta:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    ap = argparse.ArgumentParser(
        prog="python -m fedpartial.tools.show_results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("run", type=Path, help="workspace, run folder or results.json")
    ap.add_argument(
        "--plot", type=Path, default=None, help=f"PNG of the curves (default: {CURVES_FILE} next to {RESULTS_FILE})"
    )
    ap.add_argument("--no-plot", action="store_true", help="print the tables only")
    ap.add_argument("--metrics", nargs="+", default=None, help="metrics to plot (default: the table's)")
    a = ap.parse_args(argv)
    path = find_results(a.run)
    results = json.loads(path.read_text())
    print(f"{path}\n")

    for line in degraded_lines(results):
        print(line)
    print(render_tables(results))
    ledger = privacy_table(results)
    if ledger:
        print(ledger + "\n")
    if not a.no_plot:
        try:
            curves = write_curves(results, a.plot or path.parent / CURVES_FILE, a.metrics)
            print(f"curves: {curves}")
            model, figs = write_final_figures(results, Path(curves).parent)
            if figs:
                print(f"{model}: {', '.join(figs.values())}")
            if a.plot is None:  # the figures beside results.md: its "Figures" section shows them
                add_figures_section(path.parent / TABLE_FILE, {"curves": curves, **figs}, model)
        except ImportError as e:  # matplotlib is in requirements.txt; a bare server install may lack it
            print(f"(no curves: {e})", file=sys.stderr)
        except OSError as e:
            print(f"(no curves: cannot write {a.plot or path.parent / CURVES_FILE}: {e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
