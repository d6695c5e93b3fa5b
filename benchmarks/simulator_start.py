"""CPU of a small simulator run with its site workers forked from the launcher's fork server (the default) against
fresh site processes (``FEDPARTIAL_SIM_FORK=0``, NVFlare's own way), interleaved repeats in one run.

    python benchmarks/simulator_start.py --out benchmarks/results/simulator_start

The job: ``jobs/fedavg_ich`` on the ICH phantom (240 images of 64 px, read at 32 px), 2 rounds, ``--sites`` sites
(default 2), batch 16; run as ``python -m fedpartial.fl.simulator`` (what ``job.py`` runs). A run's CPU is every
process it started (the launcher and what it reaped: the fork server, NVFlare's server process and Manager, the site
workers), user + system; its wall time is printed too. The ratio (forked / fresh) is the median over the repeats.
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
TINY = {
    "dataset": {
        "image_size": 32,
        "cache": "memory",
        "prepare": {"k": 1, "source_args": {"n_images": 240, "size": 64}},
    },
    "train": {"batch_size": 16},
}


def run_once(job: Path, work: Path, sites: int, fork: bool) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one simulator run of ``job``."""
    ws = work / f"ws_{'fork' if fork else 'fresh'}"
    shutil.rmtree(ws, ignore_errors=True)
    env = {**os.environ, "FEDPARTIAL_SIM_FORK": "1" if fork else "0", "FEDPARTIAL_CACHE": str(work / "cache")}
    cmd = [sys.executable, "-m", "fedpartial.fl.simulator", str(job), "-w", str(ws), "-n", str(sites)]
    cmd += ["-t", str(sites)]
    c0, t0 = os.times(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    c1, wall = os.times(), time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"the run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return c1.children_user + c1.children_system - c0.children_user - c0.children_system, wall


def main() -> int:
    from fedpartial.tools.build_jobs import customise_job

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="simulator_start_"))
    try:
        tiny = json.loads(json.dumps(TINY))
        tiny["dataset"]["prepare"]["num_sites"] = args.sites
        tiny["dataset"]["prepare"]["k"] = max(0, 5 - (5 + args.sites - 1) // args.sites)  # each class annotated
        job = customise_job(REPO / "jobs" / "fedavg_ich", work / "job", 2, tiny, min_clients=args.sites)
        run_once(job, work, args.sites, True)  # prepares the data (cached for every run after it)
        runs: dict[str, list] = {"forked": [], "fresh": []}
        for i in range(args.repeats):
            for kind in ("fresh", "forked") if i % 2 else ("forked", "fresh"):
                cpu, wall = run_once(job, work, args.sites, kind == "forked")
                runs[kind].append({"cpu_s": round(cpu, 2), "wall_s": round(wall, 2)})
                print(f"{kind:6s} repeat {i + 1}/{args.repeats}: {cpu:5.1f} CPU-s, {wall:5.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("cpu_s", "wall_s")} for k, v in runs.items()}
    ratio = med["forked"]["cpu_s"] / med["fresh"]["cpu_s"]
    summary = {
        "command": "python benchmarks/simulator_start.py " + " ".join(sys.argv[1:]),
        "sites": args.sites,
        "repeats": args.repeats,
        "cores": os.cpu_count(),
        "measurements": runs,
        "median": med,
        "cpu_ratio_forked_to_fresh": round(ratio, 3),
    }
    lines = [
        f"`{summary['command']}` ({os.cpu_count()} cores; a {args.sites}-site, 2-round tiny fedavg_ich run, "
        f"median of {args.repeats} interleaved repeats)",
        "",
        "| site workers | CPU-s (all the run's processes) | wall s |",
        "|---|---|---|",
        *(f"| {k} | {v['cpu_s']:.1f} | {v['wall_s']:.1f} |" for k, v in med.items()),
        "",
        f"CPU forked / fresh: {ratio:.2f}",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(summary, indent=1) + "\n")
        Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
