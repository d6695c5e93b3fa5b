"""Process lifetime: a process that dies with its parent, a tree stopped as a whole, signals turned into a clean stop.

Used by the simulator launcher (:mod:`fedpartial.fl.simulator`), the image store's decoding pool and the command
lines (``fedpartial-prepare``, ``fedpartial-store``, ``benchmarks/run_jobs.py``): Ctrl-C or SIGTERM stops what they
started within seconds, and nothing they started outlives them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP received (``signum``), raised in the main thread like Ctrl-C's ``KeyboardInterrupt``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(e: KeyboardInterrupt) -> int:
    """The shell's status for a command stopped by ``e``: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)


@contextlib.contextmanager
def interruptible():
    """Within the block, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread (as Ctrl-C raises
    ``KeyboardInterrupt``), so ``finally`` blocks and pools' shutdowns run; the previous handlers come back
    after it. Outside the main thread it does nothing."""

    def raise_(signum, _frame):
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):
            previous[sig] = signal.signal(sig, raise_)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux ``PR_SET_PDEATHSIG``; a no-op
    elsewhere). ``parent``: the pid the parent had; gone already (the race before the call) -> the signal now."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def pool_worker_init() -> None:
    """A process pool's ``initializer``: the worker leaves Ctrl-C to the process that started it (which stops
    the pool) and exits as soon as that process is gone, even while it works: with the ``forkserver`` start
    method its parent is the fork server, which lives as long as the workers, and the workers would wait forever
    on a task queue whose other end they hold themselves; so a thread waits on ``multiprocessing``'s sentinel of
    the starting process and ends the worker when it closes."""
    import multiprocessing
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)  # fork / spawn: the parent is the starting process
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_after, args=(parent,), daemon=True, name="exit-with-parent").start()


def _exit_after(parent) -> None:
    parent.join()
    os._exit(1)


def stop_tree(pid: int | None = None, grace: float = 3.0) -> int:
    """Stop every process under ``pid`` (default: this one): SIGTERM, then SIGKILL for what is left after
    ``grace`` seconds, and once more for any process started meanwhile. Returns how many processes it signalled."""
    import psutil

    try:
        root = psutil.Process(pid or os.getpid())
    except psutil.NoSuchProcess:
        return 0
    seen: set[int] = set()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 1.0), (signal.SIGKILL, 1.0)):
        try:
            procs = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        if not procs:
            break
        for p in procs:
            seen.add(p.pid)
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        psutil.wait_procs(procs, timeout=wait)
    return len(seen)


# ------------------------------------------------------------------------------------------------- fork server


