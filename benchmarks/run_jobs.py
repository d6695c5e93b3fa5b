"""Run jobs through the NVFlare simulator with identical budgets and seeds, and tabulate the final results.

    python benchmarks/run_jobs.py --jobs fedavg_ich fedavg_pl_ich fedavg_masked_ich fedavg_full_ich \
        --seeds 0 1 2 --rounds 20 --out benchmarks/results/ich_baselines.json

Each run copies ``jobs/<job>`` into a scratch folder with the package built into it, sets the number of rounds
and the seed (the initial global model, the sites' shuffling, augmentation and dropout; the data split stays the
preset's; same seed, same numbers),
runs it in NVFlare's simulator with ``<sites>`` sites training at once (``python -m fedpartial.fl.simulator JOB -w WS
-n N -t N``, the simulator ``job.py`` runs: its own ports, a site that cannot start fails the run at once, Ctrl-C
stops the run whole and keeps the finished ones) and reads ``results.json``. The table reports, per job, the
mean and standard deviation over seeds of the test metrics of the final global model (and of the model that
was best on validation), plus the wall time per round, and the same numbers in the papers' table layout
(``--out X.json`` also writes ``X.md``). ``X.json`` is the summary the repository keeps: the command, the commit,
the arguments and per configuration and seed the final macro test metrics (a few KB); every run's whole
``results.json`` (per-round histories, per-site results) goes to ``X.runs.json.gz`` beside it (gzip, tracked, so a
fresh clone can ``--report`` and ``--resume`` a table that other machines began; ``X.runs.json`` of older runs is
still read).

Variants of a job (ablations) run under their own name with extra method options, given to both the sites'
trainer and the server's rule: ``--variant "fedlsm_no_ue=fedlsm_isic:{\"ue\": false}"``; a ``"method"`` key runs
another registered method on the job's data and budget (``--variant 'individual=surgical_ich:{"method":
"individual"}'``), a ``"dataset"`` or ``"model"`` key other data or model settings (``{"model": {"pretrained":
"encoder.pt"}}``: the job started from a warm-start encoder). Runs go seed by seed
(every job of seed 0, then seed 1, ...) and the JSON is rewritten after every run, so an interrupted benchmark
keeps the runs that finished; the same command with ``--resume`` runs only the (configuration, seed) pairs still
missing from ``--out``.

``--compare A B`` (repeatable) adds the surgical-aggregation paper's statistics: for the last-round and the
best-on-validation model, a paired t-test of A against B over the per-class test AUROCs (per seed, and on the
per-class means over seeds) with the Shapiro-Wilk test of the differences (``fedpartial.stats``). Every
report also lists each run's macro test AUROC with its bootstrap 95 % interval (100 seeded resamples, from
``results.json``) and, for methods whose sites keep their task block (PFL, individual), the AUROC of each class
over the sites that annotate it (``own``).

Overrides: ``--override JSON`` is merged into every job's executor args (nested dicts key by key; a JSON
``null`` sets the value to null, which ``dataset.prepare`` reads as "parameter not given"). ``--unset PATH``
(repeatable, dotted, e.g. ``--unset dataset.prepare.k``) removes a key after the merge: from the sites' executor
args and, for ``method_args.*`` / ``model.*``, from the server's rule / model args too; where the job's dataset
preset also defines the key (``dataset.*``), it is set to null instead, so the preset's value does not come
back. A path the job and its preset lack is an error (a typo).

Progress: before every run a line ``run k / N: NAME seed S (elapsed ..., about ... left)`` (N: the runs this
command has to do, ``--resume``'s finished ones left out; the estimate is the mean wall time of this command's
finished runs times the runs left), while a run goes a line ``NAME seed S: round r / R (... s)`` each time its
server log shows a new round (checked every ``--progress-every`` seconds, default 30), and after it the test
metrics with the elapsed and remaining time.

When a run fails, the first ERROR records and exception lines of the server's and sites' logs
(``WS/server/log.txt``, ``WS/site-*/log.txt``; shutdown noise left out) are printed with the workspace path, the
scratch folder is kept, the finished runs stay in ``--out`` and the exit status is 1.

Plots: at the end, ``--out X.json`` also writes ``X_curves.png`` (per-round validation macro ``--plot-metric``, default
auc, of every configuration: mean over seeds with a ± std band) and ``X_final.png`` (bars of the final test
macro metric of the last-round and best-on-validation models, mean ± std over seeds); ``--no-plots`` skips them.

``--gap LOWER UPPER`` adds, for every other configuration, the share of the gap between a lower and an upper
bound that it closes (``--gap-metric``, macro over classes, mean over seeds; FedLSM's "closes 59 % of the
macro-F1 gap"). ``--report X.json`` re-renders the tables (and the gap) of a finished benchmark without
running anything:

    python benchmarks/run_jobs.py --report benchmarks/results/fedlsm_ham10000.json \
        --gap fedavg_ham10000 fedavg_full_ham10000 --gap-metric f1
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedpartial.data.presets import PRESETS, deep_merge  # noqa: E402
from fedpartial.fl.keys import BEST_MODEL, LAST_MODEL  # noqa: E402
from fedpartial.fl.simulator import Stopped, supervise  # noqa: E402
from fedpartial.recipes import signal_name  # noqa: E402
from fedpartial.stats import paired_comparison, per_class_auc, stars  # noqa: E402
from fedpartial.tables import curves_figure, final_bar_figure, mean_std, paper_table, per_class_table, save_figure  # noqa: E402
from fedpartial.tools.build_jobs import customise_job  # noqa: E402


def parse_variant(text: str) -> tuple[str, str, dict]:
    """``NAME=JOB:JSON`` -> (name, job, method options)."""
    name, _, rest = text.partition("=")
    job, _, opts = rest.partition(":")
    if not name or not job:
        raise argparse.ArgumentTypeError(f"variant must look like NAME=JOB:JSON, got {text!r}")
    return name, job, json.loads(opts or "{}")


# ------------------------------------------------------------------------------------- override removal
SIMULATOR = (
    "fedpartial.fl.simulator"  # NVFlare's simulator (what SimEnv runs), supervised: ports, failed starts, Ctrl-C
)
UNSET = "__fedpartial_unset__"  # marks a key --unset removes, carried through customise_job's merge


def merge_unset(override: dict, paths: list[str]) -> dict:
    """A copy of ``override`` with the marker ``UNSET`` at every dotted path of ``paths`` (``--unset``)."""
    out = copy.deepcopy(override)
    for path in paths or []:
        keys = path.split(".")
        if not all(keys):
            raise SystemExit(f"--unset {path!r}: give a dotted key path such as dataset.prepare.k")
        node = out
        for i, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--unset {path}: --override sets {'.'.join(keys[: i + 1])} to a non-dict value")
        if keys[-1] in node and node[keys[-1]] != UNSET:
            raise SystemExit(f"--unset {path}: --override also sets it ({node[keys[-1]]!r})")
        node[keys[-1]] = UNSET
    return out


def resolve_unset(obj, fallback: dict | None = None):
    """``obj`` without the keys marked ``UNSET`` (nested dicts and lists walked); a marked key that ``fallback``
    (the same nesting: values a preset would bring back) also holds becomes None instead."""
    if isinstance(obj, list):
        return [resolve_unset(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        fb = fallback.get(k) if isinstance(fallback, dict) else None
        if isinstance(v, str) and v == UNSET:
            if isinstance(fallback, dict) and k in fallback:
                out[k] = None
            continue
        out[k] = resolve_unset(v, fb if isinstance(fb, dict) else None)
    return out


def preset_fallback(executor_args: dict) -> dict:
    """What a key removed from the executor args could come back from: the dataset preset."""
    ds = executor_args.get("dataset")
    preset = ds if isinstance(ds, str) else (ds or {}).get("preset") if isinstance(ds, dict) else None
    return {"dataset": PRESETS.get(preset, {})} if preset else {}


def apply_unset_to_job(job_dir: Path) -> None:
    """Resolve the ``UNSET`` markers in a customised job's client and server configs (:func:`resolve_unset`)."""
    client = job_dir / "app/config/config_fed_client.json"
    ccfg = json.loads(client.read_text())
    for ex in ccfg.get("executors", []):
        args = ex.get("executor", {}).get("args")
        if isinstance(args, dict):
            ex["executor"]["args"] = resolve_unset(args, preset_fallback(args))
    client.write_text(json.dumps(resolve_unset(ccfg), indent=1))
    server = job_dir / "app/config/config_fed_server.json"
    server.write_text(json.dumps(resolve_unset(json.loads(server.read_text())), indent=1))


