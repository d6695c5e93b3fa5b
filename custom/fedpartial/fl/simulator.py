"""NVFlare's simulator, supervised: it stops with its command, never outlives it, and never waits for a dead site.

NVFlare 2.9's simulator (``python -m nvflare.private.fed.app.simulator.simulator``, what ``SimEnv`` and ``nvflare
simulator`` run) has three weak spots on a shared machine, each handled here without changing what it runs:

- **Ports.** It picks each site worker's port (and the server's) with ``get_open_ports``: a port the kernel hands
  out, closed again, then bound seconds later by the worker. Any connection made meanwhile on the machine (another
  simulator's, its own) can take that port as its ephemeral port, and the worker dies at start with ``[Errno 98]
  Address already in use``. :func:`reserve_ports` hands out ports *below* the kernel's ephemeral range (which no
  outgoing connection ever takes), reserved across processes in a locked file until they are bound, so two runs on
  one machine never pick the same port.
- **A site that never comes up.** The simulator waits 60 s for a site worker to connect, then ends that site's
  thread and lets the server wait for the site until its task times out (900 s at the data check), with nothing on
  the terminal. Here a worker that exits before connecting fails the run at once (exit status 2) with one line
  naming the site and the cause from its log or its exit status (:data:`FAILURE_FILE` in the workspace).
- **Start-up cost.** Each site worker is a fresh interpreter that imports torch, TorchDynamo and NVFlare (about
  6 CPU-seconds, most of what a small site does). The launcher imports them once (:data:`PRELOAD`) and the site
  workers are forked from it (:class:`fedpartial.processes.ForkServer`): the same command line, environment,
  ``PYTHONPATH`` (the job's custom code) and session as NVFlare's ``subprocess.Popen`` would give them.
  ``FEDPARTIAL_SIM_FORK=0`` starts them as fresh processes, as does a CUDA build of torch or ``-gpu``.
- **Orphans.** The simulator runs in a session of its own (a terminal's Ctrl-C never reaches it) and outlives the
  command that started it. :func:`run` (the launcher, ``python -m fedpartial.fl.simulator``) dies with its parent
  (``PR_SET_PDEATHSIG``), so do its server process and its ``Manager``; on SIGTERM / SIGINT it stops every process
  under it; the site workers follow their server process within a second (NVFlare's own parent check).

:class:`SupervisedSimEnv` is ``SimEnv`` running that launcher: ``job.py``'s Ctrl-C / SIGTERM stops everything the
run started within seconds (exit status 130 / 143, :class:`Stopped`); a failed run raises :class:`RunFailed` with
the cause lines. The patched names are NVFlare's; :func:`check_nvflare` fails (and ``tests/test_simulator.py``
with it) when an NVFlare release moves them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from nvflare.recipe.sim_env import SimEnv

from ..processes import ForkedProcess, ForkServer, die_with_parent, stop_tree

PORTS_ENV = (
    "FEDPARTIAL_SIM_PORTS"  # "LO-HI": the ports simulator runs may listen on (default: below the ephemeral range)
)
PORT_HOLD_S = 180.0  # a reservation outlives the worker's start (NVFlare gives it 60 s to connect)
FAILURE_FILE = "simulator_failure.txt"  # in the workspace: the line a failed start left
SIMULATOR = "nvflare.private.fed.app.simulator.simulator"
WORKER = "nvflare.private.fed.app.simulator.simulator_worker"  # the module NVFlare runs for each site
FORK_ENV = "FEDPARTIAL_SIM_FORK"  # "0": site workers start as fresh processes (NVFlare's own way)
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "numpy", "PIL.Image", "psutil", "tqdm", "yaml", WORKER)
"""What a site worker imports before it trains: imported once by the launcher, which its server process and the
site workers are forked from."""
# NVFlare 2.9 names this module patches (module, attribute): checked by check_nvflare
PATCHED = (
    ("nvflare.private.fed.app.simulator.simulator_runner", "get_open_ports"),
    ("nvflare.private.fed.app.deployer.simulator_deployer", "get_open_ports"),
    ("nvflare.private.fed.app.simulator.simulator_runner", "Manager"),
    ("nvflare.private.fed.app.simulator.simulator_runner", "SimulatorRunner.run_process"),
    ("nvflare.private.fed.app.simulator.simulator_runner", "SimulatorClientRunner.do_one_task"),
    ("nvflare.private.fed.app.simulator.simulator_runner", "SimulatorClientRunner._create_connection"),
    ("nvflare.private.fed.app.simulator.simulator_runner", "subprocess"),
    ("nvflare.private.fed.app.simulator.simulator", "define_simulator_parser"),
    ("nvflare.private.fed.app.simulator.simulator", "run_simulator"),
)


# ---------------------------------------------------------------------------------------------------- ports


def port_range() -> range:
    """The ports simulator runs listen on: ``$FEDPARTIAL_SIM_PORTS`` (``LO-HI``), else the 6,000 ports below the
    kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``; 32768 where it cannot be read)."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if text:
        lo, _, hi = text.partition("-")
        try:
            lo, hi = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"{PORTS_ENV}={text!r}: expected LO-HI, e.g. 20000-26000") from None
        if not 1024 < lo <= hi < 65536:
            raise ValueError(f"{PORTS_ENV}={text!r}: expected 1024 < LO <= HI < 65536")
        return range(lo, hi + 1)
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1025, low - 6000), low)