class ForkServer:
    """Start ``python -m MODULE ARGS`` commands as forks of one process that has imported ``preload`` already.

    A fresh interpreter that imports torch pays about 6 CPU-seconds before it does anything (torch, TorchDynamo
    when the first optimizer is built, NVFlare); a simulated site is mostly that. :meth:`start` forks the server
    from the calling process (which should be single-threaded and have imported ``preload``: then the fork costs
    nothing); :meth:`popen` asks it, from any process forked from the caller afterwards and from any thread, to
    fork a child that becomes the command, and returns a ``subprocess.Popen`` look-alike (``pid``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``).

    The child is what the fresh interpreter would be, for what a command can tell: the caller's stdin / stdout /
    stderr (passed over the socket), ``env`` as its environment, ``cwd``, ``PYTHONPATH``'s folders at the front of
    ``sys.path`` with any module they provide imported anew (a job's own copy of a package, not the server's),
    ``sitecustomize`` run again, the default signal handlers, ``setsid`` when asked, and its title
    (``/proc/PID/cmdline``, what ``ps`` shows) the command line (with ``setproctitle`` installed). It dies with the
    server, and the server with the process that started it (``PR_SET_PDEATHSIG``).

    Linux only; a CUDA build of torch is never forked from (CUDA does not survive a fork): there, and wherever
    :meth:`start` fails, the caller runs the command as a fresh process."""

    def __init__(self, address: str, pid: int):
        self.address, self.pid = address, pid

    @classmethod
    def start(cls, preload: tuple[str, ...] = ()) -> ForkServer | None:
        """Import ``preload`` here, then fork the server; None where forking is not for this machine."""
        import importlib

        if not sys.platform.startswith("linux"):
            return None
        for name in preload:
            importlib.import_module(name)
        with contextlib.suppress(ImportError):  # set up while the environment is the process's own
            import setproctitle

            setproctitle.getproctitle()
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch.version, "cuda", None):
            return None
        address = _new_address()
        listener = _listen(address)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the server
            try:
                die_with_parent(signal.SIGKILL, parent)
                _serve(listener)
            finally:
                os._exit(0)
        listener.close()
        return cls(address, pid)

    def popen(
        self,
        args: list[str],
        env: dict | None = None,
        cwd: str | None = None,
        setsid: bool = False,
        stdout: int = 1,
        stderr: int = 2,
    ):
        """``subprocess.Popen(args, env=env, cwd=cwd, preexec_fn=os.setsid if setsid else None, stdout=stdout,
        stderr=stderr)`` (file descriptors; stdin is the caller's) for ``args`` = ``[python, "-m", MODULE, ...]``,
        forked from the server. Raises OSError when the server is gone."""
        import json
        import socket

        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.address)
            request = {
                "args": list(args),
                "env": dict(os.environ if env is None else env),
                "cwd": cwd,
                "setsid": setsid,
            }
            socket.send_fds(conn, [json.dumps(request).encode()], [0, stdout, stderr])
            reply = conn.recv(64)
            if not reply.startswith(b"pid "):
                raise OSError(f"the fork server did not start {args[:3]}: {reply!r}")
        except BaseException:
            conn.close()
            raise
        return ForkedProcess(conn, int(reply.split()[1]), list(args))

    @classmethod
    def spawn(cls, preload: tuple[str, ...] = (), timeout: float = 120.0) -> ForkServer:
        """A fork server in a fresh interpreter (``python -m fedpartial.processes``) that imports ``preload``: for a
        caller that is multi-threaded or holds state of its own (a test worker), never forked itself. It dies with
        the caller."""
        import socket
        import subprocess

        address = _new_address()
        name = address[1:]  # the abstract address without its leading NUL (not allowed in an argument)
        proc = subprocess.Popen([sys.executable, "-m", __name__, name, str(os.getpid()), *preload])
        t0 = time.monotonic()
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                try:
                    probe.connect(address)
                    probe.send(b"{}")  # a request without a command: answered with an error, nothing forked
                    break
                except OSError:
                    pass
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                proc.kill()
                raise OSError(f"the fork server did not start (exit status {proc.wait()})")
            time.sleep(0.1)
        server = cls(address, proc.pid)
        server._proc = proc
        return server

    def stop(self) -> None:
        """End the server (its children are signalled by the kernel: ``PR_SET_PDEATHSIG``)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class ForkedProcess:
    """A command :class:`ForkServer` forked: ``subprocess.Popen``'s ``pid``, ``args``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate`` and ``kill`` (its exit status comes over its connection; a server
    gone first reads as killed, -9)."""

    def __init__(self, conn, pid: int, args: list[str]):
        self._conn, self.pid, self.args, self.returncode = conn, pid, args, None
        self.cpu_s = 0.0  # once it ended: its CPU seconds, user + system, its reaped descendants included

    def _read(self, timeout: float | None) -> None:
        import select

        if self.returncode is not None:
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if ready:
            reply = self._conn.recv(64)
            if reply.startswith(b"exit "):
                self.returncode, self.cpu_s = int(reply.split()[1]), float(reply.split()[2])
            else:
                self.returncode = -signal.SIGKILL
            self._conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _new_address() -> str:
    """A fork server's abstract Unix socket address (a leading NUL: nothing on disk), unique to this process."""
    return f"\0fedpartial-fork-{os.getpid()}-{os.urandom(6).hex()}"


