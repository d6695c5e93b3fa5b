"""Export every job folder from its ``jobs/<name>/job.py`` (the job's one source: an NVFlare recipe).

``fedpartial-build-jobs`` (``make jobs``) writes, for each ``jobs/<name>/job.py``, the NVFlare job folder next to
it: ``meta.json``, ``app/config/config_fed_{server,client}.json`` and ``app/custom/fedpartial`` (NVFlare only
loads code shipped inside each app's ``custom/`` folder; no symlinks: they are dropped when a job is zipped for
submission). These are build outputs (git-ignored); never edit them: edit ``job.py`` and run ``make jobs``.
``fedpartial-build-jobs --check`` exits non-zero when an exported folder is missing or differs from what its
``job.py`` exports now (configuration or package copy).
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

from ..data.presets import deep_merge

PACKAGE = "fedpartial"
REPO = Path(__file__).resolve().parents[3]
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


JOB_FILES = ("meta.json", "app/config/config_fed_server.json", "app/config/config_fed_client.json")


def job_dirs(jobs_root: Path) -> list[Path]:
    """The exported job folders (those with a ``meta.json``)."""
    return sorted(p.parent for p in jobs_root.glob("*/meta.json"))


def job_sources(jobs_root: Path) -> list[Path]:
    """The job folders with a ``job.py``."""
    return sorted(p.parent for p in jobs_root.glob("*/job.py"))


STATS_RECIPE = "DataStatsRecipe"  # the statistics jobs' recipe (fedpartial.stats_recipe): it trains nothing


def is_training_job(job: Path) -> bool:
    """Whether ``<job>/job.py`` builds a training recipe (a ``PartialLabelRecipe``: data check, rounds, final
    evaluation) rather than a statistics job (``DataStatsRecipe``: NVFlare's statistics workflow). Both export and
    check the same way; only training jobs have a method, rounds and a model (what ``customise_job`` edits)."""
    return STATS_RECIPE not in (job / "job.py").read_text()


def training_jobs(jobs_root: Path) -> list[Path]:
    """The job folders whose ``job.py`` builds a training recipe."""
    return [j for j in job_sources(jobs_root) if is_training_job(j)]


def load_job_module(job: Path):
    """Import ``<job>/job.py`` (without running it) as a module."""
    spec = importlib.util.spec_from_file_location(f"fedpartial_job_{job.name}", job / "job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_recipe(job: Path, **overrides):
    """The recipe of ``<job>/job.py`` (its ``recipe(**overrides)``); its name must be the folder's."""
    recipe = load_job_module(job).recipe(**overrides)
    if recipe.name != job.name:
        raise ValueError(f"{job / 'job.py'}: the recipe is named {recipe.name!r}, its folder {job.name!r}")
    return recipe


def export_job(job: Path, dest_root: Path | None = None, **overrides) -> Path:
    """Export ``<job>/job.py`` into ``<dest_root or job's parent>/<name>/`` (only ``meta.json`` and the apps are
    replaced there)."""
    return job_recipe(job, **overrides).export(str(dest_root or job.parent))


def config_differences(job: Path, fresh: Path) -> list[str]:
    """How the exported folder ``job`` differs from a fresh export ``fresh`` of its ``job.py``."""
    out = []
    for f in JOB_FILES:
        a, b = job / f, fresh / f
        if not a.is_file():
            out.append(f"{a} missing")
        elif json.loads(a.read_text()) != json.loads(b.read_text()):
            out.append(f"{a} differs from what {job / 'job.py'} exports")
    extra = {p.name for p in job.glob("app*")} - {p.name for p in fresh.glob("app*")}
    return out + [f"{job / e} extra (not exported by job.py)" for e in sorted(extra)]


def check_job(job: Path, src: Path) -> list[str]:
    """Problems of one exported job folder: configuration or package copy out of date with ``job.py``."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = export_job(job, Path(tmp))
        problems = config_differences(job, fresh)
    if (job / "meta.json").is_file():
        problems += build_job(job, src, check=True)
    return problems


def app_dirs(job: Path) -> list[Path]:
    meta = json.loads((job / "meta.json").read_text())
    return [job / app for app in meta.get("deploy_map", {"app": []})]


def _tree(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }


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


def customise_job(
    job: Path,
    dest: Path,
    num_rounds: int | None = None,
    executor_args: dict | None = None,
    src: Path | None = None,
    seed: int | None = None,
    rule_args: dict | None = None,
    min_clients: int | None = None,
) -> Path:
    """Copy a job folder to ``dest`` with the package built into it, ``num_rounds`` (and ``min_clients``, in the
    server config and ``meta.json``) set, ``executor_args`` merged into the client executor's args, ``rule_args``
    into the server rule's options and ``seed`` set for both the sites (executor seed) and the initial global
    model (for tests and benchmarks). The job stays one spec: ``method`` / ``method_args`` in ``executor_args``
    go to the server's aggregator too, and ``model`` options to the server's model component."""
    shutil.copytree(job, dest, ignore=shutil.ignore_patterns("custom", "job.py", "README.md", "__pycache__"))
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
        comps["aggregator"]["args"]["method_args"] = deep_merge(
            comps["aggregator"]["args"].get("method_args", {}), rule_args
        )
    if "method" in executor_args:
        cfg["method"] = comps["aggregator"]["args"]["method"] = executor_args["method"]
    if "model" in executor_args:
        comps["model"]["args"] = deep_merge(comps["model"]["args"], executor_args["model"])
    if min_clients is not None:  # meta.json: the sites that must stay connected
        cfg["min_clients"] = min_clients
        cfg["max_missing_sites"] = min(int(cfg.get("max_missing_sites", 0)), min_clients - 1)
        meta = json.loads((dest / "meta.json").read_text())
        meta["min_clients"] = min_clients - cfg["max_missing_sites"]
        (dest / "meta.json").write_text(json.dumps(meta, indent=1))
    server.write_text(json.dumps(cfg, indent=1))
    client = dest / "app/config/config_fed_client.json"
    ccfg = json.loads(client.read_text())
    executor = ccfg["executors"][0]["executor"]
    executor["args"] = deep_merge(executor["args"], executor_args or {})
    client.write_text(json.dumps(ccfg, indent=1))
    return dest


def build(repo: Path = REPO, check: bool = False, names: list[str] | None = None) -> list[str]:
    """Export (or, with ``check``, compare) every job of ``repo/jobs`` that has a ``job.py``; the problems found."""
    src = repo / "custom" / PACKAGE
    jobs = [j for j in job_sources(repo / "jobs") if not names or j.name in names]
    if check:
        return [p for job in jobs for p in check_job(job, src)]
    for job in jobs:
        export_job(job)
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO, help="project root (default: this checkout)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="only verify that every exported folder matches its job.py (configuration and package)",
    )
    ap.add_argument("jobs", nargs="*", help="job names (default: every jobs/*/job.py)")
    args = ap.parse_args(argv)
    problems = build(args.repo, check=args.check, names=args.jobs)
    if problems:
        print("exported job folders out of date (run `make jobs`):\n  " + "\n  ".join(problems[:20]), file=sys.stderr)
        return 1
    jobs = [j for j in job_sources(args.repo / "jobs") if not args.jobs or j.name in args.jobs]
    print(f"{'checked' if args.check else 'exported'} {len(jobs)} job(s): {', '.join(j.name for j in jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
