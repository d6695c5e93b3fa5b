"""Run jobs through the NVFlare simulator with identical budgets and seeds, and tabulate the final results.

    python benchmarks/run_jobs.py --jobs fedavg_ich fedavg_pl_ich fedavg_masked_ich fedavg_full_ich \
        --seeds 0 1 2 --rounds 20 --out benchmarks/results/ich_baselines.json

Each run copies ``jobs/<job>`` into a scratch folder with the package built into it, sets the number of rounds
and the seed (the initial global model, the sites' shuffling, augmentation and dropout; the data split stays the
preset's; same seed, same numbers),
runs ``nvflare simulator -n <sites> -t <sites>`` and reads ``results.json``. The table reports, per job, the
mean and standard deviation over seeds of the test metrics of the final global model (and of the model that
was best on validation), plus the wall time per round, and the same numbers in the papers' table layout
(``--out X.json`` also writes ``X.md``).

Variants of a job (ablations) run under their own name with extra method options, given to both the sites'
trainer and the server's rule: ``--variant "fedlsm_no_ue=fedlsm_isic:{\"ue\": false}"``; a ``"method"`` key runs
another registered method on the job's data and budget (``--variant 'individual=surgical_ich:{"method":
"individual"}'``). Runs go seed by seed
(every job of seed 0, then seed 1, ...) and the JSON is rewritten after every run, so an interrupted benchmark
keeps the runs that finished; the same command with ``--resume`` runs only the (configuration, seed) pairs still
missing from ``--out``.

``--compare A B`` (repeatable) adds the surgical-aggregation paper's statistics: for the last-round and the
best-on-validation model, a paired t-test of A against B over the per-class test AUROCs (per seed, and on the
per-class means over seeds) with the Shapiro-Wilk test of the differences (``fedpartial.stats``). Every
report also lists each run's macro test AUROC with its bootstrap 95 % interval (100 seeded resamples, from
``results.json``) and, for methods whose sites keep their task block (PFL, individual), the AUROC of each class
over the sites that annotate it (``own``).

``--gap LOWER UPPER`` adds, for every other configuration, the share of the gap between a lower and an upper
bound that it closes (``--gap-metric``, macro over classes, mean over seeds; FedLSM's "closes 59 % of the
macro-F1 gap"). ``--report X.json`` re-renders the tables (and the gap) of a finished benchmark without
running anything:

    python benchmarks/run_jobs.py --report benchmarks/results/fedlsm_ham10000.json \
        --gap fedavg_ham10000 fedavg_full_ham10000 --gap-metric f1
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

from fedpartial.fl.keys import BEST_MODEL, LAST_MODEL  # noqa: E402
from fedpartial.stats import paired_comparison, per_class_auc, stars  # noqa: E402
from fedpartial.tables import mean_std, paper_table, per_class_table  # noqa: E402
from fedpartial.tools.build_jobs import customise_job  # noqa: E402


def parse_variant(text: str) -> tuple[str, str, dict]:
    """``NAME=JOB:JSON`` -> (name, job, method options)."""
    name, _, rest = text.partition("=")
    job, _, opts = rest.partition(":")
    if not name or not job:
        raise argparse.ArgumentTypeError(f"variant must look like NAME=JOB:JSON, got {text!r}")
    return name, job, json.loads(opts or "{}")


def run_one(job: str, seed: int, rounds: int, sites: int, scratch: Path, overrides: dict, env: dict,
            name: str | None = None, method_args: dict | None = None) -> dict:
    """One simulator run of ``job`` (as ``name``) with ``method_args`` merged into both the sites' trainer and
    the server's rule options."""
    dest = scratch / f"{name or job}-s{seed}"
    method_args = dict(method_args or {})
    if "method" in method_args:  # a variant running another registered method on the job's data and budget
        overrides = {**overrides, "method": method_args.pop("method")}
    if method_args:
        overrides = {**overrides, "method_args": {**overrides.get("method_args", {}), **method_args}}
    customise_job(REPO / "jobs" / job, dest / "job", rounds, overrides, seed=seed, rule_args=method_args or None,
                  min_clients=sites)  # the simulator's -n: a job run with fewer or more sites than it names
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
    res["seed"] = seed
    return res


METRICS = {"multilabel": ["bacc", "auc", "map", "f1"], "multiclass": ["auc", "accuracy", "f1", "precision", "recall"]}


