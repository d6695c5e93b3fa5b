#!/usr/bin/env python3
"""Admin script for a provisioned fedpartial federation (a thin wrapper of ``fedpartial.tools.admin``).

Works from a checkout without installing the package::

    python admin/fedpartial_admin.py --kit ~/kits/admin@coordinator.org check jobs/fedmlp_ich
    python admin/fedpartial_admin.py results results/JOB_ID

See admin/README.md, or ``python admin/fedpartial_admin.py --help``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "custom"))

from fedpartial.tools.admin import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
