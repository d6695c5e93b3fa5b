#!/usr/bin/env bash
# The job-level speed check: the same simulated fedavg_ich job (5 sites, 20 rounds, seed 0) with the code of
# commit BEFORE (default e80eb23, the last commit before the speed work) and with this checkout, one after the
# other on the same machine. Run from the project root with the venv active; the old code runs from a temporary
# git worktree (its own custom/ first on PYTHONPATH), so nothing here is touched.
#   bash benchmarks/job_round_before_after.sh            # writes benchmarks/results/fedavg_ich_round_{before,after}.json
set -euo pipefail
BEFORE="${BEFORE:-e80eb23}"; OUT="${OUT:-benchmarks/results}"
WT="$(mktemp -d)/before"
git worktree add -f -q "$WT" "$BEFORE"
trap 'git worktree remove --force "$WT"' EXIT
(cd "$WT" && PYTHONPATH="$WT/custom" python -m fedpartial.tools.build_jobs > /dev/null \
  && PYTHONPATH="$WT/custom" python benchmarks/run_jobs.py --jobs fedavg_ich --rounds 20 --seeds 0 \
       --out "$OLDPWD/$OUT/fedavg_ich_round_before.json" > /dev/null)
python benchmarks/run_jobs.py --jobs fedavg_ich --rounds 20 --seeds 0 --out "$OUT/fedavg_ich_round_after.json" > /dev/null
python - "$OUT" "$BEFORE" <<'PY'
import json, statistics, sys
from pathlib import Path

def rounds(path):
    runs = json.loads(Path(path).read_text())["runs"]
    secs = [r["seconds"] for r in next(iter(runs.values()))[0]["rounds"] if r.get("seconds")]
    return statistics.mean(secs), statistics.median(secs)

(b, bm), (a, am) = rounds(f"{sys.argv[1]}/fedavg_ich_round_before.json"), rounds(f"{sys.argv[1]}/fedavg_ich_round_after.json")
print(f"fedavg_ich, 5 sites, 20 rounds: {sys.argv[2]} {b:.2f} s / round (median {bm:.2f}), this checkout {a:.2f} "
      f"(median {am:.2f}): {b / a:.2f}x faster (median {bm / am:.2f}x)")
PY
