"""Let a provisioned server or site run fedpartial jobs that bring NO custom code (the non-BYOC way).

A job without ``<app>/custom/`` is checked against each participant's class allow-list (``class_allow_list`` in
``<kit>/local/resources.json``, else ``resources.json.default``, else NVFlare's built-in list). fedpartial's
classes, and two NVFlare classes its jobs use, are not on the default list. With the package installed at the
participant (``pip install fedpartial-*.whl``), this writes ``<kit>/local/resources.json``: the kit's current
resources plus the ``fedpartial.`` prefix and every other class the given jobs need::

    fedpartial-allow-list /opt/nvflare/hospital-1 [--jobs jobs/fedmlp_ich ...]

Run it on the server's kit and on every site's kit; then submit the folder ``fedpartial-admin without-custom JOB DEST``
writes (``nvflare job submit -j DEST``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .build_jobs import REPO, job_dirs

PACKAGE_PREFIX = "fedpartial."
ALLOW_KEY = "class_allow_list"


def component_paths(job: Path) -> set[str]:
    """Every class path (``"path": ...``) in a job's config files."""
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("path"), str):
                found.add(node["path"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for cfg in Path(job).glob("*/config/*.json"):
        walk(json.loads(cfg.read_text()))
    return found


def allowed(path: str, allow_list: list[str]) -> bool:
    """NVFlare's rule: an exact entry, a prefix ending in '.', or a package prefix."""
    return any(path == p or (path.startswith(p) if p.endswith(".") else path.startswith(p + ".")) for p in allow_list)


def current_resources(kit: Path) -> dict:
    """The kit's resources.json, else resources.json.default (provisioned kits have it), with the default list
    filled in when the file has none."""
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    local = Path(kit) / "local"
    for name in ("resources.json", "resources.json.default"):
        if (local / name).is_file():
            res = json.loads((local / name).read_text())
            break
    else:
        raise FileNotFoundError(f"{local} holds no resources.json(.default): is {kit} a provisioned startup kit?")
    res.setdefault(ALLOW_KEY, list(DEFAULT_CLASS_ALLOW_LIST))
    return res


def allow_jobs(kit: str | Path, jobs: list[Path]) -> list[str]:
    """Add what ``jobs`` need to ``<kit>/local/resources.json``; returns the entries added."""
    kit = Path(kit)
    res = current_resources(kit)
    added = []
    for path in sorted(set().union(*(component_paths(j) for j in jobs))):
        if not allowed(path, res[ALLOW_KEY] + added):
            added.append(PACKAGE_PREFIX if path.startswith(PACKAGE_PREFIX) else path)
    res[ALLOW_KEY] = res[ALLOW_KEY] + added
    (kit / "local" / "resources.json").write_text(json.dumps(res, indent=2) + "\n")
    return added


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fedpartial-allow-list", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("kits", nargs="+", help="startup kit folders (server and / or sites)")
    ap.add_argument("--jobs", nargs="+", type=Path, help="job folders (default: every job of this checkout)")
    args = ap.parse_args(argv)
    jobs = args.jobs or job_dirs(REPO / "jobs")
    for kit in args.kits:
        added = allow_jobs(kit, jobs)
        print(f"{Path(kit) / 'local' / 'resources.json'}: added {added or 'nothing (already allowed)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
