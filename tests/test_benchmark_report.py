"""benchmarks/run_jobs.py's report: the gap-closed share and ``--report`` re-rendering of a finished benchmark."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import uuid

import pytest

from conftest import REPO


def _run_jobs():
    spec = importlib.util.spec_from_file_location("run_jobs", REPO / "benchmarks" / "run_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(f1_last: float, f1_best: float, setting: str) -> dict:
    def test(f1):
        return {
            "task": "multiclass",
            "macro": {"auc": 0.8, "accuracy": 0.7, "f1": f1, "precision": 0.5, "recall": 0.5},
            "per_class": {"a": {"auc": 0.8, "f1": f1}, "b": {"auc": 0.8, "f1": f1}},
        }

    return {
        "setting": setting,
        "seconds_per_round": 2.0,
        "final": {"FL_global_model.pt": {"test": test(f1_last)}, "best_FL_global_model.pt": {"test": test(f1_best)}},
    }


RUNS = {  # seed means: lower 0.20 / 0.10, upper 0.40 / 0.30, method 0.25 / 0.25
    "lower": [_run(0.10, 0.10, "2 sites x 1..1 classes"), _run(0.30, 0.10, "2 sites x 1..1 classes")],
    "upper": [_run(0.40, 0.30, "full labels"), _run(0.40, 0.30, "full labels")],
    "method": [_run(0.20, 0.20, "2 sites x 1..1 classes"), _run(0.30, 0.30, "2 sites x 1..1 classes")],
}


def test_gap_closed_shares_by_hand():
    text = _run_jobs().gap_closed(RUNS, "lower", "upper", metric="f1")
    row = next(line for line in text.splitlines() if line.startswith("| method |"))
    # last round: (0.25 - 0.20) / (0.40 - 0.20) = 25 %; best on validation: (0.25 - 0.10) / (0.30 - 0.10) = 75 %
    assert row == "| method | 2 | 25.00 | 25 % | 25.00 | 75 % |"
    assert "| lower | 2 | 20.00 | bound | 10.00 | bound |" in text


def test_class_subset_means_and_gap_by_hand():
    """--classes: the mean of per-class metrics over a subset of classes, seeds averaged, and the gap share on it."""

    def run(a, b, c):
        per = {"x": {"auc": a, "ap": 0.1}, "y": {"auc": b, "ap": 0.3}, "z": {"auc": c, "ap": 0.9}}
        return {"final": {m: {"test": {"per_class": per}} for m in ("FL_global_model.pt", "best_FL_global_model.pt")}}

    runs = {
        "lo": [run(0.5, 0.7, 0.0)],
        "hi": [run(0.9, 0.9, 0.0)],
        "m": [run(0.6, 0.8, 1.0), run(0.8, 0.8, 0.0)],
    }  # x, y means: 0.6 / 0.9 / (0.7 + 0.8) / 2 = 0.75
    text = _run_jobs().class_subset(runs, ["x", "y"], gap=["lo", "hi"])
    row = next(line for line in text.splitlines() if line.startswith("| m |"))
    # AUC: seed 0 (0.6 + 0.8) / 2 = 0.70, seed 1 0.80 -> 75.00 ± 5.00; AP (0.1 + 0.3) / 2 = 20; gap (0.75 - 0.6) / 0.3
    assert row == "| m | 2 | 75.00 ± 5.00 | 20.00 ± 0.00 | 75.00 ± 5.00 | 20.00 ± 0.00 | 50 % |"
    assert "| lo | 1 | 60.00 ± 0.00 |" in text and text.count("bound") == 2
    with pytest.raises(SystemExit, match="not among the classes"):
        _run_jobs().class_subset(runs, ["x", "w"])


def test_gap_names_a_missing_bound():
    with pytest.raises(SystemExit, match="no configuration 'nope'"):
        _run_jobs().gap_closed(RUNS, "nope", "upper")


def test_report_rerenders_a_finished_benchmark(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"args": {"rounds": 3}, "runs": RUNS}))
    assert _run_jobs().main(["--report", str(path), "--gap", "lower", "upper"]) == 0
    md = (tmp_path / "bench.md").read_text()
    assert "| method | 2 | 25.00 | 25 % | 25.00 | 75 % |" in md
    assert "upper (all labels: upper bound)" in md  # the paper-layout table marks the fully labelled run
    saved = json.loads(path.read_text())  # the summary; the runs beside it, compressed
    assert saved["args"] == {"rounds": 3} and "runs" not in saved and set(saved["final"]) == set(RUNS)
    assert saved["runs_file"] == "bench.runs.json.gz" and saved["command"].startswith("python benchmarks/run_jobs.py")
    first = (tmp_path / "bench.runs.json.gz").read_bytes()
    assert set(json.loads(gzip.decompress(first))["runs"]) == set(RUNS)
    assert _run_jobs().main(["--report", str(path)]) == 0  # again, from the runs file
    assert "25 %" in capsys.readouterr().out
    assert (tmp_path / "bench.runs.json.gz").read_bytes() == first  # no time stamp: same runs, same bytes


def test_an_older_uncompressed_runs_file_is_read_and_replaced(tmp_path):
    """A table begun before the runs were compressed goes on: ``X.runs.json`` is read, and the next save writes
    ``X.runs.json.gz`` in its place; the re-rendered table keeps its gap and the commit its runs were made at."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"command": "python benchmarks/run_jobs.py", "commit": "a1b2c3", "final": {}}))
    args = {"rounds": 3, "gap": ["lower", "upper"], "gap_metric": "f1"}
    (tmp_path / "bench.runs.json").write_text(json.dumps({"args": args, "runs": RUNS}))
    assert _run_jobs().main(["--report", str(path), "--no-plots"]) == 0
    assert not (tmp_path / "bench.runs.json").exists()
    assert json.loads(path.read_text())["commit"] == "a1b2c3"
    assert "| method | 2 | 25.00 | 25 % | 25.00 | 75 % |" in (tmp_path / "bench.md").read_text()
    assert set(json.loads(gzip.decompress((tmp_path / "bench.runs.json.gz").read_bytes()))["runs"]) == set(RUNS)


