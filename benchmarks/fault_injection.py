"""Faults on a provisioned localhost federation (server + 3 hospitals, as tests/test_deploy_poc.py builds it):

    python benchmarks/fault_injection.py --out benchmarks/results/fault_injection.json

Processes are found with psutil by their startup kit and NVFlare module (``participant_processes``: the
``sub_start.sh`` watchdog, the parent ``-m nvflare.private.fed.app.{client.client_train,server.server_train}``
and the job worker ``-m nvflare.private.fed.app.{client.worker_process,server.runner_process}``), killed with
SIGKILL by PID, checked gone, and started again from the kit: every row records the PIDs before and after.

1. ``dead before submit``: hospital-3 is killed; ``fedpartial-admin``'s check names it as not connected; the job
   (``meta.json`` ``min_clients`` = sites - max_missing_sites) starts with the two others and the class only
   hospital-3 annotates stops its data check (``class_without_annotator: stop``); hospital-3 comes back.
2. ``dead mid-round``: a ``rounds``-round job with the shipped round wait (30 s); hospital-3 (watchdog, parent,
   worker) is killed while round 2 trains: the job completes without it, results DEGRADED; the time from the
   kill to FINISHED:COMPLETED is recorded; hospital-3 comes back.
3. ``worker killed``: only hospital-3's job worker is killed while round 2 trains (its parent lives on):
   NVFlare 2.9 fails the whole job when a parent reports its worker dead; ``fedpartial-admin resume JOB_ID``
   continues it from the checkpoint with a new worker process at every hospital.
4. ``server killed``: the server's watchdog, parent and job process are killed while round 3 trains; the server
   is started again (new PIDs), the hospitals reconnect, and ``resume JOB_ID`` completes the job: the rounds
   redone (trained before the kill and again after) are counted, each round is recorded once.

Every process started is killed at the end. Prints and writes (``--out``) what happened with timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "custom"), str(REPO / "tests")]

from test_deploy_poc import (  # noqa: E402
    HOSPITALS,
    PROJECT_ADMIN,
    Deployment,
    download_job,
    kill_pids,
    participant_processes,
    tolerant_job,
    wait_clients,
    wait_job,
    wait_round,
)

from fedpartial.fl.selection import degradation  # noqa: E402
from fedpartial.tools.admin import STALE_AFTER, connected_sites, failure_lines, open_session, resume_folder, site_check  # noqa: E402


def kill(dep: Deployment, who: str, roles=("watchdog", "parent", "worker")) -> dict:
    """SIGKILL the participant's processes of ``roles`` by PID; returns the PIDs and asserts they are gone."""
    procs = participant_processes(dep.kits / who)
    pids = {r: procs[r] for r in roles}
    assert pids["parent" if "parent" in roles else "worker"], f"{who}: nothing to kill ({procs})"
    left = kill_pids([p for r in roles for p in procs[r]])
    assert not left, f"{who}: still alive after SIGKILL: {left}"
    now = participant_processes(dep.kits / who)
    assert not any(set(now[r]) & set(pids[r]) for r in roles), now
    return pids