def check_unset(job: str, paths: list[str]) -> None:
    """Every ``--unset`` path names a key of the job's executor args or of its dataset preset."""
    if not paths:
        return
    ccfg = json.loads((REPO / "jobs" / job / "app/config/config_fed_client.json").read_text())
    args = ccfg["executors"][0]["executor"]["args"]
    for path in paths:
        found = False
        for root in (args, preset_fallback(args)):
            node = root
            for key in path.split("."):
                node = node.get(key, UNSET) if isinstance(node, dict) else UNSET
            found |= not (isinstance(node, str) and node == UNSET)
        if not found:
            raise SystemExit(f"--unset {path}: job {job} (and its dataset preset) has no such key")


# ------------------------------------------------------------------------------------ failure report
ERROR_RECORD = re.compile(r" - (ERROR|CRITICAL) - ")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b:?")
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")
# records NVFlare writes while a failed run shuts down (the cells lose each other): not the cause
LOG_NOISE = (
    "target_unreachable",
    "cannot send to",
    "no connection to",
    "abort_signal triggered",
    "Broken pipe",
    "Connection reset",
)


class RunFailed(RuntimeError):
    """A simulator run without results; ``workspace`` is its workspace folder."""

    def __init__(self, message: str, workspace: Path):
        super().__init__(message)
        self.workspace = workspace


def workspace_logs(ws: Path) -> list[Path]:
    """The simulator's log files: the server's, then every site's (``site-10`` after ``site-9``), then any other
    ``log.txt`` under ``ws``."""

    def natural(p: Path):
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p.relative_to(ws)))]

    first = [ws / "server" / "log.txt"] + sorted(ws.glob("site-*/log.txt"), key=natural)
    rest = sorted((p for p in ws.rglob("log.txt") if p not in first), key=natural) if ws.is_dir() else []
    return [p for p in first + rest if p.is_file()]


def first_errors(path: Path, limit: int = 6, width: int = 400) -> list[tuple[int, str]]:
    """The first ``limit`` error lines of a log file as ``(line number, text)``: ERROR / CRITICAL records (their
    first line) and, of each traceback, its last frame line and its exception line; shutdown noise
    (``LOG_NOISE``) left out, a message already listed (timestamp aside) not repeated."""
    out: list[tuple[int, str]] = []
    seen: set[str] = set()
    lines = path.read_text(errors="replace").splitlines()

    def add(i: int, text: str) -> None:
        key = TIMESTAMP.sub("", text).strip()
        if key and key not in seen and not any(n in text for n in LOG_NOISE):
            seen.add(key)
            out.append((i + 1, text.strip()[:width]))

    i = 0
    while i < len(lines) and len(out) < limit:
        line = lines[i]
        if line.rstrip().endswith("Traceback (most recent call last):"):  # NVFlare logs it as an ERROR record
            j, frame = i + 1, None
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
                if lines[j].lstrip().startswith("File "):
                    frame = j
                j += 1
            if frame is not None:
                add(frame, lines[frame])
            if j < len(lines):
                add(j, lines[j])
            i = j + 1
            continue
        if ERROR_RECORD.search(line) or (not TIMESTAMP.match(line) and EXCEPTION_LINE.match(line)):
            add(i, line)
        i += 1
    return out[:limit]