def test_resume_runs_only_the_missing_pairs(tmp_path, monkeypatch):
    mod = _run_jobs()
    out = tmp_path / "bench.json"
    calls = []

    def fake_run_one(job, seed, rounds, sites, scratch, base, env, name=None, method_args=None):
        calls.append((name, seed))
        res = _run(0.1 * (seed + 1), 0.1, "full labels")
        return {
            **res,
            "final": {k: {**v, "test": {**v["test"], "task": "multiclass"}} for k, v in res["final"].items()},
            "wall_seconds_total": 1.0,
            "seed": seed,
        }

    monkeypatch.setattr(mod, "run_one", fake_run_one)
    args = ["--jobs", "a", "b", "--rounds", "3", "--out", str(out)]
    assert mod.main(args + ["--seeds", "0"]) == 0
    assert calls == [("a", 0), ("b", 0)]
    calls.clear()
    assert mod.main(args + ["--seeds", "0", "1", "--resume"]) == 0
    assert calls == [("a", 1), ("b", 1)]  # seed 0 kept from the first run
    runs = mod.load_runs(out)[1]
    assert [r["seed"] for r in runs["a"]] == [0, 1]
    assert [r["seed"] for r in json.loads(out.read_text())["final"]["a"]] == [0, 1]  # the tracked summary
    # a gap whose bounds have not run yet waits instead of stopping the benchmark
    assert (
        mod.main(
            ["--jobs", "a", "--rounds", "3", "--seeds", "0", "2", "--out", str(out), "--resume", "--gap", "a", "zzz"]
        )
        == 0
    )
    assert calls == [("a", 1), ("b", 1), ("a", 2)]
    assert "(gap: waiting for zzz)" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="rounds=3"):  # another budget is another benchmark
        mod.main(["--jobs", "a", "--rounds", "5", "--out", str(out), "--resume"])
    calls.clear()  # --only runs a subset of the list; the others stay in the file and the report
    assert mod.main(args + ["--seeds", "3", "--resume", "--only", "b"]) == 0
    assert calls == [("b", 3)]
    runs = mod.load_runs(out)[1]
    assert [r["seed"] for r in runs["a"]] == [0, 1, 2] and [r["seed"] for r in runs["b"]] == [0, 1, 3]
    with pytest.raises(SystemExit):
        mod.main(args + ["--only", "c"])


