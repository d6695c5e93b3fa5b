"""Harden the startup kits ``nvflare provision`` wrote, before they are handed out (provisioning/README.md, 2a).

    fedpartial-harden-kits /secure/fedpartial_ws/fedpartial/prod_00

NVFlare 2.9's kits keep the server's job store and snapshots under ``/tmp/nvflare/...`` with world-readable
files, and its default authorisation gives any ``lead`` the ``byoc`` right (submit jobs that bring code: every
fedpartial job does). For every kit of the folder this:

- points the server's job store and snapshots into the server's own kit (NVFlare's
  ``update_storage_locations``), so they live with its private key instead of a shared temporary folder;
- writes ``local/authorization.json`` from NVFlare's default with ``byoc: none`` for the ``lead`` role (only the
  coordinator's ``project_admin`` may submit code; a site may tighten its own file further);
- makes every folder 0700 and every file 0600 (0700 for executables): owner only.

Running it again changes nothing more (it prints what it changed, each kit on one line).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path


def server_kit(prod: Path) -> Path:
    """The server's kit in a provisioned ``prod_NN`` folder (the one with ``startup/fed_server.json``)."""
    found = [p for p in sorted(prod.iterdir()) if (p / "startup" / "fed_server.json").is_file()]
    if not found:
        raise ValueError(
            f"{prod}: no server kit (a folder with startup/fed_server.json); give the prod_NN folder "
            "nvflare provision wrote"
        )
    return found[0]


def harden_kits(prod: str | os.PathLike) -> list[str]:
    """Harden every kit under ``prod`` (see the module docstring); returns one line per kit."""
    from nvflare.lighter.utils import update_storage_locations

    prod = Path(prod)
    if not prod.is_dir():
        raise ValueError(f"{prod}: not a folder (give the prod_NN folder nvflare provision wrote)")
    server = server_kit(prod)
    update_storage_locations(str(server / "local"), str(server.resolve()))
    lines = []
    for kit in sorted(p for p in prod.iterdir() if (p / "local").is_dir()):
        default = kit / "local" / "authorization.json.default"
        done = []
        if default.is_file():
            authz = json.loads(default.read_text())
            lead = authz.get("permissions", {}).get("lead")
            if lead is not None:
                lead["byoc"] = "none"
            (kit / "local" / "authorization.json").write_text(json.dumps(authz, indent=2))
            done.append("lead byoc none")
        for root, dirs, files in os.walk(kit):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o700)
            for f in files:
                path = os.path.join(root, f)
                os.chmod(path, 0o700 if os.stat(path).st_mode & stat.S_IXUSR else 0o600)
        os.chmod(kit, 0o700)
        done.append("owner-only files")
        if kit == server:
            done.append(f"job store and snapshots in {server.resolve()}")
        lines.append(f"{kit.name}: {', '.join(done)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedpartial-harden-kits", description=__doc__.split("\n\n")[0])
    ap.add_argument("prod", help="the prod_NN folder nvflare provision wrote (every participant's kit)")
    args = ap.parse_args(argv)
    old = os.umask(0o077)
    try:
        for line in harden_kits(args.prod):
            print(line)
    except ValueError as e:
        print(f"fedpartial-harden-kits: {e}", file=sys.stderr)
        return 2
    finally:
        os.umask(old)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