def _alive(pid: int) -> bool:
    """A running process (a killed one whose parent does not reap it stays a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def restart(dep: Deployment, sess, who: str, old: dict) -> dict:
    """Start the participant from its kit again (after removing the pid files its killed watchdog left: NVFlare's
    ``start.sh`` refuses to start while they exist); returns its new PIDs (asserted new) and the seconds until it
    is registered (hospitals) or its parent runs (server)."""
    t0 = time.time()
    for stale in ("daemon_pid.fl", "pid.fl"):  # start.sh refuses to start while these name a (killed) process
        path = dep.kits / who / stale
        if path.is_file() and not any(_alive(int(p)) for p in path.read_text().split() if p.isdigit()):
            path.unlink()
    dep.start(who)
    while time.time() - t0 < 120 and not participant_processes(dep.kits / who)["parent"]:
        time.sleep(0.5)
    new = participant_processes(dep.kits / who)
    assert new["parent"] and not set(new["parent"]) & set(old.get("parent", [])), (old, new)
    if sess is not None:
        wait_clients(sess, [who], timeout=120)
    return {"new_pids": new, "seconds": round(time.time() - t0, 1)}


def job_result(sess, job_id: str, dest: Path) -> tuple[dict, str]:
    folder = download_job(sess, job_id, dest)
    res_file = next(folder.rglob("results.json"), None)
    log = next(folder.rglob("log.txt"), None)
    return (json.loads(res_file.read_text()) if res_file else {}), (log.read_text(errors="replace") if log else "")


def _resume_line(log: str) -> str:
    return next((ln.split(" - ")[-1] for ln in log.splitlines() if "resuming from the checkpoint" in ln), "")


def dead_before_submit(dep: Deployment, sess, rounds: int) -> dict:
    pids = kill(dep, "hospital-3")
    t0 = time.time()
    wait_clients(sess, ["hospital-3"], present=False, timeout=120)
    seen_down = round(time.time() - t0, 1)
    job = tolerant_job(dep.root / "jobs", "fedmlp_dead_before_submit", rounds, wait_after_min=30)
    warning = site_check(job, connected_sites(sess), HOSPITALS)
    jid = sess.submit_job(str(job))
    meta = wait_job(sess, jid, timeout=300)
    folder = download_job(sess, jid, dep.root / "res_before_submit")
    row = {
        "killed_pids": pids,
        "seconds_until_admin_sees_it_down": seen_down,
        "admin_told": warning,
        "status": meta.get("status"),
        "why": failure_lines(folder, limit=2),
    }
    row["restart"] = restart(dep, sess, "hospital-3", pids)
    return row


def dead_mid_round(dep: Deployment, sess, rounds: int) -> dict:
    job = tolerant_job(dep.root / "jobs", "fedmlp_dead_mid_round", rounds, wait_after_min=30)
    jid = sess.submit_job(str(job))
    wait_round(sess, jid, 2)
    t_kill = time.time()
    pids = kill(dep, "hospital-3")
    meta = wait_job(sess, jid, timeout=900)
    after = round(time.time() - t_kill, 1)
    res, log = job_result(sess, jid, dep.root / "res_mid_round")
    row = {
        "killed_pids": pids,
        "status": meta.get("status"),
        "seconds_kill_to_finished": after,
        "missing_per_round": {r["round"]: r.get("missing", []) for r in res.get("rounds", [])},
        "round_seconds": {r["round"]: round(r.get("seconds") or 0, 1) for r in res.get("rounds", [])},
        "degraded": (res.get("degraded") or degradation(res) or {}).get("reasons"),
        "final_evaluation_without": "final evaluation WITHOUT site(s) ['hospital-3']" in log,
    }
    row["restart"] = restart(dep, sess, "hospital-3", pids)
    return row


def worker_killed(dep: Deployment, sess, rounds: int) -> dict:
    job = tolerant_job(dep.root / "jobs", "fedmlp_worker_killed", rounds, wait_after_min=30)
    jid = sess.submit_job(str(job))
    wait_round(sess, jid, 2)
    parent_before = participant_processes(dep.kits / "hospital-3")["parent"]
    pids = kill(dep, "hospital-3", roles=("worker",))
    meta = wait_job(sess, jid, timeout=900)
    parent_after = participant_processes(dep.kits / "hospital-3")["parent"]
    t0 = time.time()
    jid_r = sess.submit_job(str(resume_folder(job, dep.root / "jobs" / "resume_worker", jid)))
    workers = []
    while time.time() - t0 < 120 and not workers:
        workers = participant_processes(dep.kits / "hospital-3")["worker"]
        time.sleep(0.5)
    meta_r = wait_job(sess, jid_r, timeout=900)
    res, log = job_result(sess, jid_r, dep.root / "res_worker_resumed")
    return {
        "killed_pids": pids,
        "status": meta.get("status"),
        "parent_pid_kept": parent_before == parent_after,
        "resumed_status": meta_r.get("status"),
        "new_worker_pids": workers,
        "new_worker_pid_differs": bool(workers) and not set(workers) & set(pids["worker"]),
        "resume_line": _resume_line(log),
        "rounds": [r["round"] for r in res.get("rounds", [])],
        "seconds_resubmit_to_finished": round(time.time() - t0, 1),
    }


def server_killed(dep: Deployment, sess, rounds: int) -> tuple[dict, object]:
    job = tolerant_job(dep.root / "jobs", "fedmlp_server_killed", rounds, wait_after_min=30)
    jid = sess.submit_job(str(job))
    wait_round(sess, jid, 3)
    sess.close()
    killed_in = 3 - 1  # the 0-based round training when the server died
    pids = kill(dep, "localhost")
    t0 = time.time()
    back = restart(dep, None, "localhost", pids)
    sess = open_session(dep.kits / PROJECT_ADMIN, timeout=120)
    wait_clients(sess, HOSPITALS, timeout=180)
    reconnected = round(time.time() - t0, 1)
    jid_r = sess.submit_job(str(resume_folder(job, dep.root / "jobs" / "resume_server", jid)))
    meta_r = wait_job(sess, jid_r, timeout=900)
    res, log = job_result(sess, jid_r, dep.root / "res_server_resumed")
    line = _resume_line(log)
    resumed_from = int(line.split("round ")[1].split()[0]) if "round " in line else None
    return {
        "killed_pids": pids,
        "new_pids": back["new_pids"],
        "hospitals_reconnected_after_s": reconnected,
        "killed_while_training_round": killed_in,
        "resume_line": line,
        "resumed_status": meta_r.get("status"),
        "rounds": [r["round"] for r in res.get("rounds", [])],
        "rounds_redone": None if resumed_from is None else killed_in - (resumed_from + 1),
        "seconds_restart_to_finished": round(time.time() - t0, 1),
    }, sess


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="scenarios to run (default: all)")
    a = ap.parse_args(argv)
    report: dict = {
        "command": " ".join(["python benchmarks/fault_injection.py", *(sys.argv[1:] if argv is None else argv)]),
        "rounds": a.rounds,
        "round_wait_after_min_s": 30,
    }
    dep = Deployment(Path(tempfile.mkdtemp(prefix="fedpartial-faults-")))
    report["client_outcome_wait_timeout_s"] = float(dep.env["NVFLARE_CLIENT_OUTCOME_WAIT_TIMEOUT"])
    report["site_down_after_s"] = STALE_AFTER  # fedpartial-admin: no heartbeat for this long
    scenarios = {
        "dead_before_submit": dead_before_submit,
        "dead_mid_round": dead_mid_round,
        "worker_killed": worker_killed,
    }
    sess = None
    try:
        dep.provision()
        dep.prepare_hospital_data()
        for participant in ["localhost", *HOSPITALS]:
            dep.start(participant)
        dep.all_connected()  # from the server's log: no admin login while the server starts
        sess = open_session(dep.kits / PROJECT_ADMIN, timeout=90)
        wait_clients(sess, HOSPITALS, timeout=180)
        for name, fn in scenarios.items():
            if a.only is None or name in a.only:
                t0 = time.time()
                report[name] = fn(dep, sess, a.rounds)
                report[name]["scenario_seconds"] = round(time.time() - t0, 1)
                print(json.dumps({name: report[name]}), flush=True)
        if a.only is None or "server_killed" in a.only:
            report["server_killed"], sess = server_killed(dep, sess, a.rounds)
            print(json.dumps({"server_killed": report["server_killed"]}), flush=True)
    finally:
        if sess is not None:
            sess.close()
        report["processes_left"] = dep.stop()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