def test_tail_mean_over_the_last_k_test_evaluations():
    mod = _run_jobs()
    run = _run(0.6, 0.1, "full labels")  # final evaluation of the last-round model: f1 0.6
    run["curves"] = [{"round": r, "test": {"f1": v, "bacc": 0.5}} for r, v in ((0, 0.1), (5, 0.2), (10, 0.3))]
    run["curves"].insert(1, {"round": 1, "test": None})  # rounds without a test evaluation are skipped
    # k = 3: the two latest curve points and the final evaluation: (0.2 + 0.3 + 0.6) / 3
    assert mod.tail_metrics(run, 3)["f1"] == pytest.approx(1.1 / 3)
    assert mod.tail_metrics(run, 1)["f1"] == pytest.approx(0.6)  # the final evaluation alone
    assert "auc" not in mod.tail_metrics(run, 3)  # not measured at every point: not averaged
    rows = mod.summarise({"m": [run, run]}, tail=3)
    assert rows[0]["tail3_f1"] == pytest.approx((1.1 / 3, 0.0))
    assert "tail3_f1" not in mod.summarise({"m": [run]})[0]  # off by default


def test_compact_keeps_curves_and_method_counters():
    res = {
        "final": {"x": 1},
        "rounds": [
            {
                "round": 0,
                "val": {"macro": {"f1": 0.1}, "per_class": {}},
                "test": None,
                "sites": ["site-1"],
                "site_stats": {
                    "site-1": {"fedlsm_pseudo": 3, "fedirm_relation": [[0.1642913, 12345.678], [1e-7, 0.0]]}
                },
            },
            {"round": 1, "val": None, "test": {"macro": {"f1": 0.2}}, "missing": ["site-2"]},
        ],
    }
    out = _run_jobs().compact(res)
    assert "rounds" not in out and out["final"] == {"x": 1}
    assert out["curves"] == [
        {
            "round": 0,
            "val": {"f1": 0.1},
            "test": None,  # the counters to 4 significant digits (integers as they are)
            "site_stats": {"site-1": {"fedlsm_pseudo": 3, "fedirm_relation": [[0.1643, 12350.0], [1e-7, 0.0]]}},
            "rejected": {},
            "missing": [],
        },
        {"round": 1, "val": None, "test": {"f1": 0.2}, "site_stats": {}, "rejected": {}, "missing": ["site-2"]},
    ]


def test_levels_of_one_method_share_a_row_and_the_upper_bound_comes_last():
    rj = _run_jobs()
    runs = {
        "upper": [_run(0.40, 0.30, "full labels")],
        "m@2": [_run(0.20, 0.20, "missing 2 classes")],
        "m@4": [_run(0.10, 0.10, "missing 4 classes")],
        "n@2": [_run(0.30, 0.30, "missing 2 classes")],
        "n@4": [_run(0.05, 0.05, "missing 4 classes")],
        "o@2": [_run(0.25, 0.25, "missing 2 classes")],
        "o@4": [_run(0.15, 0.15, "missing 4 classes")],
    }
    table = rj.tables(runs).split("\n\n")[1]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [r[0][2:] for r in rows] == ["m", "n", "o", "upper (all labels: upper bound)"]
    head = table.splitlines()[0]
    assert "missing 2 classes: F1" in head and "missing 4 classes: F1" in head and "Average: F1" in head
    f1_2 = head.split(" | ").index("missing 2 classes: F1")
    assert [r[f1_2] for r in rows] == ["20.00", "**30.00**", "_25.00_", "40.00"]  # the bound is not ranked
    assert rj.deep_merge({"prepare": {"k": 4, "seed": 1}}, {"prepare": {"k": 2}}) == {"prepare": {"k": 2, "seed": 1}}