def tail_metrics(run: dict, k: int) -> dict[str, float]:
    """Macro test metrics of one run averaged over its last ``k`` test evaluations: the final evaluation of the
    last-round model and the ``k - 1`` latest per-round test evaluations (full or ``--compact`` runs)."""
    points = [c["test"] for c in run.get("curves", []) if c.get("test")]
    points = points or [r["test"]["macro"] for r in run.get("rounds", []) if r.get("test")]
    points = points[-(k - 1):] if k > 1 else []
    points.append(run["final"][LAST_MODEL]["test"]["macro"])
    keys = [m for m in points[-1] if all(p.get(m) is not None for p in points)]
    return {m: statistics.mean(p[m] for p in points) for m in keys}


def _mean_and_std(values: list) -> list[float] | None:
    s = mean_std(values)
    return None if s is None else [s[0], s[1]]


def summarise(runs: dict[str, list[dict]], tail: int = 0) -> list[dict]:
    """Per configuration, mean and std over seeds of the final / best-on-validation test metrics and, with
    ``tail`` > 1, of the per-seed mean over the last ``tail`` test evaluations."""
    rows = []
    for job, results in runs.items():
        row = {"job": job, "n_seeds": len(results)}
        for model in (LAST_MODEL, BEST_MODEL):
            tests = [r["final"][model]["test"] for r in results]
            task = tests[0]["task"]
            for m in METRICS[task]:
                tag = "final" if model == LAST_MODEL else "best"
                row[f"{tag}_{m}"] = _mean_and_std([t["macro"].get(m) for t in tests])
        if tail > 1:
            tails = [tail_metrics(r, tail) for r in results]
            for m in METRICS[task]:
                row[f"tail{tail}_{m}"] = _mean_and_std([t.get(m) for t in tails])
        own = [(r["final"][LAST_MODEL].get("own_classes") or {}).get("macro") for r in results]
        if any(v is not None for v in own):
            row["final_own_auc"] = _mean_and_std(own)
        row["s_per_round"] = statistics.mean(r["seconds_per_round"] for r in results)
        rows.append(row)
    return rows


def compact(res: dict) -> dict:
    """A run without the per-site detail of every round (macro validation / test curves and the method's
    per-site counters, ``site_stats``, kept)."""
    out = {k: v for k, v in res.items() if k != "rounds"}
    out["curves"] = [{"round": r["round"], "val": (r.get("val") or {}).get("macro"),
                      "test": (r.get("test") or {}).get("macro"), "site_stats": r.get("site_stats") or {}}
                     for r in res.get("rounds", [])]
    return out


def tables(runs: dict[str, list[dict]]) -> str:
    """The papers' layout (last-round and best-on-validation models on test) and per-class tables."""
    out = []
    for model, label in ((LAST_MODEL, "last-round global model"), (BEST_MODEL, "best-on-validation global model")):
        tests = {job: [r["final"][model]["test"] for r in rs] for job, rs in runs.items()}
        task = next(iter(tests.values()))[0]["task"]
        settings = {job: rs[0].get("setting", "?") for job, rs in runs.items()}
        partial = sorted({s for s in settings.values() if s != "full labels"}) or ["full labels"]
        by_setting = {}
        for job, rs in runs.items():  # a fully labelled reference run is the upper bound of every setting
            full = settings[job] == "full labels" and partial != ["full labels"]
            name = f"{job} (all labels: upper bound)" if full else job
            by_setting[name] = {s: [t["macro"] for t in tests[job]] for s in (partial if full else [settings[job]])}
        out.append(f"Test set, {label}, mean ± std over seeds (%):\n\n" + paper_table(by_setting, task))
        keys = (("BACC", "bacc"), ("AUC", "auc"), ("AP", "ap")) if task == "multilabel" else (("AUC", "auc"), ("F1", "f1"))
        out.append(f"Per class, {label}:\n\n" + per_class_table(tests, keys, task))
    return "\n\n".join(out)


def markdown(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k.startswith(("final_", "best_", "tail"))]
    head = "| job | seeds | " + " | ".join(keys) + " | s / round |"
    lines = [head, "|" + "---|" * (len(keys) + 3)]
    for r in rows:
        cells = ["n/a" if r.get(k) is None else f"{100 * r[k][0]:.2f} ± {100 * r[k][1]:.2f}" for k in keys]
        lines.append(f"| {r['job']} | {r['n_seeds']} | " + " | ".join(cells) + f" | {r['s_per_round']:.1f} |")
    return "\n".join(lines)


