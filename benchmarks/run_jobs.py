"""Run jobs through the NVFlare simulator with identical budgets and seeds, and tabulate the final results.

    python benchmarks/run_jobs.py --jobs fedavg_ich fedavg_pl_ich fedavg_masked_ich fedavg_full_ich \
        --seeds 0 1 2 --rounds 20 --out benchmarks/results/ich_baselines.json

Each run copies ``jobs/<job>`` into a scratch folder with the package built into it, sets the number of rounds
and the seed (the executor seed: model init, shuffling and augmentation; the data split stays the preset's),
runs ``nvflare simulator -n <sites> -t <sites>`` and reads ``results.json``. The table reports, per job, the
mean and standard deviation over seeds of the test metrics of the final global model (and of the model that
was best on validation), plus the wall time per round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedpartial.tools.build_jobs import customise_job  # noqa: E402


def run_one(job: str, seed: int, rounds: int, sites: int, scratch: Path, overrides: dict, env: dict) -> dict:
    dest = scratch / f"{job}-s{seed}"
    customise_job(REPO / "jobs" / job, dest / "job", rounds, overrides, seed=seed)
    nvflare = Path(sys.executable).parent / "nvflare"
    t0 = time.time()
    proc = subprocess.run([str(nvflare), "simulator", str(dest / "job"), "-w", str(dest / "ws"), "-n", str(sites),
                           "-t", str(sites)], env=env, capture_output=True, text=True, cwd=str(REPO))
    wall = time.time() - t0
    res_file = dest / "ws/server/simulate_job/results.json"
    if proc.returncode != 0 or not res_file.is_file():
        raise RuntimeError(f"{job} seed {seed} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    res = json.loads(res_file.read_text())
    res["wall_seconds_total"] = wall
    return res


METRICS = {"multilabel": ["bacc", "auc", "map", "f1"], "multiclass": ["auc", "accuracy", "f1", "precision", "recall"]}


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for job, results in runs.items():
        row = {"job": job, "n_seeds": len(results)}
        for model in ("FL_global_model.pt", "best_FL_global_model.pt"):
            tests = [r["final"][model]["test"] for r in results]
            task = tests[0]["task"]
            for m in METRICS[task]:
                vals = [t["macro"][m] for t in tests if t["macro"].get(m) is not None]
                tag = "final" if model == "FL_global_model.pt" else "best"
                row[f"{tag}_{m}"] = (statistics.mean(vals), statistics.pstdev(vals) if len(vals) > 1 else 0.0)
        row["s_per_round"] = statistics.mean(r["seconds_per_round"] for r in results)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k.startswith(("final_", "best_"))]
    head = "| job | seeds | " + " | ".join(keys) + " | s / round |"
    lines = [head, "|" + "---|" * (len(keys) + 3)]
    for r in rows:
        cells = [f"{100 * r[k][0]:.2f} ± {100 * r[k][1]:.2f}" for k in keys]
        lines.append(f"| {r['job']} | {r['n_seeds']} | " + " | ".join(cells) + f" | {r['s_per_round']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--override", default="{}", help="JSON merged into every job's executor args")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch workspaces")
    a = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="fedpartial-bench-"))
    env = {**os.environ, "FEDPARTIAL_DATA_DIR": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    runs: dict[str, list[dict]] = {}
    for job in a.jobs:
        for seed in a.seeds:
            res = run_one(job, seed, a.rounds, a.sites, scratch, json.loads(a.override), env)
            runs.setdefault(job, []).append(res)
            fin = res["final"]["FL_global_model.pt"]["test"]["macro"]
            print(f"{job} seed {seed}: test {json.dumps({k: round(v, 4) for k, v in fin.items() if v is not None})} "
                  f"({res['seconds_per_round']:.1f} s/round)", flush=True)
    rows = summarise(runs)
    print("\n" + markdown(rows))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "summary": rows, "runs": runs},
                                    indent=1, default=str))
    if not a.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
