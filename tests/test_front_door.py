"""The front door: a run stops whole on Ctrl-C / SIGTERM / SIGKILL and resumes, two runs side by side both finish,
a site that cannot start fails its run at once, and bad input (model files, images, a read-only cache, an empty
store file, an export aimed at its own run) ends in one line, never a traceback, never lost data."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from test_export import random_run, run_bundle  # noqa: F401 - random_run is a fixture

from conftest import REPO, real_data
from fedpartial.fl import simulator as S
from fedpartial.models import PartialLabelNet, load_weights, read_state
from fedpartial.processes import stop_tree
from fedpartial.tools import export as E
from fedpartial.tools import predict as P

JOB = "fedavg_ich"
SITES = 2  # every site is a process
TINY = [
    "--sites",
    str(SITES),
    "--set",
    "dataset.prepare.k=2",
    "--set",
    "dataset.image_size=32",
    "--set",
    "dataset.prepare.source_args.n_images=240",
    "--set",
    "dataset.prepare.source_args.size=64",
    "--set",
    "train.batch_size=16",
]


# ------------------------------------------------------------------------------------------ job.py's processes


def _start(ws: Path, *args: str, env: dict | None = None, log: Path) -> subprocess.Popen:
    """``python jobs/fedavg_ich/job.py --workspace WS ... TINY`` from the checkout, in a session of its own (as a
    terminal starts it: its process group is its pid)."""
    cmd = [sys.executable, f"jobs/{JOB}/job.py", "--workspace", str(ws), *TINY, *args]
    out = open(log, "w")
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"job.py ended ({proc.returncode}) before {what}: {log.read_text()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"no {what} after {timeout} s: {log.read_text()[-3000:]}")


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _workers(pid: int) -> list[psutil.Process]:
    out = []
    for p in _tree(pid):
        try:
            if "simulator_worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (the same process: psutil compares start times, so a reused pid is not it)."""
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.integration
def test_ctrl_c_stops_every_process_of_the_run_says_what_was_kept_and_the_run_resumes(tmp_path, data_cache):
    ws, log = tmp_path / "ws", tmp_path / "job.log"
    env = {"FEDPARTIAL_CACHE": str(data_cache)}
    proc = _start(ws, "--rounds", "40", env=env, log=log)
    ckpt = ws / f"{JOB}.checkpoints" / JOB / "simulate_job" / "server" / "checkpoint.pt"
    _wait_for(lambda: ckpt.is_file(), 300, "checkpoint of a finished round", proc, log)
    workers = _wait_for(
        lambda: _workers(proc.pid) if len(_workers(proc.pid)) == SITES else None, 60, "every site worker", proc, log
    )
    # forked from the launcher's fork server (torch imported once), each titled with NVFlare's worker command
    assert all(" ".join(w.parent().cmdline()).strip().endswith("(fork server)") for w in workers), workers
    before = _tree(proc.pid)
    assert len(before) >= 4 + SITES  # the launcher, its fork server, server process, Manager, the site workers
    best_file = ws / JOB / "server" / "simulate_job" / "app_server" / "best_FL_global_model.pt"

    def checkpoint_after_a_best_model():  # the checkpoint of the round that wrote the best model file, or later
        return best_file.is_file() and ckpt.stat().st_mtime_ns > best_file.stat().st_mtime_ns

    _wait_for(checkpoint_after_a_best_model, 300, "a checkpoint after a best model file", proc, log)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: job.py's process group only
    assert proc.wait(timeout=30) == 130
    gone, alive = psutil.wait_procs(before, timeout=30)
    assert not _alive(alive), [p.cmdline() for p in _alive(alive)]
    text = log.read_text()
    assert "stopped (Ctrl-C); the simulator and its site processes are gone" in text, text[-2000:]
    kept = next(line for line in text.splitlines() if line.startswith("kept: "))
    found = re.search(r" after round (\d+) \(the log's 'Round (\d+) finished': NVFlare counts from 0\)$", kept)
    assert found and int(found[2]) == int(found[1]) - 1, kept
    assert f"Round {found[2]} finished" in text  # the log's own line for that round
    # the checkpoint's best model is the one the persistor wrote as the best model file: the model the selector
    # scored at its best round (it held the model aggregated in that round: one round late)
    kept_state = torch.load(ckpt, weights_only=True)
    written = torch.load(best_file, weights_only=True)["model"]
    assert kept_state["best_round"] is not None and set(kept_state["best"]) == set(written)
    for key, value in written.items():
        assert torch.equal(torch.as_tensor(kept_state["best"][key]), torch.as_tensor(value)), key
    done = int(found[1])
    resume = next(line for line in text.splitlines() if line.startswith("resume: ")).split(": ", 1)[1].split()
    assert resume[:2] == ["python", f"jobs/{JOB}/job.py"] and resume[-1] == "--resume"
    # the printed command, one more round
    args = resume[2:]
    args[args.index("--rounds") + 1] = str(done + 1)
    again = subprocess.run(
        [sys.executable, f"jobs/{JOB}/job.py", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    server_log = (ws / JOB / "server" / "log.txt").read_text()
    assert f"resuming from the checkpoint of round {done - 1} of job simulate_job" in server_log
    results = json.loads((ws / JOB / "server" / "simulate_job" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]][-1] == done
    # the best model file is the model the selector scored at its best round, across the resume too: its final
    # score on the validation set is that round's (a resumed run wrote the resumed global model there, and its
    # checkpoint kept the model one round after the best)
    best, final = results["best"], results["final"]["best_FL_global_model.pt"]
    assert final["val"]["macro"][best["metric"]] == pytest.approx(best[f"val_{best['metric']}"], abs=1e-9), (best, done)


@pytest.mark.integration
def test_sigkill_of_job_py_leaves_no_process_of_the_run(tmp_path, data_cache):
    ws, log = tmp_path / "ws", tmp_path / "job.log"
    proc = _start(ws, "--rounds", "40", env={"FEDPARTIAL_CACHE": str(data_cache)}, log=log)
    _wait_for(lambda: len(_workers(proc.pid)) == SITES, 300, "every site worker", proc, log)
    before = _tree(proc.pid)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    _, alive = psutil.wait_procs(before, timeout=30)
    assert not _alive(alive), [p.cmdline() for p in _alive(alive)]


SITE_WONT_START = """
import os, sys
if "--client" in sys.argv and sys.argv[sys.argv.index("--client") + 1] == "site-2":
    os._exit(3)  # TEST ONLY: site-2's simulator worker dies at start, before it connects
"""


@pytest.mark.integration
def test_runs_started_together_finish_and_a_site_that_cannot_start_fails_its_run_at_once(tmp_path, data_cache):
    """Three runs started at the same moment on one machine: two complete (each on its own ports; one with its site
    workers started as fresh processes, ``FEDPARTIAL_SIM_FORK=0``, NVFlare's own way); in the third, site-2's worker
    dies at start, and that run fails within seconds with a last line naming the site."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITE_WONT_START)  # every Python process of that run imports it
    env = {"FEDPARTIAL_CACHE": str(data_cache)}
    broken = {**env, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.time()
    procs = {
        k: _start(
            tmp_path / k,
            "--rounds",
            "1" if k != "c" else "2",
            env=broken if k == "c" else {**env, S.FORK_ENV: "0"} if k == "b" else env,
            log=tmp_path / f"{k}.log",
        )
        for k in ("a", "b", "c")
    }
    assert procs["c"].wait(timeout=120) == 2
    assert time.time() - t0 < 120
    last = (tmp_path / "c.log").read_text().strip().splitlines()[-1]
    assert "SITE FAILED TO START: site-2" in last and "exit status 3" in last, last  # the fault is the one made
    for k in ("a", "b"):
        assert procs[k].wait(timeout=600) == 0, (tmp_path / f"{k}.log").read_text()[-3000:]
        assert (tmp_path / k / JOB / "server" / "simulate_job" / "results.json").is_file()


# ------------------------------------------------------------------------------------------------ ports


def test_reserved_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice(tmp_path, monkeypatch):
    monkeypatch.setattr(S.tempfile, "tempdir", str(tmp_path))  # a ledger of this test's own
    ports = S.port_range()
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ports.stop == low  # no outgoing connection is ever given one of these
    a, b = S.reserve_ports(3), S.reserve_ports(3)
    assert not set(a) & set(b) and all(p in ports for p in a + b)
    # a small range: every port reserved -> one line; a reservation of a process that is gone is free again
    free = next(p for p in range(24000, 25000) if S._bindable(p) and S._bindable(p + 1))
    monkeypatch.setenv(S.PORTS_ENV, f"{free}-{free + 1}")
    assert sorted(S.reserve_ports(2)) == [free, free + 1]
    with pytest.raises(RuntimeError, match="no free port"):
        S.reserve_ports(1)
    ledger = S._ledger()
    held = json.loads(ledger.read_text())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    held[str(free)][0] = int(dead)
    ledger.write_text(json.dumps(held))
    assert S.reserve_ports(1) == [free]
    with socket.socket() as s:  # a port something listens on is skipped
        held = json.loads(ledger.read_text())
        held.pop(str(free + 1))
        ledger.write_text(json.dumps(held))
        s.bind(("", free + 1))
        s.listen()
        with pytest.raises(RuntimeError):
            S.reserve_ports(1)
    monkeypatch.setenv(S.PORTS_ENV, "80-90")
    with pytest.raises(ValueError, match="1024 < LO"):
        S.port_range()


def test_the_patched_nvflare_names_exist():
    S.check_nvflare()  # fails when an NVFlare release moves what the launcher patches


def test_stop_tree_stops_children_and_grandchildren():
    sleeper = "import time; time.sleep(60)"
    spawn = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(60)"
    top = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {spawn!r}]); time.sleep(60)",
        ]
    )
    t0 = time.time()
    while len(_tree(top.pid)) < 2 and time.time() - t0 < 30:  # its child and grandchild
        time.sleep(0.1)
    procs = _tree(top.pid)
    assert len(procs) == 2
    assert stop_tree(top.pid, grace=1.0) == 2
    assert not _alive(procs)
    assert top.poll() is None  # the process itself is not stopped: what is under it
    top.kill()
    top.wait(timeout=5)


# ------------------------------------------------------------------------------------------- fork server

PROBE = """
import json, os, signal, sys
import shadowed, kept
out = {
    "argv": sys.argv[1:], "x": os.environ.get("X"), "cwd": os.getcwd(), "session_leader": os.getsid(0) == os.getpid(),
    "path": sys.path[:2], "shadowed": shadowed.WHERE, "kept_id": id(kept), "custom": os.environ.get("CUSTOMISED"),
    "cmdline": open("/proc/self/cmdline").read().replace(chr(0), " ").strip(),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
}
print("probe on stdout")
json.dump(out, open(sys.argv[-1], "w"))
sys.exit(int(os.environ.get("CODE", "0")))
"""

FORK_DRIVER = """
import json, os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])  # the server's own copy of `shadowed`
import shadowed, kept
from fedpartial.processes import ForkServer
server = ForkServer.start(("json", "pre.loaded"))
env = {**os.environ, "X": "1", "PYTHONPATH": sys.argv[2], "CODE": "7"}
cmd = [sys.executable, "-m", "probe", "a b", sys.argv[3]]
p = server.popen(cmd, env=env, cwd=sys.argv[4], setsid=True)
code = p.wait(timeout=60)
err_file = os.path.join(sys.argv[4], "preloaded.err")
with open(err_file, "w") as err:  # a module the server imported, run as a command
    server.popen([sys.executable, "-m", "pre.loaded"], env=env, stderr=err.fileno()).wait(timeout=60)
