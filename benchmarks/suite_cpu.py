"""Where a command's CPU goes, by kind of process: every process on the machine sampled while it runs.

    CI=true python benchmarks/suite_cpu.py --out benchmarks/results/suite_cpu            # make test
    python benchmarks/suite_cpu.py --out /tmp/demo -- python jobs/fedmlp_ich/job.py      # any command

The command (default ``make test``) runs in the checkout root. Every ``--interval`` seconds (default 1) each
process of the machine is read (``psutil``: command line, user + system CPU); a process is counted from its first
sample to its last, so one that lives less than an interval is missed, and what it used falls into the ``not
sampled`` line with the kernel's own threads and anything else the machine ran. The kinds are recognised from the
command lines (:data:`KINDS`, first match wins; a forked process names itself with ``setproctitle``). The machine
line is ``/proc/stat`` between the start and the end (user + nice + system + irq + softirq + steal, as ``make
test``'s ``--cpu-report`` reads it), and the steal (CPU time the hypervisor gave to other guests while this one
wanted it) is shown apart: a machine that is slow for its CPU-s is often one whose host is busy.

Writes ``OUT.json`` and ``OUT.md`` with ``--out``; prints the table either way. Sampling costs about 1 % of a core
(the sampler's own CPU is a line of its own).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

KINDS: list[tuple[str, str]] = [
    ("deployed hospital job process", r"nvflare\.private\.fed\.app\.client\.worker_process"),
    ("deployed server job process", r"nvflare\.private\.fed\.app\.server\.runner_process"),
    ("deployed server / hospital parent", r"nvflare\.private\.fed\.app\.(client\.client_train|server\.server_train)"),
    ("fork server of a test worker", r"-m fedpartial\.processes "),  # its preloads name the site worker's module
    ("simulated site worker", r"-m nvflare\.private\.fed\.app\.simulator\.simulator_worker"),
    ("simulator launcher, fork server and server process", r"-m fedpartial\.fl\.simulator|nvflare simulator"),
    ("pytest worker", r"exec\(eval\(sys\.stdin|pytest-xdist"),
    ("multiprocessing fork server / resource tracker", r"from multiprocessing\."),
    ("pytest", r"-m pytest( |$)"),
    ("NVFlare command line", r"nvflare\.cli|/nvflare( |$)"),
    ("admin script", r"fedpartial_admin|fedpartial-admin"),
    ("job.py", r"job\.py"),
    ("recipe in SimEnv", r"SupervisedSimEnv|job_recipe"),
    ("exported MONAI bundle", r"monai\.bundle|importlib\.abc, runpy"),
    ("prepare", r"fedpartial[.-]prepare|data\.prepare"),
    ("image store", r"fedpartial[.-]store|data\.store"),
    ("predict / evaluate", r"fedpartial[.-](predict|evaluate)|tools\.predict"),
    ("export", r"fedpartial[.-]export|tools\.export"),
    ("build jobs", r"build[_-]jobs"),
    ("pip / ruff / make", r"\bpip\b|ruff|^make\b|/make\b"),
]


def kind_of(cmdline: str) -> str:
    """The kind of a process from its command line (``other python`` / ``other`` when no rule matches). Rules
    match what a process runs, not the paths it is given (a test's folders are under ``/tmp/pytest-of-...``)."""
    for name, pattern in KINDS:
        if re.search(pattern, cmdline):
            return name
    return "other python" if "python" in cmdline else "other"


def machine_ticks() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the machine since boot, from ``/proc/stat``."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:3]) + sum(fields[5:8])) / hz, fields[7] / hz


def sample(seen: dict, skip: set[int]) -> None:
    """Read every process once into ``seen`` ((pid, start time) -> record)."""
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "cpu_times", "name"]):
        info = p.info
        if info["pid"] in skip or info["cpu_times"] is None or not info["cmdline"]:
            continue  # kernel threads have no command line: they stay in the machine's remainder
        key = (info["pid"], info["create_time"])
        cpu = info["cpu_times"].user + info["cpu_times"].system
        rec = seen.get(key)
        if rec is None:
            seen[key] = rec = {"cpu0": cpu, "cmd": " ".join(info["cmdline"])[:300]}
        rec["cpu"] = cpu
        rec["cmd"] = " ".join(info["cmdline"])[:300]  # a forked process retitles itself after it starts