def gap_closed(runs: dict[str, list[dict]], lower: str, upper: str, metric: str = "f1") -> str:
    """Markdown table: for every configuration other than the bounds, the share of the ``lower -> upper`` gap
    of macro ``metric`` it closes, ``(m - m_lower) / (m_upper - m_lower)`` on seed means, for the last-round and
    the best-on-validation model."""
    for name in (lower, upper):
        if name not in runs:
            raise SystemExit(f"--gap: no configuration {name!r} in this benchmark (have {', '.join(runs)})")
    lines = [f"Share of the macro-{metric} gap between {lower} and {upper} closed (test set, mean over seeds):", "",
             f"| configuration | seeds | last-round {metric} | closed | best-on-validation {metric} | closed |",
             "|---|---|---|---|---|---|"]

    def mean(name: str, model: str) -> float:
        s = mean_std([r["final"][model]["test"]["macro"].get(metric) for r in runs[name]])
        return float("nan") if s is None else s[0]

    for name in runs:
        cells = []
        for model in (LAST_MODEL, BEST_MODEL):
            lo, hi, m = mean(lower, model), mean(upper, model), mean(name, model)
            share = (m - lo) / (hi - lo) if hi != lo else float("nan")
            cells += [f"{100 * m:.2f}", "bound" if name in (lower, upper) else f"{100 * share:.0f} %"]
        lines.append(f"| {name} | {len(runs[name])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ci_cell(test: dict) -> str:
    ci = ((test.get("ci") or {}).get("auc") or {}).get("macro")
    auc = (test.get("macro") or {}).get("auc")
    if auc is None:
        return "n/a"
    return f"{100 * auc:.2f}" + (f" [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]" if ci else "")


def intervals(runs: dict[str, list[dict]]) -> str:
    """Markdown: every run's macro test AUROC (last-round model) with its bootstrap 95 % interval."""
    seeds = sorted({r.get("seed") for rs in runs.values() for r in rs}, key=str)
    lines = ["Macro test AUROC of the last-round global model, bootstrap 95 % interval (100 resamples) (%):", "",
             "| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for name, rs in runs.items():
        by_seed = {r.get("seed"): r for r in rs}
        cells = [_ci_cell(by_seed[s]["final"][LAST_MODEL]["test"]) if s in by_seed else "" for s in seeds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(runs: dict[str, list[dict]], a: str, b: str) -> str:
    """Markdown: paired t-tests of ``a`` against ``b`` over the per-class test AUROCs, per common seed and on
    the per-class means over the common seeds, for the last-round and the best-on-validation model."""
    for name in (a, b):
        if name not in runs:
            raise SystemExit(f"--compare: no configuration {name!r} in this benchmark (have {', '.join(runs)})")
    sa, sb = {r.get("seed"): r for r in runs[a]}, {r.get("seed"): r for r in runs[b]}
    common = [s for s in sa if s in sb]
    lines = [f"{a} vs {b}: paired t-test over per-class test AUROCs (Shapiro-Wilk p of the differences; "
             "ns / * / ** / ***: p >= .05 / < .05 / < .01 / < .001):", "",
             "| model | seeds | classes | mean A | mean B | A - B | t | p | | Shapiro p |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model, label in ((LAST_MODEL, "last round"), (BEST_MODEL, "best on val")):
        per_seed = [(str(s), per_class_auc(sa[s]["final"][model]["test"]), per_class_auc(sb[s]["final"][model]["test"]))
                    for s in common]
        if len(per_seed) > 1:
            def mean_over(i):
                keys = set.intersection(*(set(p[i]) for p in per_seed))
                return {c: statistics.mean(p[i][c] for p in per_seed) for c in sorted(keys)}
            per_seed.append(("mean", mean_over(1), mean_over(2)))
        for seed, x, y in per_seed:
            r = paired_comparison(x, y)
            pct = lambda v, k=100: "n/a" if v is None else f"{k * v:.2f}"  # noqa: E731
            p = "n/a" if r["p"] is None else f"{r['p']:.3g}"
            sw = "n/a" if r["shapiro_p"] is None else f"{r['shapiro_p']:.3g}"
            lines.append(f"| {label} | {seed} | {r['n']} | {pct(r['mean_a'])} | {pct(r['mean_b'])} | "
                         f"{pct(r['mean_diff'])} | {pct(r['t'], 1)} | {p} | {stars(r['p'])} | {sw} |")
    return "\n".join(lines)


def report(a: argparse.Namespace, runs: dict[str, list[dict]]) -> str:
    text = markdown(summarise(runs, a.tail)) + "\n\n" + tables(runs) + "\n\n" + intervals(runs)
    for x, y in (a.compare or []):
        missing = [n for n in (x, y) if n not in runs]
        text += "\n\n" + (f"(compare: waiting for {', '.join(missing)})" if missing and not a.report
                           else compare(runs, x, y))
    if a.gap:
        missing = [name for name in a.gap if name not in runs]
        text += "\n\n" + (f"(gap: waiting for {', '.join(missing)})" if missing and not a.report
                          else gap_closed(runs, *a.gap, metric=a.gap_metric))
    return text


def save(a: argparse.Namespace, runs: dict[str, list[dict]], args: dict | None = None) -> None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    args = args or vars(a) | {"out": str(a.out)}
    a.out.write_text(json.dumps({"args": args, "summary": summarise(runs, a.tail),
                                 "tables": tables(runs), "runs": runs}, indent=1, default=str))
    a.out.with_suffix(".md").write_text(report(a, runs) + "\n")


def previous_runs(a: argparse.Namespace) -> dict[str, list[dict]]:
    """The runs of an earlier sitting of the same benchmark (``--resume``); each run carries its seed (older
    files: the seeds in the order they ran)."""
    if not a.out or not a.out.is_file():
        return {}
    data = json.loads(a.out.read_text())
    old = data["args"]
    for key in ("rounds", "sites", "override"):
        if json.dumps(old.get(key), sort_keys=True) != json.dumps(getattr(a, key), sort_keys=True):
            raise SystemExit(f"--resume: {a.out} was run with {key}={old.get(key)!r}, not {getattr(a, key)!r}")
    runs = data["runs"]
    for rs in runs.values():
        for run, seed in zip(rs, old.get("seeds", [])):
            run.setdefault("seed", seed)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=[])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--override", default="{}", help="JSON merged into every job's executor args")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch workspaces")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="run only these configurations (job or variant names) of the benchmark's list")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out (same rounds, sites and overrides) and run only the missing "
                         "(configuration, seed) pairs: a long benchmark can be run in several sittings")
    ap.add_argument("--compact", action="store_true",
                    help="store per run only the final / best results and the per-round validation macro metrics")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant, metavar="NAME=JOB:JSON",
                    help="also run JOB as NAME with these method options (repeatable)")
    ap.add_argument("--tail", type=int, default=0, metavar="K",
                    help="also report each metric averaged over the last K test evaluations of every run (the final "
                         "one included), less sensitive than the last round alone to round-to-round swings")
    ap.add_argument("--gap", nargs=2, metavar=("LOWER", "UPPER"), default=None,
                    help="report the share of the LOWER -> UPPER gap each other configuration closes")
    ap.add_argument("--compare", nargs=2, action="append", metavar=("A", "B"), default=None,
                    help="paired t-test of A against B over per-class test AUROCs (repeatable)")
    ap.add_argument("--gap-metric", default="f1", help="macro metric of --gap (f1, bacc, auc, map, ...)")
    ap.add_argument("--report", type=Path, default=None, metavar="X.json",
                    help="re-render the tables of a finished benchmark (rewrites X.md) and run nothing")
    a = ap.parse_args(argv)
    if a.report:
        data = json.loads(a.report.read_text())
        a.out = a.report
        save(a, data["runs"], args=data["args"])
        print(report(a, data["runs"]))
        return 0
    if not a.jobs and not a.variant:
        ap.error("give --jobs and/or --variant (or --report X.json)")
    runs = previous_runs(a) if a.resume else {}
    env = {**os.environ, "FEDPARTIAL_DATA_DIR": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    configs = [(job, job, None) for job in a.jobs] + list(a.variant)
    if a.only:
        unknown = sorted(set(a.only) - {name for name, _, _ in configs})
        if unknown:
            ap.error(f"--only: {unknown} not among the configurations {[name for name, _, _ in configs]}")
        configs = [c for c in configs if c[0] in a.only]
    base = json.loads(a.override)
    scratch = Path(tempfile.mkdtemp(prefix="fedpartial-bench-"))
    try:
        run_all(a, configs, runs, scratch, base, env)
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\n" + report(a, runs))
    return 0


def run_all(a: argparse.Namespace, configs: list, runs: dict[str, list[dict]], scratch: Path, base: dict,
            env: dict) -> None:
    """Every (configuration, seed) pair not yet in ``runs``, seed by seed; ``runs`` and ``--out`` grow as they
    finish."""
    for seed in a.seeds:  # seed-major: an interrupted benchmark keeps whole seeds
        for name, job, method_args in configs:
            if any(r.get("seed") == seed for r in runs.get(name, [])):
                print(f"{name} seed {seed}: already in {a.out}", flush=True)
                continue
            res = run_one(job, seed, a.rounds, a.sites, scratch, base, env, name, method_args)
            runs.setdefault(name, []).append(compact(res) if a.compact else res)
            fin = res["final"][LAST_MODEL]["test"]["macro"]
            print(f"{name} seed {seed}: test {json.dumps({k: round(v, 4) for k, v in fin.items() if v is not None})} "
                  f"({res['seconds_per_round']:.1f} s/round, {res['wall_seconds_total']:.0f} s)", flush=True)
            if a.out:  # rewritten after every run
                save(a, runs)


if __name__ == "__main__":
    raise SystemExit(main())
