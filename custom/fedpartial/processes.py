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