def _bindable(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _ledger() -> Path:
    folder = Path(tempfile.gettempdir()) / f"fedpartial-ports-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / "reserved.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reserve_ports(number: int) -> list[int]:
    """``number`` ports no other simulator run on this machine holds or has been handed in the last
    :data:`PORT_HOLD_S` seconds, each bindable now, from :func:`port_range` (outside the kernel's ephemeral range).
    The reservation is a JSON ledger under the temporary folder, read and written under an exclusive ``flock``;
    a reservation of a process that is gone is dropped."""
    ports = port_range()
    path = _ledger()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            held = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            held = {}
        now = time.time()
        held = {p: v for p, v in held.items() if now - v[1] < PORT_HOLD_S and _alive(int(v[0]))}
        out: list[int] = []
        start = random.randrange(len(ports))
        for i in range(len(ports)):
            port = ports[(start + i) % len(ports)]
            if str(port) in held or not _bindable(port):
                continue
            out.append(port)
            held[str(port)] = [os.getpid(), now]
            if len(out) == number:
                break
        if len(out) < number:
            raise RuntimeError(
                f"no free port for the simulator in {ports.start}-{ports.stop - 1} ({PORTS_ENV} sets the range)"
            )
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(held))
        os.replace(tmp, path)
    return out


# ------------------------------------------------------------------------------------------- failed starts


def site_log(workspace: str | os.PathLike, site: str) -> str:
    """``; see <its log>`` where the site wrote one, else nothing."""
    log = Path(workspace) / site / "log.txt"
    return f"; see {log}" if log.is_file() else ""


def site_cause(workspace: str | os.PathLike, site: str, exit_code: int | None) -> str:
    """Why a site worker died before it connected: the last error line of its log, else its exit status."""
    folder = Path(workspace) / site
    for name in ("error_log.txt", "log.txt"):
        for log in sorted(folder.rglob(name)):
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            errors = [ln for ln in lines if " ERROR " in ln or "Error" in ln or "Exception" in ln]
            if errors:
                return errors[-1].split(" - ", 3)[-1].strip()
    return f"exit status {exit_code}" if exit_code is not None else "no process"


class _RecordingSubprocess:
    """``subprocess`` as the simulator's client runner sees it: ``Popen`` also records each site worker by the port
    it is told to listen on, so the runner can tell a worker that died from one still starting; with a
    :class:`ForkServer`, a site worker is forked from it (a fresh process where that fails)."""

    def __init__(self, forks: ForkServer | None = None):
        self.workers: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.forks = forks

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, args, *a, **kw):  # noqa: N802 - subprocess's name
        proc = None
        if (
            self.forks is not None
            and not a
            and _is_worker(args)
            and set(kw) <= {"env", "cwd", "preexec_fn", "shell"}
            and not kw.get("shell")
        ):
            try:
                proc = self.forks.popen(
                    list(args), env=kw.get("env"), cwd=kw.get("cwd"), setsid=kw.get("preexec_fn") is os.setsid
                )
            except OSError:
                proc = None
        if proc is None:
            proc = subprocess.Popen(args, *a, **kw)
        if isinstance(args, (list, tuple)) and "--port" in args:
            self.workers[str(args[list(args).index("--port") + 1])] = proc
        return proc


def _is_worker(args) -> bool:
    """``args`` is ``[this python, "-m", WORKER, ...]``."""
    return isinstance(args, (list, tuple)) and list(args[:3]) == [sys.executable, "-m", WORKER]