def test_every_mutation_of_the_mutation_run_still_applies_to_the_code():
    """benchmarks/mutation.py patches the source by exact text: a reformatted or rewritten line makes its mutation
    an error at run time. Every patch matches the current code exactly once, and every test it names exists."""
    spec = importlib.util.spec_from_file_location("mutation", REPO / "benchmarks" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation"] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["mutation"]
    assert len(mod.MUTATIONS) >= 100
    stale = []
    for m in mod.MUTATIONS:
        for path, patches in [(m.path, m.patches), *m.extra]:
            text = (REPO / path).read_text()
            stale += [(m.name, path, text.count(old)) for old, _ in patches if text.count(old) != 1]
        for t in m.test_args:
            test_file, _, name = t.partition("::")
            assert (REPO / test_file).is_file(), (m.name, t)
            assert not name or f"def {name.split('[')[0]}(" in (REPO / test_file).read_text(), (m.name, t)
    assert stale == [], stale


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_check_tells_a_stale_table_from_another_cpu():
    """benchmarks/readme_demo.py: the README's table against the commands' output on another CPU (0.92 point at most,
    measured) agrees; a stale table (2.6 BACC off, what the image store's decoding change made) or another header
    does not."""
    demo = _bench("readme_demo")
    head = ["| Method | BACC | AUC | mAP |", "|---|---|---|---|"]
    readme = [
        *head,
        "| fedmlp (last round) | 64.94 | 80.74 | 40.94 |",
        "| fedmlp (best on validation) | 62.35 | 81.17 | 41.74 |",
    ]
    other_cpu = [
        *head,
        "| fedmlp (last round) | 64.22 | 80.71 | 41.86 |",
        "| fedmlp (best on validation) | 63.17 | 81.05 | 41.33 |",
    ]
    stale = [
        *head,
        "| fedmlp (last round) | 67.56 | 81.48 | 41.76 |",
        "| fedmlp (best on validation) | 62.35 | 81.17 | 41.74 |",
    ]
    tol = demo.DEFAULT_TOL
    assert demo.max_difference(other_cpu, readme) == pytest.approx(0.92)
    assert demo.agree(other_cpu, readme, tol, demo.DEFAULT_TOL_BEST)
    assert not demo.agree(stale, readme, tol, demo.DEFAULT_TOL_BEST)
    assert not demo.agree(["| Method | BACC | AUC |", *other_cpu[1:]], readme, tol, demo.DEFAULT_TOL_BEST)


def test_suite_cpu_names_the_kinds_and_counts_a_child_it_did_not_start_directly():
    """benchmarks/suite_cpu.py: NVFlare's process command lines go to their kinds, and a grandchild that burns 1.5
    CPU-s under a simulator worker's name is counted there (sampled, not reaped)."""
    suite = _bench("suite_cpu")
    assert suite.kind_of("python3 -m nvflare.private.fed.app.client.worker_process -m /k/hospital-1 -w x") == (
        "deployed hospital job process"
    )
    assert suite.kind_of("python3 -u -m nvflare.private.fed.app.server.server_train -m /k/localhost") == (
        "deployed server / hospital parent"
    )
    assert suite.kind_of("python -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest worker"
    runner = "python -c \nfrom fedpartial.fl.simulator import SupervisedSimEnv\n fedavg_ich /tmp/pytest-of-root/x {}"
    fork_server = (
        "python -m fedpartial.processes fedpartial-fork-1 1 torch nvflare.private.fed.app.simulator.simulator_worker"
    )
    assert suite.kind_of(fork_server) == "fork server of a test worker"
    assert suite.kind_of(runner) == "recipe in SimEnv"  # named by what it runs, not by its folders
    assert suite.kind_of("python -m fedpartial.fl.simulator /tmp/pytest-of-root/j -w ws -n 2") == (
        "simulator launcher, fork server and server process"
    )
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
    # the parent's own command line names no kind: only the child is a "simulated site worker"; the token tells it
    # from the other processes of the machine (the suite's own site workers run beside this test)
    token = f"burn-{uuid.uuid4().hex}"
    worker = f"'-m', 'nvflare.private.fed.app.simulator.' + 'simulator_worker', {token!r}"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}, {worker}])"
    procs: list = []
    summary = suite.measure([sys.executable, "-c", child], interval=0.2, processes=procs)
    assert summary["returncode"] == 0
    burner = [p for p in procs if p["cmd"].endswith(token)]
    assert [p["kind"] for p in burner] == ["simulated site worker"], procs
    assert burner[0]["cpu_s"] >= 1.3
    assert summary["kinds"]["simulated site worker"]["cpu_s"] >= burner[0]["cpu_s"] - 0.05  # rounded to 0.1
    assert summary["machine_cpu_s"] >= 1.3


