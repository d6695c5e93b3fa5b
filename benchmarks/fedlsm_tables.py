"""Tables in the layout of the FedLSM paper from a ``benchmarks/run_jobs.py`` JSON.

    python benchmarks/fedlsm_tables.py benchmarks/results/fedlsm_ham10000.json \
        --lower fedavg_ham10000 --upper fedavg_full_ham10000 --method fedlsm_isic

Single-label runs (Table 2 / 3): macro AUC, accuracy, F1, precision, recall (%) of the model that was best on
validation (macro AUC), evaluated on test, mean ± std over the seeds that finished; plus the share of the
macro-F1 gap between the lower bound (``--lower``) and the upper bound (``--upper``) that ``--method`` closes.
Multi-label runs (Table 1): per-class test AUC of the best-on-validation model, one column per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

MODEL = "best_FL_global_model.pt"
MC = ("auc", "accuracy", "f1", "precision", "recall")


def _ms(vals: list[float]) -> tuple[float, float]:
    return statistics.mean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0)


def test_results(runs: list[dict], model: str = MODEL) -> list[dict]:
    return [r["final"][model]["test"] for r in runs if r.get("final", {}).get(model, {}).get("test")]


def multiclass_table(data: dict, model: str = MODEL) -> str:
    lines = ["| configuration | seeds | AUC | Accuracy | F1 | Precision | Recall | s / round |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in data["runs"].items():
        tests = test_results(runs, model)
        cells = []
        for m in MC:
            mean, std = _ms([t["macro"][m] for t in tests])
            cells.append(f"{100 * mean:.1f} ± {100 * std:.1f}")
        spr = statistics.mean(r["seconds_per_round"] for r in runs)
        lines.append(f"| {name} | {len(tests)} | " + " | ".join(cells) + f" | {spr:.1f} |")
    return "\n".join(lines)


def multilabel_table(data: dict, model: str = MODEL) -> str:
    names = list(data["runs"])
    per = {n: test_results(data["runs"][n], model) for n in names}
    classes = list(next(iter(per.values()))[0]["per_class"])
    lines = ["| class | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in classes + ["Average AUC"]:
        cells = []
        for n in names:
            vals = [t["macro"]["auc"] if c == "Average AUC" else t["per_class"][c]["auc"] for t in per[n]]
            vals = [v for v in vals if v is not None]
            cells.append(f"{_ms(vals)[0]:.3f}" if vals else "n/a")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gap_closed(data: dict, method: str, lower: str, upper: str, metric: str = "f1", model: str = MODEL) -> dict:
    """Share of the lower -> upper gap of ``metric`` closed by ``method`` (means over seeds)."""
    mean = {n: statistics.mean(t["macro"][metric] for t in test_results(data["runs"][n], model))
            for n in (method, lower, upper)}
    gap = mean[upper] - mean[lower]
    return {"metric": metric, **mean, "closed": (mean[method] - mean[lower]) / gap if gap else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--method", default=None)
    ap.add_argument("--lower", default=None)
    ap.add_argument("--upper", default=None)
    ap.add_argument("--model", default=MODEL, help="FL_global_model.pt (last round) or best_FL_global_model.pt")
    a = ap.parse_args(argv)
    data = json.loads(a.results.read_text())
    first = test_results(next(iter(data["runs"].values())), a.model)[0]
    print(multiclass_table(data, a.model) if first["task"] == "multiclass" else multilabel_table(data, a.model))
    if a.method and a.lower and a.upper:
        g = gap_closed(data, a.method, a.lower, a.upper, model=a.model)
        print(f"\nmacro-F1: {a.lower} {100 * g[a.lower]:.1f}, {a.method} {100 * g[a.method]:.1f}, "
              f"{a.upper} {100 * g[a.upper]:.1f}: {a.method} closes {100 * g['closed']:.0f}% of the gap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
