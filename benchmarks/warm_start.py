"""Scratch against a federated self-supervised warm start at the same supervised budget.

    python benchmarks/warm_start.py --stage selfsup_cxr14 --stage-rounds 20 --jobs fedavg_pl_cxr14 fedmlp_cxr14 \\
        --lower fedavg_cxr14 --upper all_labels \\
        --variant 'all_labels=fedavg_pl_cxr14:{"dataset": {"prepare": {"protocol": "full", "k": null}}}' \\
        --rounds 20 --seeds 0 1 2 --out benchmarks/results/warm_start_cxr14

1. The stage (``jobs/<stage>/job.py --rounds R``, seed 0) runs once; its ``results.json`` names the encoder it wrote.
   The stage's wall time and its per-round kNN validation AUROC go into the report.
2. ``benchmarks/run_jobs.py`` runs every job from scratch and as a variant ``<job>_warm`` started from the encoder
   (``{"model": {"pretrained": <encoder>}}``: the same data, seeds, rounds and training), plus the all-labels
   bound (``--upper``) and the lower bound (``--lower``) from scratch, and reports the share of the gap each
   configuration closes (``--gap LOWER UPPER``).

``--labelled-only`` adds a second stage in which only the sites that annotate a class train (``method_args.sites:
labelled``; the others sit every round out) and a ``<job>_warm_labelled`` variant per job: whether the unlabelled
sites' images add anything. The stage's workspace is under ``--workdir`` (default: a temporary folder, removed
unless ``--keep``); the encoder path in the report is where it was written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_stage(stage: str, rounds: int, workspace: Path, extra: list[str] = ()) -> dict:
    """Run ``jobs/<stage>/job.py`` into ``workspace``; its ``results.json`` with the stage's wall time."""
    cmd = [
        sys.executable,
        str(REPO / "jobs" / stage / "job.py"),
        "--rounds",
        str(rounds),
        "--workspace",
        str(workspace),
    ]
    cmd += list(extra)
    print("stage:", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"the stage {stage} failed (exit {proc.returncode}); its logs are under {workspace}")
    res = json.loads(next(workspace.rglob("results.json")).read_text())
    res["stage_seconds"] = time.time() - t0
    return res


def stage_record(res: dict, name: str) -> dict:
    """What the report keeps of a stage: its encoder, wall time and per-round loss / kNN validation AUROC."""
    return {
        "name": name,
        "encoder": res["encoder"],
        "seconds": round(res["stage_seconds"], 1),
        "rounds": [
            {
                "round": r["round"],
                "loss": sum(r["train_loss"].values()) / max(len(r["train_loss"]), 1),
                "val_knn_auc": (r.get("val") or {}).get("macro", {}).get("auc"),
            }
            for r in res["rounds"]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", required=True, help="the self-supervised job (jobs/selfsup_*)")
    ap.add_argument("--stage-rounds", type=int, default=20)
    ap.add_argument(
        "--stage-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the stage's job.py --set (e.g. train.local_epochs=5: more passes per round)",
    )
    ap.add_argument("--jobs", nargs="+", required=True, help="the supervised jobs, each from scratch and warm")
    ap.add_argument("--upper", help="the all-labels bound's job (from scratch)")
    ap.add_argument("--lower", help="the lower bound's job (from scratch)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sites", type=int, help="simulated sites (default: the stage job's)")
    ap.add_argument("--gap-metric", default="auc", help="the metric of the gap share (run_jobs.py --gap-metric)")
    ap.add_argument(
        "--stage-results",
        type=Path,
        help="a finished stage's results.json: its encoder is used and the stage is not run again",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", required=True, help="X: writes X.json / X.md (run_jobs.py's report) and X_stage.json")
    ap.add_argument("--workdir", type=Path, help="where the stage runs (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the stage's workspace")
    ap.add_argument("--labelled-only", action="store_true", help="also a stage on the labelled sites only")
    ap.add_argument("--override", help="JSON merged into every supervised job's executor args (run_jobs.py)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JOB:JSON",
        help="more configurations from scratch, as run_jobs.py's (e.g. an all-labels bound without a job of its own:"
        ' \'fedavg_pl_full=fedavg_pl_cxr14:{"dataset": {"prepare": {"protocol": "full", "k": null}}}\'); '
        "--upper / --lower may name them",
    )
    a = ap.parse_args(argv)

    work = a.workdir or Path(tempfile.mkdtemp(prefix="warm_start_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sets = [x for kv in a.stage_set for x in ("--set", kv)]
        if a.stage_results:
            res = json.loads(a.stage_results.read_text())
            res["stage_seconds"] = float(res.get("wall_seconds") or 0.0)
        else:
            res = run_stage(a.stage, a.stage_rounds, work / "all", sets)
        stages = [stage_record(res, "all sites")]
        variants = [f"{job}_warm={job}:{json.dumps({'model': {'pretrained': res['encoder']}})}" for job in a.jobs]
        if a.labelled_only:
            only = run_stage(a.stage, a.stage_rounds, work / "labelled", [*sets, "--set", "method_args.sites=labelled"])
            stages.append(stage_record(only, "labelled sites only"))
            variants += [
                f"{job}_warm_labelled={job}:{json.dumps({'model': {'pretrained': only['encoder']}})}" for job in a.jobs
            ]
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"stage": a.stage, "stage_rounds": a.stage_rounds, "stage_set": a.stage_set, "stages": stages}
        out.with_name(out.name + "_stage.json").write_text(json.dumps(record, indent=1))
        named = {v.split("=", 1)[0] for v in a.variant}
        jobs = list(a.jobs) + [j for j in (a.lower, a.upper) if j and j not in named]
        variants += list(a.variant)
        cmd = [sys.executable, str(REPO / "benchmarks" / "run_jobs.py"), "--jobs", *jobs, "--rounds", str(a.rounds)]
        sites = (
            a.sites
            or json.loads((REPO / "jobs" / a.stage / "app/config/config_fed_server.json").read_text())["min_clients"]
        )
        cmd += ["--seeds", *map(str, a.seeds), "--sites", str(sites), "--out", str(out.with_suffix(".json"))]
        cmd += ["--compact"]
        for v in variants:
            cmd += ["--variant", v]
        if a.lower and a.upper:
            cmd += ["--gap", a.lower, a.upper, "--gap-metric", a.gap_metric]
        if a.override:
            cmd += ["--override", a.override]
        print("supervised:", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=REPO).returncode
    finally:
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
