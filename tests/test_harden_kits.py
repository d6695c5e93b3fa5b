"""``fedpartial-harden-kits`` on kits ``nvflare provision`` wrote from provisioning/project.yml: the job store and
snapshots move into the server's kit, every file and folder is owner-only, the ``lead`` role loses ``byoc``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def _provision(root):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "nvflare.cli",
            "provision",
            "-p",
            str(REPO / "provisioning" / "project.yml"),
            "-w",
            str(root / "ws"),
        ],
        check=True,
        cwd=root,
        capture_output=True,
        env={**os.environ, "HOME": str(root)},
    )
    return root / "ws" / "fedpartial" / "prod_00"


def test_hardened_kits_keep_their_store_private_and_refuse_code_from_leads(tmp_path):
    prod = _provision(tmp_path)
    server = next(p for p in prod.iterdir() if (p / "startup" / "fed_server.json").is_file())
    before = json.loads((server / "local" / "resources.json.default").read_text())
    assert "/tmp" in json.dumps(before)  # NVFlare's default: a shared temporary folder

    run = lambda: subprocess.run(
        [sys.executable, "-m", "fedpartial.tools.harden_kits", str(prod)], capture_output=True, text=True, cwd=tmp_path
    )
    out = run()
    assert out.returncode == 0, out.stderr
    kits = sorted(p for p in prod.iterdir() if (p / "local").is_dir())
    assert len(out.stdout.splitlines()) == len(kits) >= 4

    resources = json.loads((server / "local" / "resources.json").read_text())
    paths = [c["args"]["storage_path"] for c in resources["components"] if "storage_path" in c.get("args", {})]
    paths += [resources["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"]]
    assert paths and all(p.startswith(str(server.resolve())) for p in paths), paths
    sites = 0
    for kit in kits:
        for root, dirs, files in os.walk(kit):
            for name in dirs + files:
                mode = os.stat(os.path.join(root, name)).st_mode
                assert mode & 0o077 == 0, f"{os.path.join(root, name)} is {oct(mode & 0o777)}"
        if not (kit / "local" / "authorization.json.default").is_file():
            continue  # an admin's kit: no authorisation policy of its own
        authz = json.loads((kit / "local" / "authorization.json").read_text())
        assert authz["permissions"]["lead"]["byoc"] == "none"
        assert authz["permissions"]["project_admin"] == "any"
        sites += 1
    assert sites >= 4  # the server and the three hospitals
    assert run().returncode == 0  # again: nothing breaks

    bad = subprocess.run(
        [sys.executable, "-m", "fedpartial.tools.harden_kits", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no server kit" in bad.stderr