def measure(cmd: list[str], interval: float, cwd: Path = REPO, processes: list | None = None) -> dict:
    """Run ``cmd``, sampling the machine; the summary (per kind: processes, CPU-s) and the command's status.
    ``processes``: a list that receives each counted process (kind, command line, CPU-s)."""
    seen: dict = {}
    busy0, steal0 = machine_ticks()
    self_cpu0 = sum(os.times()[:2])
    t0 = time.monotonic()
    sample(seen, {os.getpid()})
    before = set(seen)
    proc = subprocess.Popen(cmd, cwd=cwd, start_new_session=True)
    try:
        while proc.poll() is None:
            sample(seen, {os.getpid()})
            time.sleep(interval)
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait()
    sample(seen, {os.getpid()})
    wall = time.monotonic() - t0
    busy1, steal1 = machine_ticks()
    kinds: dict[str, dict] = {}
    for key, rec in seen.items():
        used = rec["cpu"] - (rec["cpu0"] if key in before else 0.0)
        if used <= 0:
            continue
        kind = kind_of(rec["cmd"])
        if processes is not None:
            processes.append({"kind": kind, "cmd": rec["cmd"], "cpu_s": round(used, 2)})
        k = kinds.setdefault(kind, {"processes": 0, "cpu_s": 0.0})
        k["processes"] += 1
        k["cpu_s"] += used
    sampler = sum(os.times()[:2]) - self_cpu0
    kinds["this sampler"] = {"processes": 1, "cpu_s": sampler}
    sampled = sum(k["cpu_s"] for k in kinds.values())
    machine = busy1 - busy0
    return {
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "date": dt.date.today().isoformat(),
        "cores": os.cpu_count(),
        "wall_s": round(wall, 1),
        "machine_cpu_s": round(machine, 1),
        "steal_s": round(steal1 - steal0, 1),
        "busy_fraction": round(machine / (wall * (os.cpu_count() or 1)), 3),
        "not_sampled_cpu_s": round(machine - sampled, 1),
        "kinds": {
            name: {"processes": v["processes"], "cpu_s": round(v["cpu_s"], 1)}
            for name, v in sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])
        },
    }


def table(summary: dict) -> str:
    m = summary["machine_cpu_s"] or 1.0
    lines = [
        f"`{summary['command']}` (exit status {summary['returncode']}), {summary['date']}, {summary['cores']} cores: "
        f"{summary['machine_cpu_s']:,.0f} CPU-s in {summary['wall_s']:,.0f} s ({100 * summary['busy_fraction']:.0f} % "
        f"busy), of which steal {summary['steal_s']:,.1f} s",
        "",
        "| kind | processes | CPU-s | per process | share of the machine |",
        "|---|---|---|---|---|",
    ]
    for name, v in summary["kinds"].items():
        per = v["cpu_s"] / max(v["processes"], 1)
        lines.append(f"| {name} | {v['processes']} | {v['cpu_s']:.1f} | {per:.2f} | {100 * v['cpu_s'] / m:.1f} % |")
    rest = summary["not_sampled_cpu_s"]
    lines.append(f"| not sampled (kernel, processes shorter than a sample) | | {rest:.1f} | | {100 * rest / m:.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples (1)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--processes", default=None, help="write every counted process to this JSON-lines file")
    ap.add_argument("command", nargs="*", help="the command (after --; default: make test)")
    a = ap.parse_args(argv)
    procs: list = []
    summary = measure(a.command or ["make", "test"], a.interval, processes=procs)
    if a.processes:
        Path(a.processes).write_text("".join(json.dumps(p) + "\n" for p in procs))
    text = table(summary)
    print(text)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
        out.with_suffix(".md").write_text(text + "\n")
    return summary["returncode"]


if __name__ == "__main__":
    sys.exit(main())