def fail_run(workspace: str, line: str) -> None:
    """End the simulator's server process at once with exit status 2, leaving ``line`` in :data:`FAILURE_FILE`."""
    import logging

    logging.getLogger("fedpartial.simulator").error(line)
    with contextlib.suppress(OSError):
        (Path(workspace) / FAILURE_FILE).write_text(line + "\n")
    os._exit(2)


# -------------------------------------------------------------------------------------------------- launcher


def check_nvflare() -> None:
    """Every NVFlare name this module patches exists (an NVFlare release that moved one fails here, loudly)."""
    import importlib

    for module, attr in PATCHED:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise RuntimeError(f"NVFlare {module}.{attr} is gone: fedpartial.fl.simulator needs updating")
            obj = getattr(obj, part)


def _patch(workspace: str, forks: ForkServer | None = None) -> None:
    from multiprocessing.managers import SyncManager

    from nvflare.private.fed.app.deployer import simulator_deployer
    from nvflare.private.fed.app.simulator import simulator_runner as sr

    check_nvflare()
    sr.get_open_ports = simulator_deployer.get_open_ports = reserve_ports

    def manager():  # the simulator's Manager process dies with the launcher
        m = SyncManager()
        m.start(initializer=die_with_parent, initargs=(signal.SIGKILL, os.getpid()))
        return m

    sr.Manager = manager
    run_process = sr.SimulatorRunner.run_process
    launcher = os.getpid()

    def guarded_run_process(self, return_dict):
        die_with_parent(signal.SIGKILL, launcher)
        return run_process(self, return_dict)

    sr.SimulatorRunner.run_process = guarded_run_process
    current = threading.local()
    do_one_task = sr.SimulatorClientRunner.do_one_task

    def named_task(self, client, *args, **kwargs):
        current.site = client.client_name
        return do_one_task(self, client, *args, **kwargs)

    sr.SimulatorClientRunner.do_one_task = named_task
    recorder = sr.subprocess = _RecordingSubprocess(forks)

    def connect(self, open_port, timeout=60.0):
        from multiprocessing.connection import Client

        start = time.time()
        site = getattr(current, "site", "?")
        while True:
            try:
                return Client(("localhost", open_port))
            except OSError:
                pass
            proc = recorder.workers.get(str(open_port))
            code = None if proc is None else proc.poll()
            if code is not None:
                fail_run(
                    workspace,
                    f"SITE FAILED TO START: {site}: its simulator worker exited before it "
                    f"connected ({site_cause(workspace, site, code)}){site_log(workspace, site)}",
                )
            if time.time() - start > timeout:
                fail_run(
                    workspace,
                    f"SITE FAILED TO START: {site}: its simulator worker did not connect within "
                    f"{time.time() - start:.0f} s{site_log(workspace, site)}",
                )
            time.sleep(0.25)

    sr.SimulatorClientRunner._create_connection = connect


def run(argv: list[str] | None = None) -> int:
    """The launcher: NVFlare's simulator (its own arguments: ``JOB -w WS -n N -t T [-gpu G]``) with the ports,
    failed starts and process lifetime handled as the module docstring says. ``--parent PID``: die with it."""
    import argparse

    from nvflare.private.fed.app.simulator import simulator as nv

    parser = argparse.ArgumentParser(
        prog="python -m fedpartial.fl.simulator",
        description="NVFlare's simulator, supervised (fedpartial.fl.simulator)",
    )
    nv.define_simulator_parser(parser)
    parser.add_argument("--parent", type=int, default=None, help="stop when this process is gone")
    args = parser.parse_args(argv)
    if args.parent:
        die_with_parent(signal.SIGTERM, args.parent)
    stopping = []

    def stop(signum, _frame):
        if not stopping:
            stopping.append(signum)
            stop_tree(grace=2.0)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)
    workspace = os.path.abspath(args.workspace or "/tmp/nvflare/simulation")
    os.makedirs(workspace, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(workspace, FAILURE_FILE))
    forks = None if os.environ.get(FORK_ENV, "1") == "0" or args.gpu else ForkServer.start(PRELOAD)
    _patch(workspace, forks)
    args.workspace = workspace
    try:
        status = nv.run_simulator(args)
    finally:
        if forks is not None:
            forks.stop()
    failure = Path(workspace) / FAILURE_FILE
    if failure.is_file():
        sys.stderr.write(failure.read_text())
        return 2
    return int(status or 0) if isinstance(status, int) and 0 <= status < 256 else (0 if not status else 2)