def workspace_errors(ws: Path, per_file: int = 6, total: int = 24) -> str:
    """The first error lines (:func:`first_errors`) of the workspace's logs, the file whose first error is the
    earliest first (the component that failed first), at most ``total`` lines; "" when there is none."""
    found = []
    for path in workspace_logs(ws):
        errs = first_errors(path, per_file)
        if errs:  # when: the last timestamp at or before the first error line (tracebacks carry none)
            lines = path.read_text(errors="replace").splitlines()[: errs[0][0]]
            stamps = [m.group(0) for m in map(TIMESTAMP.match, reversed(lines)) if m]
            found.append((stamps[0] if stamps else "", str(path.relative_to(ws)), errs))
    found.sort(key=lambda f: f[0])  # stable: server before sites on equal stamps
    out, n = [], 0
    for _, rel, errs in found:
        if n >= total:
            out.append(f"  ... (more in {rel})")
            continue
        out.append(f"  {rel}:")
        for line_no, text in errs[: total - n]:
            out.append(f"    line {line_no}: {text}")
            n += 1
    return "\n".join(out)


def failure_message(label: str, rc: int, ws: Path, stdout: str = "", stderr: str = "") -> str:
    """What a failed run prints: the workspace, its logs' first errors, the end of stderr, and the end of the
    simulator's own output when the logs hold no error."""
    text = f"{label} failed (rc {rc}); workspace {ws}"
    errors = workspace_errors(ws) if ws.is_dir() else ""
    text += (
        ("\nfirst errors in the workspace logs:\n" + errors)
        if errors
        else f"\nno ERROR record in the workspace logs ({ws / 'server/log.txt'}, {ws / 'site-*/log.txt'})"
    )
    if stderr.strip():
        text += "\nstderr (end):\n" + "\n".join("  " + s for s in stderr.strip().splitlines()[-15:])
    if not errors and stdout.strip():
        text += "\nsimulator output (end):\n" + "\n".join("  " + s for s in stdout.strip().splitlines()[-15:])
    return text


PROGRESS_EVERY = 30.0  # seconds between two reads of a running simulation's server log (--progress-every)
ROUND_LINE = re.compile(r"Round (\d+) (started|finished)\.")


def rounds_done(server_log: Path) -> int:
    """Rounds the server log reports finished (NVFlare's ``ScatterAndGather``: ``Round r finished.``, r from 0)."""
    try:
        text = server_log.read_text(errors="replace")
    except OSError:
        return 0
    done = [int(m.group(1)) + 1 for m in ROUND_LINE.finditer(text) if m.group(2) == "finished"]
    return max(done, default=0)


def simulate(
    cmd: list[str], env: dict, cwd: str, ws: Path, label: str, rounds: int, every: float = 30.0
) -> subprocess.CompletedProcess:
    """Run the simulator ``cmd`` with its output captured (into files beside the workspace, not pipes); every
    ``every`` seconds, print ``label: round r / rounds (t s)`` when the server log of ``ws`` shows a new round."""
    ws.parent.mkdir(parents=True, exist_ok=True)
    out_path, err_path = ws.parent / "simulator.out", ws.parent / "simulator.err"
    t0, shown = time.time(), [0]

    def tick() -> None:
        done = rounds_done(ws / "server" / "log.txt")
        if done > shown[0]:
            shown[0] = done
            print(f"  {label}: round {done} / {rounds} ({time.time() - t0:.0f} s)", flush=True)

    with open(out_path, "w") as out, open(err_path, "w") as err:  # Ctrl-C / SIGTERM: the run is stopped, whole
        status = supervise(cmd, env=env, tick=tick, every=every, cwd=cwd, stdout=out, stderr=err, text=True)
    return subprocess.CompletedProcess(
        cmd, status, stdout=out_path.read_text(errors="replace"), stderr=err_path.read_text(errors="replace")
    )


def duration(seconds: float) -> str:
    """``seconds`` in words a progress line reads at a glance: ``42 s``, ``12 min 05 s``, ``2 h 03 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Run k of N with the elapsed time and an estimate of the time left (the mean wall time of the runs done so
    far, times the runs left; none before the first run ends)."""

    def __init__(self, total: int, clock=time.time):
        self.total, self.clock, self.start, self.done = total, clock, clock(), 0

    def remaining(self) -> float | None:
        if not self.done:
            return None
        return (self.clock() - self.start) / self.done * (self.total - self.done)

    def times(self) -> str:
        left = self.remaining()
        return f"elapsed {duration(self.clock() - self.start)}" + (
            f", about {duration(left)} left" if left is not None else ""
        )

    def starting(self, label: str) -> str:
        return f"run {self.done + 1} / {self.total}: {label} ({self.times()})"

    def finished(self) -> str:
        self.done += 1
        return f"{self.done} / {self.total} done, {self.times()}"


