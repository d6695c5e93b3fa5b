"""benchmarks/run_jobs.py without the simulator: the first errors of a failed run's workspace logs (fake
workspace folders), the failure report and exit status, and key removal in overrides (``--unset``)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from fedpartial.data.presets import deep_merge, resolve_dataset


def _run_jobs():
    spec = importlib.util.spec_from_file_location("run_jobs", REPO / "benchmarks" / "run_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _run_jobs()
T = "2026-11-23 09:45:{:02d},{:03d}"
NOISE = (
    " - CoreCell - ERROR - [ME=site-1.:ate_job O=site-1.:ate_job SEQ={}] cannot send to 'server.simulate_job': "
    "target_unreachable"
)
CAUSE = "ValueError: protocol 'full' takes parameter(s) []; missing [], unexpected ['k']"


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _fake_workspace(ws: Path) -> None:
    """The simulator's layout: the server's log (its own error after the site's), site-1 with shutdown noise
    only, site-2 with the cause (an ERROR record followed by its traceback) and then noise."""
    _write(
        ws / "server" / "log.txt",
        [
            T.format(1, 0) + " - SimulatorRunner - INFO - Create the Simulator Server.",
            T.format(8, 0) + " - SimulatorRunner - INFO - site-2 ended",
            "Traceback (most recent call last):",  # a plain Python traceback (no record prefix): at 09:45:08
            '  File "/x/nvflare/private/fed/app/simulator/simulator_runner.py", line 90, in run',
            "RuntimeError: simulator_server: site-2 ended abnormally",
            T.format(9, 0) + " - ServerRunner - ERROR - [identity=simulator_server] - Aborting current RUN due to "
            "FATAL_SYSTEM_ERROR received: site-2 failed",
        ],
    )
    _write(
        ws / "site-1" / "log.txt",
        [T.format(2, 0) + " - ClientRunner - INFO - started"] + [T.format(10, i) + NOISE.format(i) for i in range(5)],
    )
    _write(
        ws / "site-2" / "log.txt",
        [
            T.format(3, 0) + " - PartialLabelExecutor - INFO - site-2: reading the dataset",
            T.format(4, 5) + " - ClientRunner - ERROR - [identity=site-2, run=simulate_job] - Processing error in task "
            f"execution: {CAUSE}",
            T.format(4, 5) + " - ClientRunner - ERROR - [identity=site-2, run=simulate_job] - Traceback (most recent "
            "call last):",  # NVFlare's log_exception: the traceback as a second ERROR record
            '  File "/x/nvflare/private/fed/client/client_runner.py", line 312, in _do_process_task',
            "    reply = executor.execute(task.name, task.data, fl_ctx, self.task_abort_signal)",
            '  File "/x/fedpartial/data/protocols.py", line 198, in assign',
            '    raise ValueError(f"protocol {protocol!r} takes parameter(s) ...")',
            CAUSE,
            T.format(4, 6) + " - ClientRunner - ERROR - [identity=site-2, run=simulate_job] - Processing error in task "
            f"execution: {CAUSE}",  # the same message again: listed once
        ]
        + [T.format(11, i) + NOISE.format(i) for i in range(3)],
    )


def test_first_errors_of_a_log_skip_noise_and_repeats_and_keep_the_traceback_end(tmp_path):
    _fake_workspace(tmp_path)
    errs = R.first_errors(tmp_path / "site-2" / "log.txt")
    assert [n for n, _ in errs] == [2, 6, 8]  # the record, the traceback's last frame and its exception line
    assert errs[0][1].endswith(CAUSE) and "protocols.py" in errs[1][1] and errs[2][1] == CAUSE
    assert R.first_errors(tmp_path / "site-1" / "log.txt") == []  # shutdown noise only
    many = tmp_path / "many.txt"
    _write(many, [T.format(1, i) + f" - X - ERROR - problem {i}" for i in range(50)])
    assert [t.rsplit(" ", 1)[1] for _, t in R.first_errors(many, limit=4)] == ["0", "1", "2", "3"]  # bounded


def test_workspace_errors_earliest_failing_log_first_and_bounded(tmp_path):
    _fake_workspace(tmp_path)
    text = R.workspace_errors(tmp_path)
    lines = text.splitlines()
    assert lines[0] == "  site-2/log.txt:" and "server/log.txt:" in text and "site-1" not in text
    assert text.index("site-2/log.txt") < text.index("server/log.txt")  # site-2's error is the earlier one
    assert "target_unreachable" not in text and text.count(CAUSE) == 2  # the record and the exception line
    assert len(R.workspace_errors(tmp_path, total=2).splitlines()) == 4  # 1 header + 2 lines + "... (more in" line
    assert "(more in server/log.txt)" in R.workspace_errors(tmp_path, total=2)
    assert R.workspace_errors(tmp_path / "nothing") == ""


def test_run_one_reports_the_site_error_and_the_workspace(tmp_path, monkeypatch):
    def fake_simulator(cmd, env, cwd, ws, label, rounds, every=30.0):  # the simulator fails the way the
        # protocol-override run did: rc 2, no stderr
        ws = Path(cmd[cmd.index("-w") + 1])
        _fake_workspace(ws)
        job = Path(cmd[cmd.index("-w") - 1])  # the job folder precedes -w
        args = json.loads((job / "app/config/config_fed_client.json").read_text())["executors"][0]["executor"]["args"]
        (ws / "args.json").write_text(json.dumps(args))
        return subprocess.CompletedProcess(cmd, 2, stdout="lots of console output", stderr="")

    monkeypatch.setattr(R, "simulate", fake_simulator)
    base = R.merge_unset({"dataset": {"prepare": {"protocol": "full"}}}, [])
    with pytest.raises(R.RunFailed) as e:
        R.run_one("fedavg_cxr14", 0, 2, 3, tmp_path, base, {})
    msg, ws = str(e.value), e.value.workspace
    assert msg.startswith(f"fedavg_cxr14 seed 0 failed (rc 2); workspace {ws}")
    assert ws == tmp_path / "fedavg_cxr14-s0" / "ws"
    assert CAUSE in msg and "site-2/log.txt" in msg and "lots of console output" not in msg
    # the same run with --unset dataset.prepare.k: the key leaves the job's args (null: the preset defines k)
    base = R.merge_unset({"dataset": {"prepare": {"protocol": "full"}}}, ["dataset.prepare.k"])
    with pytest.raises(R.RunFailed) as e:
        R.run_one("fedavg_cxr14", 1, 2, 3, tmp_path, base, {})
    args = json.loads((e.value.workspace / "args.json").read_text())
    assert args["dataset"]["prepare"] == {"num_sites": 8, "k": None, "protocol": "full"}
    # no log error at all: the end of the simulator's output instead
    shutil.rmtree(e.value.workspace)
    e.value.workspace.mkdir()
    msg = R.failure_message("x seed 0", 1, e.value.workspace, stdout="a\nb\nthe end", stderr="")
    assert "no ERROR record in the workspace logs" in msg and msg.endswith("  a\n  b\n  the end")


def test_main_keeps_the_scratch_and_exits_1_when_a_run_fails(tmp_path, monkeypatch, capsys):
    def fake_run_one(job, seed, rounds, sites, scratch, base, env, name=None, method_args=None):
        if job == "b":
            raise R.RunFailed(
                f"{job} seed {seed} failed (rc 2); workspace {scratch / 'b-s0/ws'}\n  site-2/log.txt:",
                scratch / "b-s0/ws",
            )
        return {
            "setting": "full labels",
            "seconds_per_round": 1.0,
            "wall_seconds_total": 1.0,
            "seed": seed,
            "final": {
                m: {"test": {"task": "multiclass", "macro": {"auc": 0.8}, "per_class": {"x": {"auc": 0.8}}}}
                for m in (R.LAST_MODEL, R.BEST_MODEL)
            },
        }

    monkeypatch.setattr(R, "run_one", fake_run_one)
    out = tmp_path / "bench.json"
    assert R.main(["--jobs", "a", "b", "--out", str(out), "--no-plots"]) == 1
    err = capsys.readouterr().err
    scratch = Path(re.search(r"scratch folder kept: (\S+);", err).group(1))
    assert scratch.is_dir() and "b seed 0 failed (rc 2); workspace" in err
    shutil.rmtree(scratch)
    assert list(R.load_runs(out)[1]) == ["a"]  # the finished run is saved


def test_progress_counts_runs_and_estimates_the_time_left():
    now = [100.0]
    p = R.Progress(4, clock=lambda: now[0])
    assert p.starting("a seed 0") == "run 1 / 4: a seed 0 (elapsed 0 s)"  # no estimate before a run ends
    now[0] += 90
    assert p.finished() == "1 / 4 done, elapsed 1 min 30 s, about 4 min 30 s left"  # 3 runs x 90 s
    now[0] += 30  # the second run: 30 s, mean 60 s per run
    assert p.finished() == "2 / 4 done, elapsed 2 min 00 s, about 2 min 00 s left"
    assert p.starting("b seed 0") == "run 3 / 4: b seed 0 (elapsed 2 min 00 s, about 2 min 00 s left)"
    assert R.duration(7325) == "2 h 02 min" and R.duration(59.6) == "1 min 00 s"


def test_main_prints_run_k_of_n_and_leaves_out_the_resumed_runs(tmp_path, monkeypatch, capsys):
    def fake_run_one(job, seed, rounds, sites, scratch, base, env, name=None, method_args=None):
        return {
            "setting": "full labels",
            "seconds_per_round": 1.0,
            "wall_seconds_total": 1.0,
            "seed": seed,
            "final": {
                m: {"test": {"task": "multiclass", "macro": {"auc": 0.8}, "per_class": {"x": {"auc": 0.8}}}}
                for m in (R.LAST_MODEL, R.BEST_MODEL)
            },
        }

    monkeypatch.setattr(R, "run_one", fake_run_one)
    out = tmp_path / "bench.json"
    assert R.main(["--jobs", "a", "--out", str(out), "--no-plots", "--compact"]) == 0
    assert (
        R.main(["--jobs", "a", "b", "--seeds", "0", "1", "--out", str(out), "--no-plots", "--compact", "--resume"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    starts = [line for line in lines if line.startswith("run ")]
    assert starts[0].startswith("run 1 / 1: a seed 0 (elapsed")
    assert [line.split(" (")[0] for line in starts[1:]] == [
        "run 1 / 3: b seed 0",
        "run 2 / 3: a seed 1",
        "run 3 / 3: b seed 1",
    ]  # a seed 0 was already done
    assert "a seed 0: already in" in "\n".join(lines) and "left)" in starts[2]
    assert any(
        line.startswith("b seed 1: test") and line.endswith("3 / 3 done, elapsed 0 s, about 0 s left") for line in lines
    )


def test_simulate_prints_each_new_round_of_the_server_log(tmp_path, capsys):
    """A stand-in simulator writes NVFlare's round lines into the server log; ``simulate`` reports each new
    finished round while it runs and returns its captured output and exit status."""
    ws = tmp_path / "run" / "ws"
    script = (
        f"import pathlib, sys, time; log = pathlib.Path({str(ws / 'server' / 'log.txt')!r}); "
        "log.parent.mkdir(parents=True); print('hello'); sys.stdout.flush(); "
        "[(log.open('a').write(f'x - ScatterAndGather - INFO - Round {r} started.\\nRound {r} finished.\\n'), "
        "time.sleep(1.0)) for r in range(2)]; sys.exit(3)"
    )
    proc = R.simulate([R.sys.executable, "-c", script], dict(R.os.environ), str(tmp_path), ws, "j seed 0", 2, every=0.2)
    assert proc.returncode == 3 and proc.stdout.strip() == "hello"
    shown = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert [line.split(" (")[0] for line in shown] == ["j seed 0: round 1 / 2", "j seed 0: round 2 / 2"]
    assert R.rounds_done(ws / "server" / "log.txt") == 2 and R.rounds_done(tmp_path / "none.txt") == 0


JOB_ARGS = {
    "method": "fedavg",
    "method_args": {"mu": 0.1, "beta": 2},
    "dataset": {"preset": "nih_cxr14", "prepare": {"num_sites": 8, "k": 7}},
    "train": {"lr": 0.001, "batch_size": 32},
}


def test_unset_removes_a_key_after_the_merge_and_keeps_a_preset_value_from_coming_back():
    over = R.merge_unset({"dataset": {"prepare": {"protocol": "full"}}}, ["dataset.prepare.k", "train.lr"])
    assert over == {"dataset": {"prepare": {"protocol": "full", "k": R.UNSET}}, "train": {"lr": R.UNSET}}
    merged = deep_merge(JOB_ARGS, over)  # what customise_job does with --override
    args = R.resolve_unset(merged, R.preset_fallback(merged))
    assert args["train"] == {"batch_size": 32}  # no preset defines train.lr: removed
    assert args["dataset"]["prepare"] == {"num_sites": 8, "k": None, "protocol": "full"}  # nih_cxr14 has k = 6
    assert resolve_dataset(args["dataset"])["prepare"]["k"] is None  # not the preset's 6
    # without the marker the leftover k stays (the failing run of the issue)
    assert (
        resolve_dataset(deep_merge(JOB_ARGS, {"dataset": {"prepare": {"protocol": "full"}}})["dataset"])["prepare"]["k"]
        == 7
    )
    # keys no preset backs are deleted wherever they sit, lists walked too
    assert R.resolve_unset({"a": [{"b": R.UNSET, "c": 1}], "d": R.UNSET}) == {"a": [{"c": 1}]}
    assert R.merge_unset({"x": 1}, []) == {"x": 1}


def test_unset_errors():
    with pytest.raises(SystemExit, match="--override also sets it"):
        R.merge_unset({"dataset": {"prepare": {"k": 3}}}, ["dataset.prepare.k"])
    with pytest.raises(SystemExit, match="non-dict"):
        R.merge_unset({"dataset": "ich_phantom"}, ["dataset.prepare.k"])
    with pytest.raises(SystemExit, match="dotted key path"):
        R.merge_unset({}, ["dataset..k"])
    R.check_unset("fedavg_cxr14", ["dataset.prepare.k", "dataset.prepare.val_frac", "train.lr"])  # job or preset
    with pytest.raises(SystemExit, match="fedavg_cxr14 .*has no such key"):
        R.check_unset("fedavg_cxr14", ["dataset.prepare.kk"])


def test_unset_reaches_the_servers_rule_args(tmp_path):
    job = tmp_path / "job"
    client = {"executors": [{"executor": {"args": deep_merge(JOB_ARGS, {"method_args": {"beta": R.UNSET}})}}]}
    server = {"components": [{"id": "aggregator", "args": {"method_args": {"mu": 0.1, "beta": R.UNSET}}}]}
    _write(job / "app/config/config_fed_client.json", [json.dumps(client)])
    _write(job / "app/config/config_fed_server.json", [json.dumps(server)])
    R.apply_unset_to_job(job)
    c = json.loads((job / "app/config/config_fed_client.json").read_text())
    s = json.loads((job / "app/config/config_fed_server.json").read_text())
    assert c["executors"][0]["executor"]["args"]["method_args"] == {"mu": 0.1}
    assert s["components"][0]["args"]["method_args"] == {"mu": 0.1}


def test_resume_refuses_another_unset(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"args": {"rounds": 20, "sites": 5, "override": "{}", "seeds": [0]}, "runs": {}}))
    a = R.argparse.Namespace(out=out, rounds=20, sites=5, override="{}", unset=[])
    assert R.previous_runs(a) == {}  # an older file without "unset": none
    a.unset = ["train.lr"]
    with pytest.raises(SystemExit, match="unset"):
        R.previous_runs(a)


def test_sweep_table_pairs_every_point_and_seed_by_hand(tmp_path):
    """benchmarks/sweep_table.py: per-point mean ± std over seeds and the paper's paired t-test over all runs."""
    from scipy import stats

    spec = importlib.util.spec_from_file_location("sweep_table", REPO / "benchmarks" / "sweep_table.py")
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)

    def run(seed, auc):
        return {"seed": seed, "final": {"FL_global_model.pt": {"test": {"macro": {"auc": auc}}}}}

    a = {2: (0.70, 0.72), 4: (0.75, 0.71)}  # per point: seeds 0 and 1
    b = {2: (0.69, 0.70), 4: (0.74, 0.72)}
    files = []
    for k in (2, 4):
        f = tmp_path / f"sweep_k{k}.json"
        f.write_text(
            json.dumps(
                {"runs": {"A": [run(s, v) for s, v in enumerate(a[k])], "B": [run(s, v) for s, v in enumerate(b[k])]}}
            )
        )
        files.append(f)
    text, cmp = st.sweep_table(files, "A", "B", ["2", "4"], "K")
    for f in files:  # the summaries the repository keeps give the same table
        runs = json.loads(f.read_text())["runs"]
        f.write_text(json.dumps({"final": R.final_per_seed(runs)}))
    assert st.sweep_table(files, "A", "B", ["2", "4"], "K")[0] == text
    assert "| 2 | 71.00 ± 1.41 | 69.50 ± 0.71 | 1.50 ± 0.71 | 2 |" in text  # diffs 1 and 2
    x, y = [70, 72, 75, 71], [69, 70, 74, 72]
    assert cmp["n"] == 4 and cmp["mean_diff"] == pytest.approx(0.75)
    assert cmp["p"] == pytest.approx(stats.ttest_rel(x, y).pvalue)
    assert st.main([str(f) for f in files] + ["--a", "A", "--b", "B"]) == 0
