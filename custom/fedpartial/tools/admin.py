"""Drive a provisioned (or POC) NVFlare deployment from an admin's startup kit, over the FLARE API.

::

    fedpartial-admin --kit ADMIN_KIT run jobs/fedmlp_ich -o results/   # submit, follow, download, print results
    fedpartial-admin --kit ADMIN_KIT submit jobs/fedmlp_ich            # prints the job id (and missing sites)
    fedpartial-admin --kit ADMIN_KIT submit --without-custom JOB       # for sites that allow-list the package
    fedpartial-admin --kit ADMIN_KIT status JOB_ID                     # job status, round, per-site task
    fedpartial-admin --kit ADMIN_KIT wait JOB_ID [--timeout S]         # follow until the job ends
    fedpartial-admin --kit ADMIN_KIT download JOB_ID -o results/       # the job's server workspace
    fedpartial-admin --kit ADMIN_KIT list                              # the server's jobs
    fedpartial-admin results results/JOB_ID                            # the results table (no server needed)
    fedpartial-admin --kit ADMIN_KIT resume JOB_ID jobs/fedmlp_ich -o results/  # continue job JOB_ID's run
    fedpartial-admin resume-folder jobs/fedmlp_ich /tmp/fedmlp_ich_resume  # resume on (simulator: same job id)

A server restart loses a running NVFlare 2.9 job. Every round the server and each site checkpoint what the job
needs under the job's id (``fedpartial.fl.checkpoint``); ``resume JOB_ID FOLDER`` submits the job folder again
with ``resume: "JOB_ID"`` on both sides, so it continues that run at the round after its last checkpoint, with
the method's server and site state, and its results hold the earlier rounds too. The server refuses (the job
stops before training, and ``resume`` prints why) a job id without checkpoints, or a folder whose configuration
is not the one that job ran. The stuck old job can be left alone (or removed from the job store by the
operator: ``nvflare`` cannot abort it after a restart).

``ADMIN_KIT`` is the admin user's provisioned folder (the one holding ``startup/fed_admin.json``); the user
name defaults to the folder's name (``admin@coordinator.org``). Everything here is a thin layer over
``nvflare.fuel.flare_api`` (``new_secure_session``, ``submit_job``, ``show_stats``,
``monitor_job_and_return_job_meta``, ``download_job_result``); exit codes: 0 when the job finished normally,
1 when it ended otherwise (failed, aborted, timed out), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from nvflare.apis.job_def import RunStatus

from ..fl.results import render_tables
from ..job_layout import training_entries
from .show_results import find_results

FINISHED_OK = RunStatus.FINISHED_COMPLETED.value  # "FINISHED:COMPLETED"


def open_session(kit: str | Path, user: str | None = None, timeout: float = 30.0):
    """A secure FLARE API session for the admin whose startup kit is ``kit`` (user: the kit folder's name)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    kit = Path(kit).expanduser().resolve()
    if not (kit / "startup" / "fed_admin.json").is_file():
        raise FileNotFoundError(f"{kit} is not an admin startup kit (no startup/fed_admin.json)")
    return new_secure_session(user or kit.name, str(kit), timeout=timeout)


def submit(sess, job_dir: str | Path, without_custom: bool = False) -> str:
    """Submit a job folder (``meta.json`` + apps); returns the job id.

    ``without_custom``: submit a copy without the apps' ``custom/`` code, for participants that installed the
    package and allow its classes (``fedpartial-allow-list``) instead of accepting custom code (BYOC).
    """
    job_dir = Path(job_dir).resolve()
    if not (job_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{job_dir} is not an NVFlare job folder (no meta.json)")
    if not without_custom:
        return sess.submit_job(str(job_dir))
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / job_dir.name
        shutil.copytree(job_dir, copy, ignore=lambda d, names: ["custom"] if (Path(d) / "config").is_dir() else [])
        return sess.submit_job(str(copy))


def resume_folder(job_dir: str | Path, dest: str | Path, job_id: str | bool = True) -> Path:
    """A copy of the job folder ``job_dir`` at ``dest`` with ``resume: job_id`` on the server's training workflow
    and every site's executor (the rest unchanged, so the job spec both sides check stays the same): the job id
    whose run to continue, or ``true`` for the run of the same job id (the simulator's ``simulate_job``)."""
    job_dir, dest = Path(job_dir).resolve(), Path(dest)
    if not (job_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{job_dir} is not an NVFlare job folder (no meta.json)")
    if dest.exists():
        raise FileExistsError(f"{dest} exists; choose a new folder")
    shutil.copytree(job_dir, dest)
    changed = 0
    for path in sorted(dest.glob("*/config/config_fed_*.json")):
        cfg = json.loads(path.read_text())
        for entry in training_entries(cfg):
            entry.setdefault("args", {})["resume"] = job_id
            changed += 1
        path.write_text(json.dumps(cfg, indent=2) + "\n")
    if changed < 2:
        shutil.rmtree(dest)
        raise ValueError(f"{job_dir}: no fedpartial training workflow and executor to resume")
    return dest


def _stats(sess, job_id: str, target: str) -> dict:
    try:
        return sess.show_stats(job_id, target) or {}
    except Exception:  # noqa: BLE001 - no stats before the job is deployed / after it ended
        return {}


def progress(sess, job_id: str, job_meta: dict | None = None) -> dict:
    """Job status, the running server workflow, the training round and each site's current tasks.

    Returns ``{"job_id", "name", "status", "workflow", "round", "num_rounds", "sites": {site: [tasks]}}`` with
    ``round`` 1-based while a ScatterAndGather-style workflow trains (None otherwise, or before the job runs).
    """
    meta = job_meta or sess.get_job_meta(job_id)
    out = {"job_id": job_id, "name": meta.get("name"), "status": meta.get("status"), "workflow": None,
           "round": None, "num_rounds": None, "sites": {}}
    server = _stats(sess, job_id, "server").get("server") or {}
    out["workflow"] = (server.get("ServerRunner") or {}).get("workflow")
    for group in server.values():  # the workflow's own stats group (ScatterAndGather: phase / round)
        if isinstance(group, dict) and group.get("current_round") is not None and group.get("phase") == "train":
            out["round"], out["num_rounds"] = int(group["current_round"]) + 1, group.get("num_rounds")
    for site, info in sorted(_stats(sess, job_id, "client").items()):
        runner = info.get("ClientRunner") if isinstance(info, dict) else None
        if isinstance(runner, dict):
            out["sites"][site] = list(runner.get("current_tasks") or [])
    return out


def format_progress(p: dict) -> str:
    """One line: ``job 1234 RUNNING  scatter_and_gather round 2/3  hospital-1: train, hospital-2: idle``."""
    line = f"job {p['job_id']} {p['status']}"
    if p.get("workflow"):
        line += f"  {p['workflow']}"
    if p.get("round") is not None:
        line += f" round {p['round']}" + (f"/{p['num_rounds']}" if p.get("num_rounds") is not None else "")
    if p.get("sites"):
        line += "  " + ", ".join(f"{s}: {'+'.join(t) or 'idle'}" for s, t in p["sites"].items())
    return line


def wait(sess, job_id: str, timeout: float = 0.0, poll: float = 2.0,
         echo: Callable[[str], None] | None = print) -> dict:
    """Follow a job until it ends, echoing a progress line whenever it changes; returns the final job meta.

    Raises:
        TimeoutError: the job did not end within ``timeout`` seconds (0 = no limit).
    """
    from nvflare.fuel.flare_api.api_spec import MonitorReturnCode

    last = [None]

    def cb(session, jid, job_meta):
        if echo is not None:
            line = format_progress(progress(session, jid, job_meta))
            if line != last[0]:
                echo(f"{time.strftime('%H:%M:%S')} {line}")
                last[0] = line
        return True

    rc, meta = sess.monitor_job_and_return_job_meta(job_id, timeout=timeout, poll_interval=poll, cb=cb)
    if rc == MonitorReturnCode.TIMEOUT:
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s")
    return meta


def download(sess, job_id: str, dest: str | Path) -> Path:
    """Download the job's result (the server's run folder: models, ``results.json``, logs) into ``dest/<job_id>``."""
    path = sess.download_job_result(job_id, str(Path(dest).resolve()))
    if not path or not Path(path).exists():
        raise RuntimeError(f"the server returned no result for job {job_id} (location: {path})")
    return Path(path)


def failure_lines(path: str | Path, limit: int = 5) -> list[str]:
    """Why a downloaded job failed: the distinct error lines of its server log (a site's data-check error names
    the site, file and line; a site's task failure names the site and task)."""
    keys = ("DATA CHECK FAILED", "failed task", "system_panic", "panic", "resume: ")
    seen: list[str] = []
    for log in sorted(Path(path).rglob("log.txt")):
        for line in log.read_text(errors="replace").splitlines():
            if any(k in line for k in keys):
                msg = line.split("] - ", 1)[1] if "] - " in line else line.split(" - ", 3)[-1]
                msg = msg.strip()
                if msg not in seen:
                    seen.append(msg)
    return seen[:limit]


def degraded_lines(results: dict) -> list[str]:
    """``DEGRADED: <reason>`` lines of a run that lost or refused sites (``results.json`` ``degraded``, else
    computed from its rounds)."""
    from ..fl.selection import degradation

    info = results.get("degraded", None) if "degraded" in results else degradation(results)
    return [f"DEGRADED: {r}" for r in (info or {}).get("reasons", [])]


def results_text(path: str | Path) -> str:
    """The results table of a downloaded job (or any folder / file holding ``results.json``), after the reasons
    the run is degraded, if it is."""
    file = find_results(Path(path))
    results = json.loads(file.read_text())
    head = "".join(line + "\n" for line in degraded_lines(results))
    return f"{file}\n{head}\n" + render_tables(results)


def job_sites(job_dir: str | Path) -> tuple[int | None, int, list[str]]:
    """``(number of sites, max_missing_sites, named sites)`` of a job folder: the server configuration's
    ``min_clients`` (the job's site count) and ``max_missing_sites``, and the sites ``meta.json``'s ``deploy_map``
    names (empty with ``@ALL``)."""
    job_dir = Path(job_dir)
    meta = json.loads((job_dir / "meta.json").read_text())
    named = sorted({s for targets in (meta.get("deploy_map") or {}).values() for s in targets
                    if isinstance(s, str) and not s.startswith("@") and s != "server"})
    n, missing = None, 0
    for path in sorted(job_dir.glob("*/config/config_fed_server.json")):
        cfg = json.loads(path.read_text())
        n = cfg.get("min_clients") if isinstance(cfg.get("min_clients"), int) else n
        missing = int(cfg.get("max_missing_sites", missing) or 0)
    return (n if n is not None else meta.get("min_clients")), missing, named


STALE_AFTER = 75.0  # seconds without a heartbeat (NVFlare clients send one every 30 s) before a site counts as down


def connected_sites(sess, stale_after: float = STALE_AFTER) -> list[str]:
    """The names of the sites connected to the server now: registered, and heard from within ``stale_after``
    seconds (the server itself lists a dead site until its 600 s heartbeat timeout)."""
    out = []
    now = time.time()
    for c in sess.get_connected_client_list() or []:
        name = getattr(c, "name", None) or (c.get("name") if isinstance(c, dict) else None)
        seen = getattr(c, "last_connect_time", None)
        if name and (seen is None or now - float(seen) <= stale_after):
            out.append(name)
    return sorted(out)


def site_check(job_dir: str | Path, connected: list[str], expected: list[str] | None = None) -> list[str]:
    """What the admin must know before a job goes out: ``warning:`` lines when fewer sites are connected than the
    job has (naming the missing ones when the job or ``expected`` names its sites), and whether NVFlare will
    start it (fewer than ``sites - max_missing_sites`` connected: it waits SUBMITTED, silently)."""
    n, max_missing, named = job_sites(job_dir)
    names = sorted(expected or named)
    lines = []
    absent = [s for s in names if s not in connected]
    count = n if n is not None else len(names)
    if absent or (count and len(connected) < count):
        which = f"; not connected: {', '.join(absent)}" if absent else ""
        lines.append(f"warning: {len(connected)} of the job's {count} site(s) are connected "
                     f"({', '.join(connected) or 'none'}){which}")
        if count and len(connected) < count - max_missing:
            lines.append(f"warning: the job needs at least {count - max_missing} site(s) (max_missing_sites "
                         f"{max_missing}): NVFlare keeps it SUBMITTED until enough sites connect")
        else:
            lines.append(f"warning: the job starts without them (max_missing_sites {max_missing}); its results "
                         "will be marked DEGRADED")
    return lines


# ------------------------------------------------------------------------------------------------------------ CLI

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedpartial-admin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kit", help="the admin's startup kit folder (holds startup/fed_admin.json)")
    ap.add_argument("--user", help="admin user name (default: the kit folder's name)")
    ap.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for the server")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sites_help = "comma-separated names of the job's sites, to name those not connected (default: meta.json's)"
    p = sub.add_parser("submit", help="submit a job folder, print its id")
    p.add_argument("job")
    p.add_argument("--sites", help=sites_help)
    p.add_argument("--without-custom", action="store_true", help="leave the apps' custom/ code out (non-BYOC)")
    p = sub.add_parser("status", help="job status, round and per-site task")
    p.add_argument("job_id")
    p = sub.add_parser("wait", help="follow a job until it ends")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds (0 = no limit)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between polls")
    p = sub.add_parser("download", help="download a job's result")
    p.add_argument("job_id")
    p.add_argument("-o", "--out", default="results", help="destination folder (default: results)")
    sub.add_parser("list", help="list the server's jobs")
    p = sub.add_parser("results", help="print the results table of a downloaded job (offline)")
    p.add_argument("path")
    for name, text in (("run", "submit, follow, download and print the results table"),
                       ("resume", "submit the job folder again continuing job JOB_ID's run from its last checkpoint, "
                                  "follow, download")):
        p = sub.add_parser(name, help=text)
        if name == "resume":
            p.add_argument("job_id", help="the job whose run to continue (its checkpoints are kept under its id)")
        p.add_argument("job")
        p.add_argument("--sites", help=sites_help)
        p.add_argument("--without-custom", action="store_true", help="leave the apps' custom/ code out (non-BYOC)")
        p.add_argument("-o", "--out", default="results", help="destination folder (default: results)")
        p.add_argument("--timeout", type=float, default=0.0, help="seconds (0 = no limit)")
        p.add_argument("--poll", type=float, default=2.0, help="seconds between polls")
    p = sub.add_parser("resume-folder", help="write the job folder with resume on (offline, e.g. for the simulator)")
    p.add_argument("job")
    p.add_argument("dest")
    p.add_argument("--job-id", default=True, help="the job whose run to continue (default: the same job id, as in "
                                                  "the simulator)")
    return ap


def _finish(sess, job_id: str, meta: dict, out: str) -> int:
    status = meta.get("status")
    print(f"job {job_id} ended: {status}")
    path = download(sess, job_id, out)
    print(f"downloaded to {path}")
    if status != FINISHED_OK:
        for line in failure_lines(path):
            print(f"error: {line}")
    try:
        print(results_text(path))
    except FileNotFoundError as e:
        print(f"no results table: {e}", file=sys.stderr)
    return 0 if status == FINISHED_OK else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd not in ("results", "resume-folder") and not args.kit:
        print("fedpartial-admin: --kit ADMIN_STARTUP_KIT is required for this command", file=sys.stderr)
        return 2
    try:
        if args.cmd == "results":
            print(results_text(args.path))
            return 0
        if args.cmd == "resume-folder":
            print(resume_folder(args.job, args.dest, args.job_id))
            return 0
        return _run_command(args)
    except Exception as e:  # noqa: BLE001 - FLARE API errors (refused, not authorized, no server) end here
        print(f"fedpartial-admin: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _run_command(args) -> int:
    sess = open_session(args.kit, args.user, args.connect_timeout)
    try:
        if args.cmd in ("submit", "run", "resume"):
            try:
                lines = site_check(args.job, connected_sites(sess), args.sites.split(",") if args.sites else None)
            except Exception as e:  # noqa: BLE001 - e.g. a user who may not list the sites: the submit decides
                lines = [f"warning: could not check the connected sites ({type(e).__name__}: {e})"]
            for line in lines:
                print(line, file=sys.stderr, flush=True)
        if args.cmd == "submit":
            print(submit(sess, args.job, args.without_custom))
        elif args.cmd == "status":
            print(format_progress(progress(sess, args.job_id)))
        elif args.cmd == "list":
            for j in sess.list_jobs():
                print(f"{j.get('job_id')}  {j.get('job_name') or j.get('name')}  {j.get('status')}  "
                      f"{j.get('submit_time') or ''}")
        elif args.cmd == "wait":
            meta = wait(sess, args.job_id, args.timeout, args.poll)
            print(f"job {args.job_id} ended: {meta.get('status')}")
            return 0 if meta.get("status") == FINISHED_OK else 1
        elif args.cmd == "download":
            print(download(sess, args.job_id, args.out))
        elif args.cmd in ("run", "resume"):
            with tempfile.TemporaryDirectory() as tmp:
                resuming = args.cmd == "resume"
                job = resume_folder(args.job, Path(tmp) / Path(args.job).name, args.job_id) if resuming else args.job
                job_id = submit(sess, job, args.without_custom)
            print(f"submitted {args.job}{f' (resuming job {args.job_id})' if resuming else ''} as job {job_id}",
                  flush=True)
            return _finish(sess, job_id, wait(sess, job_id, args.timeout, args.poll), args.out)
        return 0
    finally:
        sess.close()


if __name__ == "__main__":
    sys.exit(main())