def run_one(
    job: str,
    seed: int,
    rounds: int,
    sites: int,
    scratch: Path,
    overrides: dict,
    env: dict,
    name: str | None = None,
    method_args: dict | None = None,
) -> dict:
    """One simulator run of ``job`` (as ``name``) with ``method_args`` merged into both the sites' trainer and
    the server's rule options."""
    dest = scratch / (re.sub(r"[^A-Za-z0-9_.@-]", "_", name or job) + f"-s{seed}")  # paper names: FedAvg*, ...
    method_args = dict(method_args or {})
    if "method" in method_args:  # a variant running another registered method on the job's data and budget
        overrides = {**overrides, "method": method_args.pop("method")}
    if "dataset" in method_args:  # a variant on other data settings (e.g. {"dataset": {"prepare": {"k": 2}}})
        overrides = {**overrides, "dataset": deep_merge(overrides.get("dataset", {}), method_args.pop("dataset"))}
    if "model" in method_args:  # a variant on other model settings (e.g. {"model": {"pretrained": "encoder.pt"}})
        overrides = {**overrides, "model": deep_merge(overrides.get("model", {}), method_args.pop("model"))}
    if method_args:
        overrides = {**overrides, "method_args": {**overrides.get("method_args", {}), **method_args}}
    customise_job(
        REPO / "jobs" / job,
        dest / "job",
        rounds,
        overrides,
        seed=seed,
        rule_args=method_args or None,
        min_clients=sites,
    )  # the simulator's -n: a job run with fewer or more sites than it names
    apply_unset_to_job(dest / "job")  # --unset: keys removed after the merge
    t0 = time.time()
    proc = simulate(
        [
            sys.executable,
            "-m",
            SIMULATOR,
            str(dest / "job"),
            "-w",
            str(dest / "ws"),
            "-n",
            str(sites),
            "-t",
            str(sites),
        ],
        env,
        str(REPO),
        dest / "ws",
        f"{name or job} seed {seed}",
        rounds,
        every=PROGRESS_EVERY,
    )
    wall = time.time() - t0
    res_file = dest / "ws/server/simulate_job/results.json"
    if proc.returncode != 0 or not res_file.is_file():
        label = f"{name or job}" + (f" (job {job})" if name and name != job else "") + f" seed {seed}"
        if proc.returncode == 0:
            label += f" wrote no {res_file.relative_to(dest / 'ws')}"
        raise RunFailed(
            failure_message(label, proc.returncode, dest / "ws", proc.stdout or "", proc.stderr or ""), dest / "ws"
        )
    res = json.loads(res_file.read_text())
    if not ((res.get("final") or {}).get(LAST_MODEL) or {}).get("test"):
        label = f"{name or job} seed {seed}"
        raise RunFailed(
            f"{label}: no site reported a test result of {LAST_MODEL} in the final cross-site evaluation "
            f"(evaluated by {((res.get('final') or {}).get(LAST_MODEL) or {}).get('sites')}); the "
            f"server log: {dest / 'ws/server/log.txt'}",
            dest / "ws",
        )
    late = {r["round"]: r["missing"] for r in res.get("rounds", []) if r.get("missing")}
    if late:  # simulated sites cannot die: a round closed without a site that took too long
        print(
            f"warning: {name or job} seed {seed}: round(s) closed without slow site(s) {late}",
            file=sys.stderr,
            flush=True,
        )
    res["wall_seconds_total"] = wall
    res["seed"] = seed
    return res


# *_val_thr: at the per-class thresholds chosen on validation (fedpartial.metrics; None for older runs)
METRICS = {
    "multilabel": ["bacc", "auc", "map", "f1", "bacc_val_thr", "f1_val_thr"],
    "multiclass": ["auc", "accuracy", "f1", "precision", "recall"],
}


def tail_metrics(run: dict, k: int) -> dict[str, float]:
    """Macro test metrics of one run averaged over its last ``k`` test evaluations: the final evaluation of the
    last-round model and the ``k - 1`` latest per-round test evaluations (full or ``--compact`` runs)."""
    points = [c["test"] for c in run.get("curves", []) if c.get("test")]
    points = points or [r["test"]["macro"] for r in run.get("rounds", []) if r.get("test")]
    points = points[-(k - 1) :] if k > 1 else []
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
        row, task = {"job": job, "n_seeds": len(results)}, None
        for model in (LAST_MODEL, BEST_MODEL):
            tests = [r["final"][model]["test"] for r in results if model in r.get("final", {})]
            if len(tests) < len(results):
                lacking = [r.get("seed") for r in results if model not in r.get("final", {})]
                print(
                    f"warning: {job}: seed(s) {lacking} have no test result of {model}; its rows use "
                    f"{len(tests)} seed(s)",
                    file=sys.stderr,
                )
            if not tests:
                continue
            task = tests[0]["task"]
            for m in METRICS[task]:
                tag = "final" if model == LAST_MODEL else "best"
                row[f"{tag}_{m}"] = _mean_and_std([t["macro"].get(m) for t in tests])
        if tail > 1 and task:
            tails = [tail_metrics(r, tail) for r in results]
            for m in METRICS[task]:
                row[f"tail{tail}_{m}"] = _mean_and_std([t.get(m) for t in tails])
        own = [((r.get("final", {}).get(LAST_MODEL) or {}).get("own_classes") or {}).get("macro") for r in results]
        if any(v is not None for v in own):
            row["final_own_auc"] = _mean_and_std(own)
        row["s_per_round"] = statistics.mean(r["seconds_per_round"] for r in results)
        rows.append(row)
    return rows


def compact(res: dict) -> dict:
    """A run without the per-site detail of every round (macro validation / test curves, the method's per-site
    counters, ``site_stats``, to 4 significant digits (a relation matrix a site sends every round is 49 of them),
    the updates the server refused, ``rejected``, and the sites a round closed without, ``missing``, kept)."""
    out = {k: v for k, v in res.items() if k != "rounds"}
    out["curves"] = [
        {
            "round": r["round"],
            "val": (r.get("val") or {}).get("macro"),
            "test": (r.get("test") or {}).get("macro"),
            "site_stats": rounded(r.get("site_stats") or {}, COUNTER_SIGNIFICANT),
            "rejected": r.get("rejected") or {},
            "missing": r.get("missing") or [],
        }
        for r in res.get("rounds", [])
    ]
    return out


def row_name(config: str) -> str:
    """The table row of a configuration: its name up to ``@`` (``fedavg@m2`` / ``fedavg@m4`` are one method run
    under two settings)."""
    return config.split("@", 1)[0]


def tables(runs: dict[str, list[dict]]) -> str:
    """The papers' layout (last-round and best-on-validation models on test) and per-class tables."""
    out = []
    for model, label in ((LAST_MODEL, "last-round global model"), (BEST_MODEL, "best-on-validation global model")):
        tests = {
            job: [r["final"][model]["test"] for r in rs if (r["final"].get(model) or {}).get("test")]
            for job, rs in runs.items()
        }
        tests = {job: t for job, t in tests.items() if t}  # (a run without a best-on-validation model: none)
        if not tests:
            continue
        task = next(iter(tests.values()))[0]["task"]
        settings = {job: rs[0].get("setting", "?") for job, rs in runs.items()}
        partial = sorted({s for s in settings.values() if s != "full labels"}) or ["full labels"]
        by_setting, upper = {}, []
        for job in tests:  # a fully labelled reference run is the upper bound of every setting
            full = settings[job] == "full labels" and partial != ["full labels"]
            row = row_name(job)  # "fedavg@m2" and "fedavg@m4": one row, two settings
            name = f"{row} (all labels: upper bound)" if full else row
            upper += [name] if full else []
            for s in partial if full else [settings[job]]:
                by_setting.setdefault(name, {})[s] = [t["macro"] for t in tests[job]]
        by_setting = {k: by_setting[k] for k in [*(n for n in by_setting if n not in upper), *upper]}  # bound last
        out.append(
            f"Test set, {label}, mean ± std over seeds (%; best **bold**, second _underlined_, the upper "
            f"bound not ranked):\n\n" + paper_table(by_setting, task, settings=partial, not_ranked=upper)
        )
        keys = (
            (("BACC", "bacc"), ("AUC", "auc"), ("AP", "ap")) if task == "multilabel" else (("AUC", "auc"), ("F1", "f1"))
        )
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
    lines = [
        f"Share of the macro-{metric} gap between {lower} and {upper} closed (test set, mean over seeds):",
        "",
        f"| configuration | seeds | last-round {metric} | closed | best-on-validation {metric} | closed |",
        "|---|---|---|---|---|---|",
    ]

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