def test_method_counters_are_summed_or_averaged_per_run():
    """The counters beside the scores: integers summed over sites and rounds, fractions averaged over the
    site-rounds that report them, lists and flags left out; a configuration without counters has no row."""
    mod = _run_jobs()
    run = {
        "curves": [
            {"site_stats": {"site-1": {"pseudo": 2, "ramp": 0.5, "pools": [1, 2]}, "site-2": {"pseudo": 3}}},
            {"site_stats": {"site-1": {"pseudo": 4, "ramp": 1.0, "ok": True}}},
        ]
    }
    assert mod.method_counters(run) == {"pseudo": 9, "ramp": 0.75}
    other = {"seed": 2, "rounds": [{"site_stats": {"s": {"pseudo": 1}}}]}
    table = mod.counters_table({"FedX": [{**run, "seed": 0}, other], "FedAvg": [{"seed": 1}]})
    assert "| configuration | counter | seed 0 | seed 1 | seed 2 |" in table
    assert "| FedX | pseudo | 9 | - | 1 |" in table and "| FedX | ramp | 0.75 | - | - |" in table
    assert "FedAvg" not in table


def test_inferred_counts_are_the_per_class_counts_at_the_classes_a_site_does_not_annotate():
    """FedLSM's ``fedlsm_q`` (labelled + pseudo positives per class): at a site's own classes they are its labels,
    at the others its teacher's pseudo labels; the table sums the latter over the sites, from the last round."""
    mod = _run_jobs()
    sites = {"site-1": {"annotated": [0, 1]}, "site-2": {"annotated": [2]}}
    run = {
        "method": "fedlsm",
        "seed": 3,
        "data": {"sites": sites},
        "final": {"FL_global_model.pt": {"test": {"per_class": {"a": {}, "b": {}, "c": {}}}}},
        "curves": [
            {"site_stats": {"site-1": {"fedlsm_q": [5, 6, 9]}, "site-2": {"fedlsm_q": [1, 1, 7]}}},
            {
                "site_stats": {
                    "site-1": {"fedlsm_q": [5, 6, 2], "fedlsm_pools": [1, 2, 3]},
                    "site-2": {"fedlsm_q": [4, 0, 7]},
                }
            },
            {"site_stats": {}},  # a round no site reported: the last one that did counts
        ],
    }
    assert mod.inferred_counts(run) == {"fedlsm_q": [4.0, 0.0, 2.0]}
    table = mod.inferred_table({"FedLSM": [run], "FedAvg": [{"method": "fedavg", "data": {"sites": sites}}]})
    assert "| configuration | counter | seed | a | b | c |" in table
    assert "| FedLSM | fedlsm_q | 3 | 4 | 0 | 2 |" in table and "FedAvg" not in table
    assert mod.inferred_table({"FedAvg": [{"method": "fedavg"}]}) == ""


def test_saved_runs_keep_six_significant_digits(tmp_path):
    """The runs file keeps each float to 6 significant digits (half the size; a table shows 4), and the table
    written with the runs is the one --report renders from the file."""
    mod = _run_jobs()
    path = tmp_path / "bench.json"
    runs = json.loads(json.dumps(RUNS))
    runs["method"][0]["seconds_per_round"] = 1.23456789
    path.write_text(json.dumps({"args": {"rounds": 3, "gap": ["lower", "upper"]}, "runs": runs}))
    assert mod.main(["--report", str(path), "--no-plots"]) == 0
    saved = json.loads(gzip.decompress((tmp_path / "bench.runs.json.gz").read_bytes()))["runs"]
    assert saved["method"][0]["seconds_per_round"] == 1.23457
    assert mod.rounded({"a": [0.000123456789, 2, "x"]}) == {"a": [0.000123457, 2, "x"]}
    md = (tmp_path / "bench.md").read_text()
    assert mod.main(["--report", str(path), "--no-plots"]) == 0
    assert (tmp_path / "bench.md").read_text() == md
    # the summary beside them too: its means and spreads of rounded runs, to the same 6 digits
    record = json.loads(path.read_text())
    kept = {k: record[k] for k in ("summary", "final")}
    assert mod.rounded(kept) == kept and mod.rounded(kept, 5) != kept