preloaded_err = open(err_file).read()
sleeper = server.popen([sys.executable, "-m", "sleeper"], env=env)
running = sleeper.poll()
try:
    sleeper.wait(timeout=0.2)
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
sleeper.kill()
print(json.dumps({"code": code, "running": running, "timed_out": timed_out, "killed": sleeper.wait(timeout=10),
                  "kept_id": id(kept), "preloaded_err": preloaded_err, "server": server.pid, "orphan": server.popen(
                      [sys.executable, "-m", "sleeper"], env=env).pid}), flush=True)
time.sleep(60)  # killed by the test: the server and its children go with it
"""


def test_fork_server_children_are_what_a_fresh_interpreter_would_be(tmp_path):
    """A command forked from :class:`fedpartial.processes.ForkServer` gets its arguments, environment, working
    folder, session, ``PYTHONPATH`` (a module the server imported from elsewhere comes from there, one it imported
    from there stays), ``sitecustomize``, default signal handlers, exit status and title; a module the server
    imported runs as ``__main__`` without a warning; the server's caller killed, the server and the command are
    gone."""
    server_copy, path, work = tmp_path / "server_copy", tmp_path / "path", tmp_path / "work"
    for folder in (server_copy, path, work):
        folder.mkdir()
    (server_copy / "shadowed.py").write_text("WHERE = 'server'\n")
    (path / "shadowed.py").write_text("WHERE = 'pythonpath'\n")
    (path / "kept.py").write_text("")
    (path / "probe.py").write_text(PROBE)
    (path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    (path / "pre").mkdir()  # a module of a package, as NVFlare's simulator_worker is (runpy warns only for those)
    (path / "pre" / "__init__.py").write_text("")
    (path / "pre" / "loaded.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('ran as main', file=sys.stderr)\n"
    )
    (path / "sitecustomize.py").write_text("import os\nos.environ['CUSTOMISED'] = 'yes'\n")
    out = tmp_path / "probe.json"
    driver = subprocess.Popen(
        [sys.executable, "-c", FORK_DRIVER, str(server_copy), str(path), str(out), str(work)],
        env={**os.environ, "PYTHONPATH": str(path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    printed = driver.stdout.readline()
    assert printed.startswith("probe on stdout"), printed  # the caller's stdout
    seen = json.loads(driver.stdout.readline())
    probe = json.loads(out.read_text())
    assert seen["code"] == 7 and seen["running"] is None and seen["timed_out"] and seen["killed"] == -signal.SIGKILL
    assert probe["argv"] == ["a b", str(out)] and probe["x"] == "1" and probe["cwd"] == str(work)
    assert probe["session_leader"] and probe["sigterm_default"] and probe["custom"] == "yes"
    assert probe["path"] == [str(work), str(path)] and probe["shadowed"] == "pythonpath"
    assert probe["kept_id"] == seen["kept_id"]  # imported from PYTHONPATH by the server: not imported again
    assert probe["cmdline"] == f"{sys.executable} -m probe a b {out}"
    assert seen["preloaded_err"] == "ran as main\n"  # and no runpy warning that it was imported before it ran
    server, orphan = psutil.Process(seen["server"]), psutil.Process(seen["orphan"])
    driver.kill()
    driver.wait(timeout=10)
    _, alive = psutil.wait_procs([server, orphan], timeout=10)
    assert not _alive(alive)


# --------------------------------------------------------------------------- the image store's pool


@pytest.mark.realdata
def test_store_build_stops_on_sigterm_keeps_its_chunks_and_sigkill_leaves_no_worker(tmp_path):
    root = real_data("nih_cxr14_1000")
    env = {**os.environ, "FEDPARTIAL_CACHE": str(tmp_path / "cache")}
    prep = tmp_path / "prep"
    bin_ = Path(sys.executable).parent
    subprocess.run(
        [
            str(bin_ / "fedpartial-prepare"),
            "--source",
            "nih_cxr14",
            "--root",
            str(root),
            "--out",
            str(prep),
            "--sites",
            "1",
            "--protocol",
            "full",
            "--no-decode",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    cmd = [str(bin_ / "fedpartial-store"), str(prep), "--image-size", "384", "--channels", "1", "--workers", "2"]

    def start():
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        while time.time() - t0 < 60:
            pool = [p for p in _tree(proc.pid) if "forkserver" in " ".join(p.cmdline())]
            workers = [c for p in pool for c in p.children()]
            if len(workers) >= 2:
                return proc, pool + workers
            time.sleep(0.1)
        pytest.fail("no pool of 2 workers")

    proc, pool = start()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    err = out + err
    assert proc.returncode == 143 and "stopped (SIGTERM)" in err and "Traceback" not in err, err[-2000:]
    assert "chunks are kept in" in err
    psutil.wait_procs(pool, timeout=10)
    assert not _alive(pool)
    proc, pool = start()
    proc.kill()
    proc.wait(timeout=10)
    # a worker killed mid start-up (still importing on a loaded machine) notices its parent's death once its
    # initializer runs: within seconds alone, within 30 s with both cores busy (the bar of the job.py kill test)
    psutil.wait_procs(pool, timeout=30)
    assert not _alive(pool), [p.cmdline()[:3] for p in _alive(pool)]  # the workers went with their parent
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# --------------------------------------------------------------------------- bad input: one line each


def _hostile(path: Path, marker: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model": Payload()}, path)


@pytest.mark.parametrize("kind", ["truncated", "random", "text", "empty", "hostile", "another_job"])
def test_a_bad_model_file_is_one_line_exit_2(random_run, tmp_path, kind, capsys):  # noqa: F811
    run, _ = random_run
    model = run / "app_server" / P.BEST_MODEL
    good = model.read_bytes()
    marker = tmp_path / "pwned"
    if kind == "truncated":
        model.write_bytes(good[: len(good) // 3])
    elif kind == "random":
        model.write_bytes(np.random.default_rng(0).bytes(5000))
    elif kind == "text":
        model.write_text("weights: none\n")
    elif kind == "empty":
        model.write_bytes(b"")
    elif kind == "hostile":
        _hostile(model, marker)
    else:
        torch.save({"model": PartialLabelNet("small_cnn", num_classes=3, in_channels=3).state_dict()}, model)
    images = tmp_path / "imgs"
    images.mkdir()
    Image.fromarray(np.zeros((20, 20), np.uint8)).save(images / "a.png")
    assert P.main([str(run), "--images", str(images), "-o", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fedpartial-predict: error: model file {model}"), err
    assert "Traceback" not in "\n".join(err) and "weights_only" not in "\n".join(err)
    assert not marker.exists()  # nothing in the file ran
    expect = {
        "truncated": "truncated or damaged",
        "random": "not a PyTorch file",
        "text": "not a PyTorch file",
        "empty": "is empty (0 bytes)",
        "hostile": "refused because loading it would run code",
        "another_job": "is not a model of this job: classifier",
    }[kind]
    assert expect in err[-1], err[-1]
    assert E.main([str(run), "-o", str(tmp_path / "bundle")]) == 2  # the export says the same, writes nothing
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("fedpartial-export: error: model file")
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle.*"))


def test_read_state_and_load_weights_units(tmp_path):
    net = PartialLabelNet("small_cnn", num_classes=5, in_channels=1)
    torch.save(net.state_dict(), tmp_path / "ok.pt")
    load_weights(net, read_state(tmp_path / "ok.pt"), tmp_path / "ok.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a dict of tensors"):
        read_state(tmp_path / "list.pt")
    with pytest.raises(FileNotFoundError):
        read_state(tmp_path / "none.pt")
    state = net.state_dict()
    state.pop(next(iter(state)))
    with pytest.raises(ValueError, match="1 keys missing"):
        load_weights(net, state, "x.pt")


def test_export_force_never_deletes_the_run_or_a_bundle_before_it_has_a_new_one(random_run, tmp_path, capsys):  # noqa: F811,E501
    run, _ = random_run

    def listing(folder: Path) -> dict:
        return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}

    before = listing(tmp_path)
    for out in (run, run.parent, run / "app_server", run / "app_server" / "bundle"):
        assert E.main([str(run), "-o", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert "choose a folder outside the run" in err and "Traceback" not in err, err
    assert listing(tmp_path) == before  # nothing deleted, nothing written
    bundle = tmp_path / "bundle"
    assert E.main([str(run), "-o", str(bundle)]) == 0
    capsys.readouterr()
    first = listing(bundle)
    assert E.main([str(tmp_path / "rnu"), "-o", str(bundle), "--force"]) == 2  # a mistyped run
    assert listing(bundle) == first
    (bundle / "eval").mkdir()  # what the bundle's inference writes by default, beside the bundle's own folders
    (bundle / "eval" / "predictions.csv").write_text("image,p\n")
    old_model = (bundle / "models" / "model.pt").stat().st_ino
    assert E.main([str(run), "-o", str(bundle), "--force"]) == 0  # its own files replaced, the rest kept
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("kept 1 file(s) that are not the bundle's: eval/predictions.csv"), err
    assert (bundle / "eval" / "predictions.csv").read_text() == "image,p\n"
    assert (bundle / "models" / "model.pt").stat().st_ino != old_model
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".bundle")) == []
    # folders that are not bundles of the export: a job folder (its job.py, README, config), a run's checkpoints
    job = tmp_path / "jobs" / "fedmlp_ich"
    shutil.copytree(REPO / "jobs" / "fedmlp_ich", job, ignore=shutil.ignore_patterns("app", "meta.json"))
    checkpoints = tmp_path / "ws" / "fedmlp_ich.checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "checkpoint.pt").write_bytes(b"state")
    before = listing(tmp_path)
    for out in (job, checkpoints):
        assert E.main([str(run), "-o", str(out), "--force"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "is not a bundle of fedpartial-export" in err[-1] and len(err) == 1, err
    assert listing(tmp_path) == before


def test_pixel_limit_is_read_from_the_header(tmp_path, monkeypatch):
    from fedpartial.data.store import DEFAULT_MAX_PIXELS, MAX_PIXELS_ENV, open_image

    big = tmp_path / "big.png"
    Image.new("P", (12000, 12000)).save(big, optimize=True)
    assert big.stat().st_size < 100_000  # tiny on disk, 144 M pixels
    with pytest.raises(ValueError, match=r"12,000 x 12,000 = 144,000,000 pixels, above the limit of 40,000,000"):
        open_image(str(big))
    assert DEFAULT_MAX_PIXELS < Image.MAX_IMAGE_PIXELS
    monkeypatch.setenv(MAX_PIXELS_ENV, "150000000")
    with open_image(str(big)) as im:  # under a raised limit: opened (the header only)
        assert im.size == (12000, 12000)
    monkeypatch.setenv(MAX_PIXELS_ENV, "1000")
    small = tmp_path / "small.png"
    Image.new("L", (40, 40)).save(small)
    with pytest.raises(ValueError, match="1,600 pixels, above the limit of 1,000"):
        open_image(str(small))
    with pytest.raises(ValueError, match="far above"):  # past Pillow's own bomb error, still our line
        monkeypatch.setenv(MAX_PIXELS_ENV, str(10**12))
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
        open_image(str(small))


@pytest.mark.integration
def test_the_bundle_leaves_out_an_unreadable_image_and_names_it(random_run, tmp_path, monkeypatch):  # noqa: F811
    run, _ = random_run
    assert E.main([str(run), "-o", str(tmp_path / "B")]) == 0
    images = tmp_path / "imgs"
    images.mkdir()
    for i in range(2):
        Image.fromarray(np.full((24, 24), 40 * i, np.uint8)).save(images / f"{i}.png")
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 40)
    Image.new("L", (300, 300)).save(images / "huge.png")  # above the limit this test sets
    monkeypatch.setenv("FEDPARTIAL_MAX_PIXELS", "50000")
    Image.fromarray(np.zeros((20, 20), np.uint8)).save(images / "c.tif")  # what prepare reads, the bundle reads
    proc = run_bundle(tmp_path / "B", images, tmp_path / "O", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert f"left out {images / 'broken.png'}" in out and f"left out {images / 'huge.png'}" in out
    import pandas as pd

    df = pd.read_csv(tmp_path / "O" / "predictions.csv", keep_default_na=False)
    assert len(df) == 5 and list(df.columns)[-1] == "error"
    bad = df[df["error"] != ""]
    assert sorted(Path(p).name for p in bad["image"]) == ["broken.png", "huge.png"]
    assert "pixels" in bad[bad["image"].str.endswith("huge.png")]["error"].item()
    assert (bad.filter(like="prob_") == "").all().all()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_bundle(tmp_path / "B", empty, tmp_path / "O2", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no image (")


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder writes to fail in (a read-only tmpfs as root, else a folder without write permission)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        ok = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True
            ).returncode
            == 0
        )
        if not ok:
            pytest.skip("root without mount: no read-only folder can be made here")
    else:
        folder.chmod(0o500)
    return folder


def test_a_read_only_cache_folder_is_one_line(tmp_path, monkeypatch, capsys):
    from fedpartial.data import prepare_cli

    folder = _read_only_folder(tmp_path)
    try:
        with pytest.raises(OSError):  # the fault: nothing can be written there
            (folder / "probe").write_text("x")
        src = tmp_path / "export"
        for c in ("a", "b"):
            (src / c).mkdir(parents=True)
            for i in range(6):
                Image.fromarray(np.full((16, 16), 20 * i, np.uint8)).save(src / c / f"{i}.png")
        monkeypatch.setenv("FEDPARTIAL_CACHE", str(folder))
        rc = prepare_cli.main(
            [
                "--source",
                "folder",
                "--root",
                str(src),
                "--out",
                str(tmp_path / "out"),
                "--sites",
                "1",
                "--protocol",
                "full",
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert str(folder) in err[0] and "set $FEDPARTIAL_CACHE to a writable folder" in err[0]
        assert not (tmp_path / "out").exists()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(folder)], capture_output=True)


def test_an_empty_images_npy_is_one_line(tmp_path):
    from fedpartial.data.store import Preprocessing, StoreError, build_store, open_store

    paths = []
    for i in range(5):
        Image.fromarray(np.full((16, 16), 30 * i, np.uint8)).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    build_store(paths, Preprocessing(8, 1, None, "area"), tmp_path / "store", workers=1)
    open_store(tmp_path / "store")
    (tmp_path / "store" / "images.npy").write_bytes(b"")
    with pytest.raises(
        StoreError,
        match=r"truncated or corrupt \(images.npy: No data left in file\); it is not "
        r"read: remove it",
    ):
        open_store(tmp_path / "store")