def class_subset(
    runs: dict[str, list[dict]], classes: list[str], metrics=("auc", "ap"), gap: list[str] | None = None
) -> str:
    """Markdown table: per configuration, the mean over ``classes`` of each per-class test metric (mean ± std
    over seeds) for the last-round and the best-on-validation model, and with ``gap`` (lower, upper) the share
    of the lower -> upper gap of the first metric closed on these classes."""

    def value(run: dict, model: str, metric: str) -> float:
        per = run["final"][model]["test"]["per_class"]
        unknown = [c for c in classes if c not in per]
        if unknown:
            raise SystemExit(f"--classes: {unknown} not among the classes {list(per)}")
        vals = [per[c].get(metric) for c in classes]
        return statistics.mean(vals) if all(v is not None for v in vals) else float("nan")

    heads = [f"{label} {m}" for label in ("last-round", "best-on-validation") for m in metrics]
    lines = [
        f"Mean over the classes {', '.join(classes)} (test set, mean ± std over seeds, %):",
        "",
        "| configuration | seeds | " + " | ".join(heads) + (" | closed (last round) |" if gap else " |"),
        "|---|---|" + "---|" * (len(heads) + bool(gap)),
    ]
    means = {name: statistics.mean(value(r, LAST_MODEL, metrics[0]) for r in rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        cells = []
        for model in (LAST_MODEL, BEST_MODEL):
            for m in metrics:
                ms = mean_std([value(r, model, m) for r in rs])
                cells.append("n/a" if ms is None else f"{100 * ms[0]:.2f} ± {100 * ms[1]:.2f}")
        if gap:
            lo, hi = (means.get(g, float("nan")) for g in gap)
            cells.append("bound" if name in gap else f"{100 * (means[name] - lo) / (hi - lo):.0f} %")
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
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
    lines = [
        "Macro test AUROC of the last-round global model, bootstrap 95 % interval (100 resamples) (%):",
        "",
        "| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
    ]
    for name, rs in runs.items():
        by_seed = {r.get("seed"): r for r in rs}
        cells = [_ci_cell(by_seed[s]["final"][LAST_MODEL]["test"]) if s in by_seed else "" for s in seeds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("[" not in line for line in lines[4:]):
        lines += [
            "",
            "A value without an interval is pooled over several sites' evaluations (e.g. each site scoring "
            "with its own norm layers under FedBN): such a pool has no single bootstrap interval; each "
            "site's own interval is in its per-site result (`results.json`).",
        ]
    return "\n".join(lines)


def compare(runs: dict[str, list[dict]], a: str, b: str) -> str:
    """Markdown: paired t-tests of ``a`` against ``b`` over the per-class test AUROCs, per common seed and on
    the per-class means over the common seeds, for the last-round and the best-on-validation model."""
    for name in (a, b):
        if name not in runs:
            raise SystemExit(f"--compare: no configuration {name!r} in this benchmark (have {', '.join(runs)})")
    sa, sb = {r.get("seed"): r for r in runs[a]}, {r.get("seed"): r for r in runs[b]}
    common = [s for s in sa if s in sb]
    lines = [
        f"{a} vs {b}: paired t-test over per-class test AUROCs (Shapiro-Wilk p of the differences; "
        "ns / * / ** / ***: p >= .05 / < .05 / < .01 / < .001):",
        "",
        "| model | seeds | classes | mean A | mean B | A - B | t | p | | Shapiro p |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, label in ((LAST_MODEL, "last round"), (BEST_MODEL, "best on val")):
        per_seed = [
            (str(s), per_class_auc(sa[s]["final"][model]["test"]), per_class_auc(sb[s]["final"][model]["test"]))
            for s in common
        ]
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
            lines.append(
                f"| {label} | {seed} | {r['n']} | {pct(r['mean_a'])} | {pct(r['mean_b'])} | "
                f"{pct(r['mean_diff'])} | {pct(r['t'], 1)} | {p} | {stars(r['p'])} | {sw} |"
            )
    return "\n".join(lines)


def method_counters(run: dict) -> dict[str, float]:
    """A run's method counters (the sites' per-round ``site_stats``: FedLSM's ``fedlsm_pseudo``, FedIRM's
    ``fedirm_selected``, FedMLP's ``fedmlp_new_pseudo``, ...): integer counters summed over sites and rounds, other
    numbers averaged over the site-rounds that report them; lists (matrices, pools) left out."""
    values: dict[str, list] = {}
    for rnd in run.get("curves") or run.get("rounds") or []:
        for stats in (rnd.get("site_stats") or {}).values():
            for k, v in (stats or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    values.setdefault(k, []).append(v)
    return {k: sum(v) if all(isinstance(x, int) for x in v) else statistics.mean(v) for k, v in values.items()}


def counters_table(runs: dict[str, list[dict]]) -> str:
    """Each configuration's method counters (:func:`method_counters`) per seed: what the method did, beside what it
    scored (an integer: the total over sites and rounds; a fraction: the mean of a site's round)."""
    seeds = sorted({r.get("seed", k) for rs in runs.values() for k, r in enumerate(rs)})
    lines = []
    for name, rs in runs.items():
        per_seed = {r.get("seed", k): method_counters(r) for k, r in enumerate(rs)}
        for key in sorted({k for c in per_seed.values() for k in c}):
            cells = [f"{per_seed[s][key]:.4g}" if key in per_seed.get(s, {}) else "-" for s in seeds]
            lines.append(f"| {name} | {key} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    return "\n".join(
        [
            "Method counters per seed (integers: summed over sites and rounds; others: the mean over site-rounds):",
            "",
            "| configuration | counter | " + " | ".join(f"seed {s}" for s in seeds) + " |",
            "|---|---|" + "---|" * len(seeds),
            *lines,
        ]
    )


def inferred_counts(run: dict) -> dict[str, list[float]]:
    """A run's per-class counts at the classes each site does not annotate, summed over the sites, from the last
    round that reports them: what the method inferred for the labels a site lacks (FedLSM's ``fedlsm_q`` from its
    teacher's pseudo labels, CBAFed's pseudo positives, ...). Read from the method's declared per-class ``count``
    statistics of one value per class; a site's counts at its own annotated classes are its labels and left out."""
    from fedpartial.methods import get_method

    try:
        keys = [c.key for c in get_method(str(run.get("method"))).trainer.per_class_metadata if c.kind == "count"]
    except ValueError:
        return {}
    annotated = {s: set(v.get("annotated") or []) for s, v in ((run.get("data") or {}).get("sites") or {}).items()}
    out: dict[str, list[float]] = {}
    for rnd in run.get("curves") or run.get("rounds") or []:
        for key in keys:
            total = None
            for site, stats in (rnd.get("site_stats") or {}).items():
                v = (stats or {}).get(key)
                if site not in annotated or not isinstance(v, list) or not v or isinstance(v[0], list):
                    continue
                total = total or [0.0] * len(v)
                for c, x in enumerate(v):
                    total[c] += 0.0 if c in annotated[site] else float(x)
            if total is not None:
                out[key] = total
    return out


def inferred_table(runs: dict[str, list[dict]]) -> str:
    """Each configuration's :func:`inferred_counts` per seed, one column per class."""
    lines, classes = [], None
    for name, rs in runs.items():
        for k, r in enumerate(rs):
            for key, total in inferred_counts(r).items():
                if classes is None:
                    final = next(iter((r.get("final") or {}).values()), {})
                    names = list(((final.get("test") or {}).get("per_class") or {}))
                    classes = names if len(names) == len(total) else [str(c) for c in range(len(total))]
                cells = " | ".join(f"{x:.4g}" for x in total)
                lines.append(f"| {name} | {key} | {r.get('seed', k)} | {cells} |")
    if not lines:
        return ""
    return "\n".join(
        [
            "Per-class counts the sites inferred for the classes they do not annotate (the method's per-class count "
            "statistics at those classes, summed over the sites, last round):",
            "",
            "| configuration | counter | seed | " + " | ".join(classes) + " |",
            "|---|---|---|" + "---|" * len(classes),
            *lines,
        ]
    )


def report(a: argparse.Namespace, runs: dict[str, list[dict]]) -> str:
    text = markdown(summarise(runs, a.tail)) + "\n\n" + tables(runs) + "\n\n" + intervals(runs)
    for extra in (counters_table(runs), inferred_table(runs)):
        if extra:
            text += "\n\n" + extra
    for x, y in a.compare or []:
        missing = [n for n in (x, y) if n not in runs]
        text += "\n\n" + (
            f"(compare: waiting for {', '.join(missing)})" if missing and not a.report else compare(runs, x, y)
        )
    if a.gap:
        missing = [name for name in a.gap if name not in runs]
        text += "\n\n" + (
            f"(gap: waiting for {', '.join(missing)})"
            if missing and not a.report
            else gap_closed(runs, *a.gap, metric=a.gap_metric)
        )
    if a.classes:
        gap = a.gap if a.gap and all(g in runs for g in a.gap) else None
        text += "\n\n" + class_subset(runs, a.classes, gap=gap)
    return text


def runs_path(out: Path) -> Path:
    """``X.runs.json.gz`` beside ``X.json``: every run's whole ``results.json`` (per-round histories, per-site
    results), gzip-compressed and tracked, so a table's runs travel with the repository; ``X.json`` keeps the summary."""
    return out.with_name(out.stem + ".runs.json.gz")


def legacy_runs_path(out: Path) -> Path:
    """``X.runs.json``: where older runs were written, uncompressed and git-ignored (still read)."""
    return out.with_name(out.stem + ".runs.json")


def write_runs(out: Path, record: dict) -> None:
    """``X.runs.json.gz`` written whole or not at all (a temporary file renamed over it), with no time stamp in
    the gzip header, so the same runs give the same bytes."""
    path = runs_path(out)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
        f.write(json.dumps(record, separators=(",", ":"), default=str).encode())
    os.replace(tmp, path)


def read_runs_file(out: Path) -> dict | None:
    """The record in ``X.runs.json.gz`` (or an older ``X.runs.json``), None where neither exists."""
    if runs_path(out).is_file():
        return json.loads(gzip.decompress(runs_path(out).read_bytes()))
    if legacy_runs_path(out).is_file():
        return json.loads(legacy_runs_path(out).read_text())
    return None


def command_line(args: dict) -> str:
    """The ``run_jobs.py`` command that produces a benchmark file (from its recorded arguments; ``--resume`` and
    ``--only``, which split one benchmark into several invocations, left out)."""
    parts = ["python benchmarks/run_jobs.py"]
    if args.get("jobs"):
        parts.append("--jobs " + " ".join(args["jobs"]))
    for name, job, method_args in args.get("variant") or []:
        parts.append(
            f"--variant '{name}={job}:{json.dumps(method_args)}'" if method_args else f"--variant '{name}={job}:{{}}'"
        )
    parts.append("--seeds " + " ".join(str(x) for x in args.get("seeds") or [0]))
    parts += [f"--rounds {args.get('rounds')}", f"--sites {args.get('sites')}"]
    if args.get("override") not in (None, "{}"):
        parts.append(f"--override '{args['override']}'")
    parts += [f"--unset {u}" for u in args.get("unset") or []]
    for flag in ("compact", "no_plots"):
        if args.get(flag):
            parts.append("--" + flag.replace("_", "-"))
    if args.get("tail"):
        parts.append(f"--tail {args['tail']}")
    if args.get("gap"):
        parts.append("--gap " + " ".join(args["gap"]) + f" --gap-metric {args.get('gap_metric', 'f1')}")
    for x, y in args.get("compare") or []:
        parts.append(f"--compare {x} {y}")
    if args.get("classes"):
        parts.append("--classes " + " ".join(args["classes"]))
    if args.get("plot_metric", "auc") != "auc":
        parts.append(f"--plot-metric {args['plot_metric']}")
    parts.append(f"--out {args.get('out')}")
    return " ".join(parts)


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


def final_per_seed(runs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per configuration and seed: the setting and the macro test metrics of the last-round and the
    best-on-validation global models (what the tracked summary keeps)."""
    out = {}
    for name, rs in runs.items():
        out[name] = []
        for k, r in enumerate(rs):
            fin = r.get("final") or {}
            out[name].append(
                {
                    "seed": r.get("seed", k),
                    "setting": r.get("setting"),
                    "seconds_per_round": r.get("seconds_per_round"),
                    **{
                        tag: ((fin.get(model) or {}).get("test") or {}).get("macro")
                        for tag, model in (("last", LAST_MODEL), ("best", BEST_MODEL))
                    },
                }
            )
    return out


def summary_record(
    args: dict, runs: dict[str, list[dict]], out: Path, tail: int = 0, commit: str | None = None
) -> dict:
    """``X.json``: the command, the commit (the checkout's, or ``commit``: a re-rendered table keeps the one its
    runs were made at), the arguments, the summary rows and the final metrics per seed (a few KB; the runs
    themselves are in ``X.runs.json.gz``)."""
    return {
        "command": command_line({**args, "out": args.get("out") or str(out)}),
        "commit": commit or _commit(),
        "args": args,
        "summary": summarise(runs, tail),
        "final": final_per_seed(runs),
        "runs_file": runs_path(out).name,
    }


def load_runs(path: Path) -> tuple[dict, dict[str, list[dict]]]:
    """``(args, runs)`` of a benchmark: from ``X.runs.json.gz`` (or an older ``X.runs.json``, or an ``X.json`` that
    holds its runs); a summary alone says which command writes them."""
    data = read_runs_file(path)
    if data is None and path.is_file():
        data = json.loads(path.read_text())
    if data is not None and "runs" in data:
        return data.get("args") or {}, data["runs"]
    if path.is_file():
        cmd = json.loads(path.read_text()).get("command")
        raise SystemExit(f"{path} holds the summary only; its runs ({runs_path(path).name}) are written by: {cmd}")
    raise SystemExit(f"{path}: no such benchmark file")


SIGNIFICANT = 6  # digits a saved run keeps of each float: far below what a table shows, half the file's size
COUNTER_SIGNIFICANT = 4  # a method's per-site counters in a compact run, the precision the reports print them at


def rounded(obj, digits: int = SIGNIFICANT):
    """``obj`` with every float rounded to ``digits`` significant digits (dicts and lists walked)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return obj


def save(a: argparse.Namespace, runs: dict[str, list[dict]], args: dict | None = None) -> None:
    """``X.runs.json.gz``, ``X.json`` and ``X.md`` from the runs, their floats rounded to :data:`SIGNIFICANT`
    digits first, so the tables written now and those ``--report`` renders from the saved runs are the same."""
    a.out.parent.mkdir(parents=True, exist_ok=True)
    args = args or vars(a) | {"out": str(a.out)}
    runs = rounded(runs)
    write_runs(a.out, {"args": args, "runs": runs})
    legacy_runs_path(a.out).unlink(missing_ok=True)  # its runs are in the compressed file now
    commit = None
    if getattr(a, "report", None) and a.out.is_file():  # re-rendered: the commit the runs were made at
        commit = json.loads(a.out.read_text()).get("commit")
    record = rounded(summary_record(args, runs, a.out, a.tail, commit))  # means and spreads of rounded runs
    a.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    a.out.with_suffix(".md").write_text(report(a, runs) + "\n")


def plot_paths(out: Path) -> tuple[Path, Path]:
    """``X_curves.png`` and ``X_final.png`` beside ``X.json`` / ``X.md``."""
    return out.with_name(out.stem + "_curves.png"), out.with_name(out.stem + "_final.png")


def write_plots(out: Path, runs: dict[str, list[dict]], metric: str = "auc") -> list[str]:
    """The benchmark's figures (``fedpartial.tables.curves_figure`` of the validation ``metric``,
    ``final_bar_figure`` of the test ``metric``) beside its tables; a plotting failure only warns."""
    curves, final = plot_paths(out)
    try:
        return [
            save_figure(curves_figure(runs, metric, "val"), curves),
            save_figure(
                final_bar_figure(runs, metric, ((LAST_MODEL, "last round"), (BEST_MODEL, "best on val"))), final
            ),
        ]
    except (ImportError, OSError, ValueError, KeyError, TypeError) as e:
        print(f"(plots not written: {type(e).__name__}: {e})", file=sys.stderr)
        return []


def previous_runs(a: argparse.Namespace) -> dict[str, list[dict]]:
    """The runs of an earlier invocation of the same benchmark (``--resume``); each run carries its seed (older
    files: the seeds in the order they ran)."""
    if not a.out or not (a.out.is_file() or runs_path(a.out).is_file() or legacy_runs_path(a.out).is_file()):
        return {}
    old, runs = load_runs(a.out)
    for key in ("rounds", "sites", "override", "unset"):
        was, now = old.get(key), getattr(a, key)
        if key == "unset":  # older files: none
            was, now = was or [], now or []
        if json.dumps(was, sort_keys=True) != json.dumps(now, sort_keys=True):
            raise SystemExit(f"--resume: {a.out} was run with {key}={old.get(key)!r}, not {getattr(a, key)!r}")
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
    ap.add_argument(
        "--unset",
        action="append",
        default=[],
        metavar="PATH",
        help="remove this dotted key (e.g. dataset.prepare.k) from every job's args after the merge "
        "(null where the dataset preset defines it; repeatable)",
    )
    ap.add_argument("--plot-metric", default="auc", help="macro metric of the X_curves.png / X_final.png plots")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG plots beside the tables")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch workspaces")
    ap.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often a running simulation's server log is read for its round (default 30)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these configurations (job or variant names) of the benchmark's list",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out (same rounds, sites and overrides) and run only the missing "
        "(configuration, seed) pairs: a long benchmark can be run in several parts",
    )
    ap.add_argument(
        "--compact",
        action="store_true",
        help="store per run only the final / best results and the per-round validation macro metrics",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="NAME=JOB:JSON",
        help="also run JOB as NAME with these method options (repeatable)",
    )
    ap.add_argument(
        "--tail",
        type=int,
        default=0,
        metavar="K",
        help="also report each metric averaged over the last K test evaluations of every run (the final "
        "one included), less sensitive than the last round alone to round-to-round swings",
    )
    ap.add_argument(
        "--gap",
        nargs=2,
        metavar=("LOWER", "UPPER"),
        default=None,
        help="report the share of the LOWER -> UPPER gap each other configuration closes",
    )
    ap.add_argument(
        "--compare",
        nargs=2,
        action="append",
        metavar=("A", "B"),
        default=None,
        help="paired t-test of A against B over per-class test AUROCs (repeatable)",
    )
    ap.add_argument("--gap-metric", default="f1", help="macro metric of --gap (f1, bacc, auc, map, ...)")
    ap.add_argument(
        "--classes",
        nargs="+",
        metavar="CLASS",
        help="also tabulate the mean of the per-class test AUC / AP over these classes (multi-label; e.g. "
        "the classes whose annotating sites hold enough positives), with the --gap share on them",
    )
    ap.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="X.json",
        help="re-render the tables of a finished benchmark (rewrites X.md) and run nothing",
    )
    a = ap.parse_args(argv)
    if a.report:
        args, runs = load_runs(a.report)
        a.out = a.report
        for key in ("gap", "compare", "classes"):  # the table's own, unless this command gives others
            if getattr(a, key) is None and args.get(key):
                setattr(a, key, args[key])
        if "--gap-metric" not in (sys.argv[1:] if argv is None else argv) and args.get("gap_metric"):
            a.gap_metric = args["gap_metric"]
        save(a, runs, args=args)
        if not a.no_plots:
            write_plots(a.out, runs, a.plot_metric)
        print(report(a, runs))
        return 0
    if not a.jobs and not a.variant:
        ap.error("give --jobs and/or --variant (or --report X.json)")
    global PROGRESS_EVERY
    PROGRESS_EVERY = a.progress_every
    runs = previous_runs(a) if a.resume else {}
    env = {**os.environ, "FEDPARTIAL_DATA_DIR": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    configs = [(job, job, None) for job in a.jobs] + list(a.variant)
    if a.only:
        unknown = sorted(set(a.only) - {name for name, _, _ in configs})
        if unknown:
            ap.error(f"--only: {unknown} not among the configurations {[name for name, _, _ in configs]}")
        configs = [c for c in configs if c[0] in a.only]
    base = merge_unset(json.loads(a.override), a.unset)
    for job in dict.fromkeys(job for _, job, _ in configs):
        check_unset(job, a.unset)
    scratch = Path(tempfile.mkdtemp(prefix="fedpartial-bench-"))
    failed = None
    try:
        run_all(a, configs, runs, scratch, base, env)
    except RunFailed as e:
        failed = e
    except Stopped as e:  # Ctrl-C / SIGTERM: the running simulator and its sites are stopped already
        shutil.rmtree(scratch, ignore_errors=True)
        done = sum(len(v) for v in runs.values())
        print(
            f"\nstopped ({signal_name(e.signum)}): the run in progress and its {e.stopped} processes are gone; "
            f"{done} finished run(s) kept in {a.out or 'no --out file (give --out to keep them)'}"
            + ("; go on with the same command and --resume" if a.out else ""),
            file=sys.stderr,
            flush=True,
        )
        return 128 + e.signum
    finally:
        if not a.keep and failed is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if a.out and runs and not a.no_plots:  # once, at the end (--report X.json redraws them)
        write_plots(a.out, runs, a.plot_metric)
    if failed is not None:
        print(
            f"\n{failed}\n(scratch folder kept: {scratch}; the finished runs are in {a.out or 'no --out file'})",
            file=sys.stderr,
            flush=True,
        )
        if runs:
            print("\n" + report(a, runs))
        return 1
    print("\n" + report(a, runs))
    return 0


def run_all(
    a: argparse.Namespace, configs: list, runs: dict[str, list[dict]], scratch: Path, base: dict, env: dict
) -> None:
    """Every (configuration, seed) pair not yet in ``runs``, seed by seed; ``runs`` and ``--out`` grow as they
    finish. Prints run k of N, the elapsed time and the time left before each run and after it."""
    todo = [
        (seed, c)
        for seed in a.seeds
        for c in configs  # seed-major: an interrupted benchmark keeps whole seeds
        if not any(r.get("seed") == seed for r in runs.get(c[0], []))
    ]
    for seed in a.seeds:
        for name, _, _ in configs:
            if any(r.get("seed") == seed for r in runs.get(name, [])):
                print(f"{name} seed {seed}: already in {a.out}", flush=True)
    progress = Progress(len(todo))
    for seed, (name, job, method_args) in todo:
        print(progress.starting(f"{name} seed {seed}"), flush=True)
        res = run_one(job, seed, a.rounds, a.sites, scratch, base, env, name, method_args)
        runs.setdefault(name, []).append(compact(res) if a.compact else res)
        fin = res["final"][LAST_MODEL]["test"]["macro"]
        print(
            f"{name} seed {seed}: test {json.dumps({k: round(v, 4) for k, v in fin.items() if v is not None})} "
            f"({res['seconds_per_round']:.1f} s/round, {res['wall_seconds_total']:.0f} s); {progress.finished()}",
            flush=True,
        )
        if a.out:  # rewritten after every run
            save(a, runs)


if __name__ == "__main__":
    raise SystemExit(main())
