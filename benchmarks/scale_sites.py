"""How the simulator scales with the number of sites: seconds per round, FL overhead and memory.

    python benchmarks/scale_sites.py --sites 5 10 20 50 --out benchmarks/results/scale_sites.json

Each run is ``jobs/fedavg_ich`` (FedAvg, small CNN) on a tiny ICH phantom split over N sites (``--per-site``
training images per site, 32 px, 1 local epoch), ``--rounds`` rounds, run by ``nvflare simulator -n N -t T`` with
at most ``--threads`` sites in parallel (T = min(N, threads): with T < N the simulator runs the sites in turns
in fresh processes, which bounds memory). Reported per N:

- ``s / round``: mean wall time of a round (server side, ``results.json``);
- ``slowest site``: mean over rounds of the largest local time of a site (its evaluation + training);
- ``FL overhead``: round time minus the slowest site's local work (task dispatch, transfers, process starts
  with T < N, aggregation);
- ``peak RSS``: the largest resident memory of one site process and of all simulator processes together
  (a page shared by several processes, such as torch's code, counts once per process);
- ``peak PSS all``: the sum of the processes' proportional set sizes (each shared page split between its
  sharers), the memory they take from the machine together, and ``available``: the machine's available memory
  before the run and its lowest during it; all sampled every 0.5 s (``psutil``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedpartial.tools.build_jobs import customise_job  # noqa: E402


def sample_memory(root: psutil.Process, stop: threading.Event, out: dict) -> None:
    """Peak memory of the simulator's processes until ``stop`` is set: the largest resident set (RSS) of one site
    process and the sum over all processes, which counts the pages they share (the libraries' code) once per
    process, and the sum of their proportional set sizes (PSS: a shared page split between its sharers), which is
    what they take from the machine's memory together; plus the machine's lowest available memory."""
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
            rss, pss = {}, 0
            for p in procs:
                try:
                    full = p.memory_full_info()
                    rss[p.pid] = (full.rss, " ".join(p.cmdline()))
                    pss += full.pss
                except psutil.Error:
                    pass
            sites = [r for r, cmd in rss.values() if "simulator_worker" in cmd]
            out["site_peak"] = max([out.get("site_peak", 0), *sites])
            out["total_peak"] = max(out.get("total_peak", 0), sum(r for r, _ in rss.values()))
            out["pss_peak"] = max(out.get("pss_peak", 0), pss)
            out["available_min"] = min(out.get("available_min", 1 << 62), psutil.virtual_memory().available)
        except psutil.Error:
            pass
        stop.wait(0.5)


def run(n: int, rounds: int, per_site: int, threads: int, scratch: Path) -> dict:
    job = customise_job(
        REPO / "jobs" / "fedavg_ich",
        scratch / f"n{n}" / "job",
        rounds,
        {
            "dataset": {
                "image_size": 32,
                "prepare": {
                    "num_sites": n,
                    "k": None,
                    "protocol": "random_s",
                    "s": 2,
                    "source_args": {"n_images": per_site * n + 80, "size": 32, "seed": 0},
                },
            },
            "evaluation": {"test_every": 0},
            "train": {"batch_size": 16},
        },
        seed=0,
        min_clients=n,
    )
    ws = scratch / f"n{n}" / "ws"
    t = min(n, threads)
    cmd = [
        str(Path(sys.executable).parent / "nvflare"),
        "simulator",
        str(job),
        "-w",
        str(ws),
        "-n",
        str(n),
        "-t",
        str(t),
    ]
    mem: dict = {}
    available_before = psutil.virtual_memory().available
    stop = threading.Event()
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = threading.Thread(target=sample_memory, args=(psutil.Process(proc.pid), stop, mem), daemon=True)
    sampler.start()
    _, err = proc.communicate()
    stop.set()
    sampler.join()
    res_file = ws / "server" / "simulate_job" / "results.json"
    if proc.returncode or not res_file.is_file():
        raise RuntimeError(f"{n} sites failed (rc {proc.returncode}): {err[-2000:]}")
    res = json.loads(res_file.read_text())
    rounds_ = [r for r in res["rounds"] if r.get("seconds")]
    local = [
        max(((t["train"] or 0) + (t["eval"] or 0) for t in r["site_seconds"].values()), default=0.0) for r in rounds_
    ]
    secs = [r["seconds"] for r in rounds_]
    return {
        "sites": n,
        "threads": t,
        "rounds": len(rounds_),
        "s_per_round": sum(secs) / len(secs),
        "slowest_site_s": sum(local) / len(local),
        "overhead_s": (sum(secs) - sum(local)) / len(secs),
        "site_peak_rss_mb": mem.get("site_peak", 0) / 2**20,
        "total_peak_rss_mb": mem.get("total_peak", 0) / 2**20,
        "total_peak_pss_mb": mem.get("pss_peak", 0) / 2**20,
        "available_before_mb": available_before / 2**20,
        "available_min_mb": mem.get("available_min", 0) / 2**20,
        "wall_s": time.time() - t0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[5, 10, 20, 50])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-site", type=int, default=24, help="training images per site")
    ap.add_argument("--threads", type=int, default=5, help="sites run in parallel (simulator -t)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedpartial-scale-") as tmp:
        for n in a.sites:
            rows.append(run(n, a.rounds, a.per_site, a.threads, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"jobs/fedavg_ich, {a.per_site} training images per site, 32 px, {a.rounds} rounds, at most "
        f"{a.threads} sites in parallel",
        "",
        "| sites | -t | s / round | slowest site s | round / slowest site | FL overhead s / round | overhead per "
        "site s | peak RSS one site (MB) | peak RSS all (MB) | peak PSS all (MB) | available before / lowest (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['sites']} | {r['threads']} | {r['s_per_round']:.1f} | {r['slowest_site_s']:.2f} | "
        f"{r['s_per_round'] / max(r['slowest_site_s'], 1e-9):.2f} | {r['overhead_s']:.1f} | "
        f"{r['overhead_s'] / r['sites']:.3f} | {r['site_peak_rss_mb']:.0f} | {r['total_peak_rss_mb']:.0f} | "
        f"{r['total_peak_pss_mb']:.0f} | {r['available_before_mb']:.0f} / {r['available_min_mb']:.0f} |"
        for r in rows
    ]
    print("\n".join(lines))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=2) + "\n")
        a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