def _listen(address: str):
    """The fork server's listening socket on ``address`` (message boundaries kept: one request per message)."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    return listener


def _serve(listener) -> None:
    """The fork server's loop (single-threaded), titled as one: a request forks a child (:func:`_become`), its pid
    goes back on the request's connection, and so does its exit status once it is reaped."""
    import json
    import select
    import socket

    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(f"{setproctitle.getproctitle()} (fork server)")

    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its status goes to
    server = os.getpid()
    while True:
        ready, _, _ = select.select([listener], [], [], 0.2)
        if ready:
            conn, _ = listener.accept()
            fds: list[int] = []
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(data)
                if not isinstance(request, dict) or "args" not in request:
                    raise ValueError("no command")
            except (OSError, ValueError) as e:
                with contextlib.suppress(OSError):
                    conn.send(f"error {e}".encode()[:64])
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in waiting.values():
                    other.close()
                _become(request, fds, conn, server)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(f"pid {pid}".encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    cpu = usage.ru_utime + usage.ru_stime
                    conn.send(f"exit {os.waitstatus_to_exitcode(status)} {cpu:.3f}".encode())
                conn.close()


def _become(request: dict, fds: list[int], conn, server: int) -> None:
    """In a forked child of the server: become ``python -m MODULE ARGS`` as :class:`ForkServer` describes."""
    import importlib
    import runpy
    import traceback

    code = 1
    try:
        conn.close()
        if request.get("setsid"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        die_with_parent(signal.SIGKILL, server)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        old_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ.clear()
        os.environ.update(request["env"])
        new_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        rest = [p for p in sys.path[1:] if p not in old_path]
        sys.path[:] = [os.getcwd(), *new_path, *rest]
        _forget_shadowed(new_path)
        args = request["args"]
        module = args[args.index("-m") + 1]
        sys.argv = ["-m", *args[args.index("-m") + 2 :]]  # as a fresh `python -m` has it while `site` runs
        if "sitecustomize" in sys.modules:  # a fresh interpreter runs it at start
            del sys.modules["sitecustomize"]
        with contextlib.suppress(ImportError):
            importlib.import_module("sitecustomize")
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(" ".join(args))
        # a fresh `python -m MODULE` has imported MODULE's packages, not MODULE itself (it runs as __main__): a
        # preloaded copy left in sys.modules made runpy warn ("found in sys.modules ... prior to execution")
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what a fresh interpreter prints, then its status
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _forget_shadowed(folders: list[str]) -> None:
    """Drop the imported modules (and their submodules) that the first of ``folders`` providing them would provide
    from elsewhere: imported again, they come from there, as in a fresh interpreter with those folders on
    ``PYTHONPATH``. A module already imported from that folder stays."""
    first: dict[str, str] = {}
    for folder in folders:
        with contextlib.suppress(OSError):
            for entry in os.listdir(folder):
                first.setdefault(entry.split(".", 1)[0], os.path.realpath(folder))
    names = set()
    for name, folder in first.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), None)
        if origin is None or not os.path.realpath(origin).startswith(folder + os.sep):
            names.add(name)
    for key in [k for k in sys.modules if k.split(".", 1)[0] in names]:
        del sys.modules[key]


def _main(argv: list[str]) -> None:
    """``python -m fedpartial.processes NAME PARENT_PID [MODULE ...]``: :meth:`ForkServer.spawn`'s server (on the
    abstract address ``\\0NAME``)."""
    import importlib

    address, parent, preload = "\0" + argv[0], int(argv[1]), argv[2:]
    die_with_parent(signal.SIGKILL, parent)
    for name in preload:
        importlib.import_module(name)
    _serve(_listen(address))


if __name__ == "__main__":
    _main(sys.argv[1:])
