"""One table for a sweep of ``run_jobs.py`` benchmarks (one file per sweep point), with the surgical-aggregation
paper's test for its simulation experiments: a paired t-test between two configurations' macro test AUROCs over
every (point, seed) run (Shapiro-Wilk on the differences).

    python benchmarks/sweep_table.py --a surgical_ich --b fl_pl --label K \\
        benchmarks/results/surgical_sites_k{2,4,6,8,10}.json

Each file is one sweep point; its label is the last number in the file name (``k10`` -> 10) unless ``--labels``
gives them. The last-round global model's macro test AUROC is read from every run (``--model best`` for the
best-on-validation model).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedpartial.fl.keys import BEST_MODEL, LAST_MODEL  # noqa: E402
from fedpartial.stats import paired_comparison, stars  # noqa: E402

MODELS = {"last": LAST_MODEL, "best": BEST_MODEL}


def macro_aucs(path: Path, config: str, model: str) -> dict[str, float]:
    """``{seed: macro test AUROC}`` of one configuration in one run_jobs.py summary file (``final``: per seed the
    last-round and best-on-validation macro test metrics; an older file holding its runs works too)."""
    data = json.loads(Path(path).read_text())
    if "final" in data:
        per_seed = data["final"]
        if config not in per_seed:
            raise SystemExit(f"{path}: no configuration {config!r} (have {', '.join(per_seed)})")
        tag = "last" if model == "last" else "best"
        return {
            str(r["seed"]): 100.0 * float(r[tag]["auc"])
            for r in per_seed[config]
            if (r.get(tag) or {}).get("auc") is not None
        }
    runs = data["runs"]
    if config not in runs:
        raise SystemExit(f"{path}: no configuration {config!r} (have {', '.join(runs)})")
    out = {}
    for k, r in enumerate(runs[config]):
        auc = (((r.get("final") or {}).get(MODELS[model]) or {}).get("test") or {}).get("macro", {}).get("auc")
        if auc is not None:
            out[str(r.get("seed", k))] = 100.0 * float(auc)
    return out


def _cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def sweep_table(
    files: list[Path], a: str, b: str, labels: list[str], label: str = "point", model: str = "last"
) -> tuple[str, dict]:
    """Markdown table (one row per point: A, B, A - B, seeds) and the paired comparison over all runs."""
    rows = [f"| {label} | {a} | {b} | {a} - {b} | seeds |", "|---|---|---|---|---|"]
    pa: dict[str, float] = {}
    pb: dict[str, float] = {}
    for path, point in zip(files, labels):
        xa, xb = macro_aucs(path, a, model), macro_aucs(path, b, model)
        common = [s for s in xa if s in xb]
        diffs = [xa[s] - xb[s] for s in common]
        rows.append(
            f"| {point} | {_cell(list(xa.values()))} | {_cell(list(xb.values()))} | "
            f"{_cell(diffs) if diffs else 'n/a'} | {len(common)} |"
        )
        pa.update({f"{point}/{s}": xa[s] for s in common})
        pb.update({f"{point}/{s}": xb[s] for s in common})
    cmp = paired_comparison(pa, pb)
    p, sp = cmp["p"], cmp["shapiro_p"]
    rows += [
        "",
        f"Paired t-test over {cmp['n']} runs (point x seed) of the macro test AUROC ({model} model): "
        f"{a} - {b} = {cmp['mean_diff']:+.2f}, t = {cmp['t'] if cmp['t'] is None else round(cmp['t'], 2)}, "
        f"p = {p if p is None else f'{p:.3g}'} ({stars(p)}); Shapiro-Wilk p of the differences = "
        f"{sp if sp is None else f'{sp:.3g}'}; Wilcoxon p = "
        f"{cmp['wilcoxon_p'] if cmp['wilcoxon_p'] is None else round(cmp['wilcoxon_p'], 3)}.",
    ]
    return "\n".join(rows), cmp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--a", required=True, help="configuration A (e.g. surgical_ich)")
    ap.add_argument("--b", required=True, help="configuration B (e.g. fl_pl)")
    ap.add_argument("--label", default="point", help="column title of the sweep points (e.g. K)")
    ap.add_argument("--labels", nargs="+", default=None, help="one label per file (default: from the file names)")
    ap.add_argument("--model", choices=sorted(MODELS), default="last")
    args = ap.parse_args(argv)
    labels = args.labels or [(re.findall(r"\d+", f.stem) or [f.stem])[-1] for f in args.files]
    if len(labels) != len(args.files):
        ap.error(f"{len(args.files)} files but {len(labels)} labels")
    text, _ = sweep_table(args.files, args.a, args.b, labels, args.label, args.model)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
