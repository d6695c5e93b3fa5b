"""Print the results of a finished simulator / POC run: ``python -m fedpartial.tools.show_results WS``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..fl.results import RESULTS_FILE, render_tables


def find_results(path: Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    hits = sorted(path.rglob(RESULTS_FILE))
    if not hits:
        raise FileNotFoundError(f"no {RESULTS_FILE} under {path}")
    return hits[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    path = find_results(Path(argv[0]))
    print(f"{path}\n")
    print(render_tables(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
