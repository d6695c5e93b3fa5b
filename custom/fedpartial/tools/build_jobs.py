"""Build every job's ``<app>/custom/`` from the single source ``custom/fedpartial``.

NVFlare only loads code shipped inside each app's ``custom/`` folder (no symlinks: they are dropped when a
job is zipped for submission), so the package is copied there. The copies are build outputs (git-ignored);
never edit them. ``fedpartial-build-jobs --check`` exits non-zero when a copy is missing or differs.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import sys
from pathlib import Path

PACKAGE = "fedpartial"
REPO = Path(__file__).resolve().parents[3]
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


def job_dirs(jobs_root: Path) -> list[Path]:
    return sorted(p.parent for p in jobs_root.glob("*/meta.json"))


def app_dirs(job: Path) -> list[Path]:
    meta = json.loads((job / "meta.json").read_text())
    return [job / app for app in meta.get("deploy_map", {"app": []})]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


def differences(src: Path, dst: Path) -> list[str]:
    """Files that differ between the source package and a copy (missing, extra or changed)."""
    if not dst.is_dir():
        return [f"{dst} missing"]
    a, b = _tree(src), _tree(dst)
    out = [f"{dst}/{f} missing" for f in sorted(a - b)] + [f"{dst}/{f} extra" for f in sorted(b - a)]
    out += [f"{dst}/{f} differs" for f in sorted(a & b) if not filecmp.cmp(src / f, dst / f, shallow=False)]
    return out


def build_job(job: Path, src: Path, check: bool = False) -> list[str]:
    """Copy the package into every app of one job (or, with ``check``, list how the copies differ)."""
    problems: list[str] = []
    for app in app_dirs(job):
        dst = app / "custom" / PACKAGE
        if check:
            problems += differences(src, dst)
            continue
        if dst.exists():
            shutil.rmtree(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, ignore=IGNORE)
    return problems


def customise_job(job: Path, dest: Path, num_rounds: int | None = None, executor_args: dict | None = None,
                  src: Path | None = None, seed: int | None = None, rule_args: dict | None = None,
                  min_clients: int | None = None) -> Path:
    """Copy a job folder to ``dest`` with the package built into it, ``num_rounds`` (and ``min_clients``, in the
    server config and ``meta.json``) set, ``executor_args`` merged into the client executor's args, ``rule_args``
    into the server rule's options and ``seed`` set for both the sites (executor seed) and the initial global
    model (for tests and benchmarks). The job stays one spec: ``method`` / ``method_args`` in ``executor_args``
    go to the server's aggregator too, and ``model`` options to the server's model component."""
    from ..data.presets import deep_merge

    shutil.copytree(job, dest, ignore=shutil.ignore_patterns("custom"))
    build_job(dest, src or REPO / "custom" / PACKAGE)
    server = dest / "app/config/config_fed_server.json"
    cfg = json.loads(server.read_text())
    if num_rounds is not None:
        cfg["num_rounds"] = num_rounds
    comps = {c["id"]: c for c in cfg["components"]}
    if seed is not None:
        comps["model"]["args"]["init_seed"] = int(seed)
        executor_args = {**(executor_args or {}), "seed": int(seed)}
    executor_args = dict(executor_args or {})
    rule_args = deep_merge(executor_args.get("method_args", {}), rule_args or {})
    if rule_args:
        executor_args["method_args"] = rule_args
        comps["aggregator"]["args"]["method_args"] = deep_merge(comps["aggregator"]["args"].get("method_args", {}),
                                                                rule_args)
    if "method" in executor_args:
        cfg["method"] = comps["aggregator"]["args"]["method"] = executor_args["method"]
    if "model" in executor_args:
        comps["model"]["args"] = deep_merge(comps["model"]["args"], executor_args["model"])
    if min_clients is not None:
        cfg["min_clients"] = min_clients
        meta = json.loads((dest / "meta.json").read_text())
        (dest / "meta.json").write_text(json.dumps({**meta, "min_clients": min_clients}, indent=1))
    server.write_text(json.dumps(cfg, indent=1))
    client = dest / "app/config/config_fed_client.json"
    ccfg = json.loads(client.read_text())
    executor = ccfg["executors"][0]["executor"]
    executor["args"] = deep_merge(executor["args"], executor_args or {})
    client.write_text(json.dumps(ccfg, indent=1))
    return dest


def build(repo: Path = REPO, check: bool = False) -> list[str]:
    src = repo / "custom" / PACKAGE
    return [p for job in job_dirs(repo / "jobs") for p in build_job(job, src, check)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO, help="project root (default: this checkout)")
    ap.add_argument("--check", action="store_true", help="only verify the copies match custom/")
    args = ap.parse_args(argv)
    problems = build(args.repo, check=args.check)
    if problems:
        print("job copies out of date (run `make jobs`):\n  " + "\n  ".join(problems[:20]), file=sys.stderr)
        return 1
    jobs = job_dirs(args.repo / "jobs")
    print(f"{'checked' if args.check else 'built'} custom/ for {len(jobs)} job(s): {', '.join(j.name for j in jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
