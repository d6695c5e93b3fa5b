"""What NVFlare 2.9's own tools lack for a fedpartial federation: resuming a job's run, the site check before a
job goes out, and the results / failure summary of a downloaded job. Submitting, following, downloading and
listing jobs are NVFlare's (``nvflare job submit | monitor | wait | download | list``, or ``ProdEnv`` from a
recipe)::

    fedpartial-admin --kit ADMIN_KIT check jobs/fedmlp_ich             # which of the job's sites are connected
    nvflare job submit -j jobs/fedmlp_ich --startup-kit ADMIN_KIT     # prints job_id: <id>
    nvflare job monitor JOB_ID --startup-kit ADMIN_KIT                # follow it
    nvflare job download JOB_ID -o results/ --startup-kit ADMIN_KIT   # -> results/JOB_ID/
    fedpartial-admin results results/JOB_ID                           # DEGRADED / error lines, results table
    fedpartial-admin --kit ADMIN_KIT resume JOB_ID jobs/fedmlp_ich    # continue job JOB_ID's run: the new job id
    fedpartial-admin resume-folder jobs/fedmlp_ich DEST [--job-id ID]  # the folder a resume submits (offline)
    fedpartial-admin without-custom jobs/fedmlp_ich DEST              # a copy without app custom/ code (offline)

A server restart loses a running NVFlare 2.9 job. Every round the server and each site checkpoint what the job
needs under the job's id (``fedpartial.fl.checkpoint``); ``resume JOB_ID FOLDER`` submits the job folder again
with ``resume: "JOB_ID"`` on both sides, so it continues that run at the round after its last checkpoint, with
the method's server and site state, and its results hold the earlier rounds too. The server refuses (the job
stops before training; ``results`` of the downloaded job prints why) a job id without checkpoints, or a folder
whose configuration is not the one that job ran. The stuck old job can be left alone (or removed from the job
store by the operator: ``nvflare`` cannot abort it after a restart).

``ADMIN_KIT`` is the admin user's provisioned folder (the one holding ``startup/fed_admin.json``); the user
name defaults to the folder's name (``admin@coordinator.org``). Exit codes: 0 done (``check``: the job can
start), 1 refused or failed (``check``: too few sites connected for NVFlare to start the job), 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..fl.report import render_tables
from ..fl.simulator import failure_lines  # why a run failed: its logs' error lines (simulator or downloaded)
from ..job_layout import training_entries
from .show_results import degraded_lines, find_results

LOGIN_TRIES = 2


def open_session(kit: str | Path, user: str | None = None, timeout: float = 30.0):
    """A secure FLARE API session for the admin whose startup kit is ``kit`` (user: the kit folder's name).

    NVFlare 2.9's login raises ``TypeError: 'None' is not an instance of 'bytes'`` when the server's answer to its
    identity challenge comes back without the server's certificate (seen on a loaded server) instead of retrying as
    it does for an unreachable server: that login is tried again (``LOGIN_TRIES`` in all), then one line names
    the server's kit."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    kit = Path(kit).expanduser().resolve()
    if not (kit / "startup" / "fed_admin.json").is_file():
        raise FileNotFoundError(f"{kit} is not an admin startup kit (no startup/fed_admin.json)")
    for attempt in range(1, LOGIN_TRIES + 1):
        try:
            return new_secure_session(user or kit.name, str(kit), timeout=timeout)
        except TypeError as e:
            if "is not an instance of 'bytes'" not in str(e):
                raise
            if attempt == LOGIN_TRIES:
                raise ConnectionError(
                    f"the server of {kit / 'startup' / 'fed_admin.json'} answered the login without its certificate "
                    f"{LOGIN_TRIES} times (NVFlare: {e}); is it overloaded or restarting? Try again"
                ) from e
            time.sleep(1.0)


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
    named = sorted(
        {
            s
            for targets in (meta.get("deploy_map") or {}).values()
            for s in targets
            if isinstance(s, str) and not s.startswith("@") and s != "server"
        }
    )
    n, missing = None, 0
    for path in sorted(job_dir.glob("*/config/config_fed_server.json")):
        cfg = json.loads(path.read_text())
        n = cfg.get("min_clients") if isinstance(cfg.get("min_clients"), int) else n
        missing = int(cfg.get("max_missing_sites", missing) or 0)
    return (n if n is not None else meta.get("min_clients")), missing, named


# seconds without a heartbeat before a site counts as down: an NVFlare client sends one every 10 s (its
# heart_beat_interval), so three missed ones
STALE_AFTER = 35.0


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
        lines.append(
            f"warning: {len(connected)} of the job's {count} site(s) are connected "
            f"({', '.join(connected) or 'none'}){which}"
        )
        if count and len(connected) < count - max_missing:
            lines.append(
                f"warning: the job needs at least {count - max_missing} site(s) (max_missing_sites "
                f"{max_missing}): NVFlare keeps it SUBMITTED until enough sites connect"
            )
        else:
            lines.append(
                f"warning: the job starts without them (max_missing_sites {max_missing}); its results "
                "will be marked DEGRADED"
            )
    return lines


def without_custom(job_dir: str | Path, dest: str | Path) -> Path:
    """A copy of the job folder ``job_dir`` at ``dest`` without its apps' ``custom/`` code, for participants that
    installed the package and allow its classes (``fedpartial-allow-list``) instead of accepting custom code."""
    job_dir, dest = Path(job_dir).resolve(), Path(dest)
    if not (job_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{job_dir} is not an NVFlare job folder (no meta.json)")
    if dest.exists():
        raise FileExistsError(f"{dest} exists; choose a new folder")
    shutil.copytree(job_dir, dest, ignore=lambda d, names: ["custom"] if (Path(d) / "config").is_dir() else [])
    return dest


def summary_text(path: str | Path) -> tuple[str, bool]:
    """What ``results`` prints for a downloaded job: its error lines (``error: ...``, when the job failed or a
    site's task did), the reasons it is degraded and its results table; and whether a ``results.json`` was
    found."""
    errors = "".join(f"error: {line}\n" for line in failure_lines(path))
    try:
        return errors + results_text(path), True
    except FileNotFoundError as e:
        return errors + f"no results table: {e}", False


# ------------------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fedpartial-admin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--kit", help="the admin's startup kit folder (holds startup/fed_admin.json)")
    ap.add_argument("--user", help="admin user name (default: the kit folder's name)")
    ap.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for the server")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sites_help = "comma-separated names of the job's sites, to name those not connected (default: meta.json's)"
    p = sub.add_parser("check", help="which of a job folder's sites are connected, and whether NVFlare will start it")
    p.add_argument("job")
    p.add_argument("--sites", help=sites_help)
    p = sub.add_parser("results", help="a downloaded job's error lines, DEGRADED reasons and results table (offline)")
    p.add_argument("path")
    p = sub.add_parser(
        "resume",
        help="submit the job folder again continuing job JOB_ID's run from its last checkpoint; prints the new job id",
    )
    p.add_argument("job_id", help="the job whose run to continue (its checkpoints are kept under its id)")
    p.add_argument("job")
    p.add_argument("--sites", help=sites_help)
    p.add_argument("--without-custom", action="store_true", help="leave the apps' custom/ code out (non-BYOC)")
    p = sub.add_parser("resume-folder", help="write the job folder with resume on (offline, e.g. for the simulator)")
    p.add_argument("job")
    p.add_argument("dest")
    p.add_argument(
        "--job-id", default=True, help="the job whose run to continue (default: the same job id, as in the simulator)"
    )
    p = sub.add_parser("without-custom", help="write a copy of a job folder without its apps' custom/ code (offline)")
    p.add_argument("job")
    p.add_argument("dest")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in ("check", "resume") and not args.kit:
        print("fedpartial-admin: --kit ADMIN_STARTUP_KIT is required for this command", file=sys.stderr)
        return 2
    try:
        if args.cmd == "results":
            text, found = summary_text(args.path)
            print(text)
            return 0 if found else 1
        if args.cmd == "resume-folder":
            print(resume_folder(args.job, args.dest, args.job_id))
            return 0
        if args.cmd == "without-custom":
            print(without_custom(args.job, args.dest))
            return 0
        return _online(args)
    except Exception as e:  # noqa: BLE001 - FLARE API errors (refused, not authorized, no server) end here
        print(f"fedpartial-admin: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _check(sess, job: str, sites: str | None) -> bool:
    """Print the site check's lines; False when NVFlare would keep the job waiting (too few sites connected)."""
    try:
        lines = site_check(job, connected_sites(sess), sites.split(",") if sites else None)
    except Exception as e:  # noqa: BLE001 - e.g. a user who may not list the sites: the submit decides
        lines = [f"warning: could not check the connected sites ({type(e).__name__}: {e})"]
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return not any("keeps it SUBMITTED" in line for line in lines)


def _online(args) -> int:
    sess = open_session(args.kit, args.user, args.connect_timeout)
    try:
        ready = _check(sess, args.job, args.sites)
        if args.cmd == "check":
            print(f"{args.job}: {'can start' if ready else 'waits (too few sites connected)'}")
            return 0 if ready else 1
        with tempfile.TemporaryDirectory() as tmp:
            folder = resume_folder(args.job, Path(tmp) / Path(args.job).name, args.job_id)
            if args.without_custom:
                folder = without_custom(folder, Path(tmp) / "without_custom" / folder.name)
            job_id = sess.submit_job(str(folder))
        kit = Path(args.kit)
        print(
            f"submitted {args.job} (resuming job {args.job_id}) as job {job_id}\n"
            f"follow:   nvflare job monitor {job_id} --startup-kit {kit}\n"
            f"download: nvflare job download {job_id} -o results/ --startup-kit {kit}\n"
            f"results:  fedpartial-admin results results/{job_id}",
            flush=True,
        )
        return 0
    finally:
        sess.close()


if __name__ == "__main__":
    sys.exit(main())