# ------------------------------------------------------------------------------------------------- SimEnv


class Stopped(Exception):
    """The run was stopped by a signal (``signum``); everything it started is gone."""

    def __init__(self, signum: int, stopped: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum, self.stopped = signum, stopped


class RunFailed(Exception):
    """The simulator ended with a non-zero status; ``lines``: the cause, from its logs."""

    def __init__(self, status: int, workspace: str, lines: list[str]):
        super().__init__(f"the simulator ended with status {status}")
        self.status, self.workspace, self.lines = status, workspace, lines


FAILURE_KEYS = ("SITE FAILED TO START", "DATA CHECK FAILED", "failed task", "system_panic", "panic", "resume: ")


def failure_lines(path: str | os.PathLike, limit: int = 5) -> list[str]:
    """Why a simulator run or a downloaded job failed: the distinct error lines of its logs, the server's first
    (a site's data-check error names the site, file and line; a site's task failure names the site and task; a
    site that never started names the site)."""
    path = Path(path)
    seen: list[str] = []
    failure = path / FAILURE_FILE
    if failure.is_file():
        seen.append(failure.read_text().strip())
    logs = sorted(path.rglob("log.txt"), key=lambda p: ("server" not in p.parts, str(p)))
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if any(k in line for k in FAILURE_KEYS):
                msg = line.split("] - ", 1)[1] if "] - " in line else line.split(" - ", 3)[-1]
                msg = msg.strip()
                if msg not in seen:
                    seen.append(msg)
    return seen[:limit]


class SupervisedSimEnv(SimEnv):
    """NVFlare's ``SimEnv`` running the job through :func:`run` (``python -m fedpartial.fl.simulator``): the same
    job folder, workspace and arguments as ``SimEnv``; SIGINT / SIGTERM / SIGHUP stop every process the run
    started (raising :class:`Stopped`), and a failed run raises :class:`RunFailed` with its cause lines."""

    def deploy(self, job) -> str:
        job_id = job.name
        workspace = os.path.join(self.workspace_root, job_id)
        self._ensure_default_component_policy(workspace)
        if self.clients:
            clients = list(self.clients)
        elif not job.clients or "@ALL" in job.clients:  # FedJob.simulator_run's naming of the sites
            clients = [f"site-{i}" for i in range(1, self.num_clients + 1)]
        else:
            clients = list(job.clients)
        job.clients = clients
        with tempfile.TemporaryDirectory() as root:
            job.export_job(root)
            cmd = [
                sys.executable,
                "-m",
                __name__,
                os.path.join(root, job_id),
                "-w",
                workspace,
                "-c",
                ",".join(clients),
                "-t",
                str(self.num_threads or len(clients)),
                "--parent",
                str(os.getpid()),
            ]
            if self.gpu_config:
                cmd += ["-gpu", self.gpu_config.replace(" ", "")]
            if self.log_config:
                cmd += ["-l", str(self.log_config)]
            status = supervise(cmd)
        self.last_run_failed = status != 0
        if status:
            raise RunFailed(status, workspace, failure_lines(workspace))
        return job_id


def supervise(cmd: list[str], env: dict | None = None, tick=None, every: float = 30.0, **popen) -> int:
    """Run ``cmd`` (the launcher) in a session of its own and wait for it; SIGINT / SIGTERM / SIGHUP meanwhile stop
    it and everything under it within seconds and raise :class:`Stopped`. ``tick()`` is called every ``every``
    seconds while it runs (progress lines). Returns its exit status."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen)
    got: list[int] = []
    running: list[int] = []  # processes of the run when the first signal came
    previous = {}

    def on_signal(signum, _frame):
        import psutil

        if not got:
            with contextlib.suppress(psutil.Error):
                running.append(1 + len(psutil.Process(proc.pid).children(recursive=True)))
        got.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread: no handlers, the caller stops it
            previous[sig] = signal.signal(sig, on_signal)
    last = time.monotonic()
    try:
        while True:
            try:
                status = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if tick is not None and not got and time.monotonic() - last >= every:
                    last = time.monotonic()
                    tick()
                if got:
                    try:
                        status = proc.wait(timeout=8)
                    except subprocess.TimeoutExpired:
                        status = None
                    break
        if got:
            stop_tree(grace=1.0)  # anything the launcher left
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: anything left in it
            raise Stopped(got[0], running[0] if running else 1)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(run())
