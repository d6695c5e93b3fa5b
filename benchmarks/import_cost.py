"""Start-up cost of a site process: wall time, CPU time (user + system: what a busy machine inflates least) and
peak memory (RSS) of the imports, each in a fresh Python, as ratios against ``import torch`` alone measured in the
same run (median of ``--repeats``).

    python benchmarks/import_cost.py --out benchmarks/results/import_cost

Rows: ``import torch``; ``import fedpartial.fl.executor`` (what NVFlare imports to start a site; target within
1.5x of torch); a training site (the executor plus what its first round runs: a seeded loader and the metrics;
MONAI, scikit-learn and SciPy stay out); and, for comparison, the executor plus ``monai.data`` and
``sklearn.metrics`` (what a training site loaded while its loader was MONAI's and its metrics scikit-learn's,
and what a site with per-sample MONAI views still loads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = {
    "import torch": "import torch",
    "import fedpartial.fl.executor": "import fedpartial.fl.executor",
    "a training site (executor + loader + metrics)": (
        "import fedpartial.fl.executor, numpy, torch; from fedpartial.data.dataset import make_loader; "
        "from fedpartial.metrics import compute_metrics; "
        "list(make_loader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), 2, True, 0)); "
        "compute_metrics('multilabel', numpy.eye(2, dtype=int), numpy.full((2, 2), 0.5), ['a', 'b'])"
    ),
    "executor + monai.data + sklearn.metrics": "import fedpartial.fl.executor, monai.data, sklearn.metrics",
}
PROBE = """
import os, resource, sys, time
t0, c0 = time.perf_counter(), sum(os.times()[:2])
{stmt}
dt, cpu = time.perf_counter() - t0, sum(os.times()[:2]) - c0
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {{'monai', 'sklearn', 'scipy', 'pandas', 'matplotlib',
                                                         'tensorboard', 'mlflow', 'nvflare'}})
print(dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, cpu, ",".join(heavy))
"""


def measure(stmt: str) -> tuple[float, float, str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "custom")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(stmt=stmt)], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), float(out[1]), out[3] if len(out) > 3 else "", float(out[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "import_cost"))
    args = ap.parse_args()
    runs: dict[str, list] = {k: [] for k in ROWS}
    for _ in range(args.repeats):  # interleaved, so a busy moment hits every row alike
        for name, stmt in ROWS.items():
            runs[name].append(measure(stmt))
    base_t = statistics.median(r[0] for r in runs["import torch"])
    base_m = statistics.median(r[1] for r in runs["import torch"])
    base_c = statistics.median(r[3] for r in runs["import torch"])
    rows = []
    for name, rs in runs.items():
        t, m, c = (statistics.median(r[k] for r in rs) for k in (0, 1, 3))
        rows.append(
            {
                "import": name,
                "seconds": t,
                "rss_mb": m,
                "time_ratio": t / base_t,
                "rss_ratio": m / base_m,
                "cpu_seconds": c,
                "cpu_ratio": c / base_c,
                "heavy_modules": rs[-1][2],
            }
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python benchmarks/import_cost.py",
        "repeats": args.repeats,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = [
        "# Import cost of a site process",
        "",
        f"`python benchmarks/import_cost.py` (median of {args.repeats} fresh processes each, interleaved; Python "
        f"{result['python']}, {os.cpu_count()} CPUs; ratios against `import torch` in the same run).",
        "",
        "| import | seconds | CPU seconds | peak RSS (MB) | time / torch | CPU time / torch | RSS / torch | "
        "heavy packages loaded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| `{r['import']}` | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['rss_mb']:.0f} | "
        f"{r['time_ratio']:.2f}x | {r['cpu_ratio']:.2f}x | {r['rss_ratio']:.2f}x | {r['heavy_modules'] or '-'} |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
