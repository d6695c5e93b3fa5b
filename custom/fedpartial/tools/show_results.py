"""Print the results of a finished simulator / POC run: ``python -m fedpartial.tools.show_results WS``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..fl.results import RESULTS_FILE
from ..metrics import format_table


def find_results(path: Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    hits = sorted(path.rglob(RESULTS_FILE))
    if not hits:
        raise FileNotFoundError(f"no {RESULTS_FILE} under {path}")
    return hits[0]


def render(results: dict) -> str:
    lines = [f"method {results['method']} on {results['dataset']}: {results['num_rounds']} rounds, "
             f"{(results.get('seconds_per_round') or 0):.1f} s/round"]
    if results.get("best"):
        lines.append(f"best on validation after {results['best']['trained_rounds']} rounds: {results['best']}")
    for name, res in results.get("final", {}).items():
        for split in ("test", "val"):
            if res.get(split):
                lines.append(format_table(res[split], title=f"{name} on {split}"))
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    path = find_results(Path(argv[0]))
    print(f"{path}\n")
    print(render(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
