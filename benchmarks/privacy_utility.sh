#!/usr/bin/env bash
# Utility cost of differential privacy on the per-class statistics (docs/privacy.md): FedMLP (prototypes and
# their counts) and FedLSM (estimated class counts q) at epsilon 1, 4 and 8 (delta 1e-5, the Gaussian mechanism
# calibrated over the planned rounds, features clipped to norm 1) against no noise, on the ICH phantom and on
# the NIH CXR split (../shared/data/nih_cxr14_1000, 8 sites), same rounds and seeds.
# The privacy properties are the job's own (executor "privacy"), which every simulated site applies as a site
# with that policy would (the simulator loads no site privacy policy). Weights are not noised.
# Run from the project root with the venv active. From the environment: ROUNDS (default 20), SEEDS (default
# "0 1 2"), EPSILONS (default "none 1 4 8"), DATASETS (default "ich cxr14"), METHODS (default "fedmlp fedlsm"),
# CXR_ROOT (the NIH CXR folder, default ../shared/data/nih_cxr14_1000 relative to the checkout), PY, REPORT_ONLY
# (1: run nothing, print the table of what the result files hold). Extra arguments go to every run_jobs.py call
# (e.g. --keep). One run_jobs.py call per (dataset, epsilon), each resumable (--resume); the table is printed at
# the end (and written to benchmarks/results/privacy_utility_r<ROUNDS>.md).
set -euo pipefail
ROUNDS="${ROUNDS:-20}"
SEEDS="${SEEDS:-0 1 2}"
EPSILONS="${EPSILONS:-none 1 4 8}"
DATASETS="${DATASETS:-ich cxr14}"
METHODS="${METHODS:-fedmlp fedlsm}"
REPORT_ONLY="${REPORT_ONLY:-0}"
CXR_ROOT="${CXR_ROOT:-$(cd "$(dirname "$0")/.." && pwd)/../shared/data/nih_cxr14_1000}"
PY="${PY:-python}"
OUT="benchmarks/results/privacy_utility_r${ROUNDS}"
mkdir -p benchmarks/results
has() { case " $METHODS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for eps in $EPSILONS; do
  [ "$REPORT_ONLY" = 1 ] && break
  if [ "$eps" = none ]; then priv='"privacy": {}'
  else priv='"privacy": {"min_count": 5, "epsilon": '"$eps"', "delta": 1e-05, "feature_clip": 1.0}'; fi
  for ds in $DATASETS; do
    if [ "$ds" = ich ]; then
      configs=()
      has fedmlp && configs+=(--jobs fedmlp_ich)
      has fedlsm && configs+=(--variant 'fedlsm_ich=fedavg_ich:{"method": "fedlsm"}')
      "$PY" benchmarks/run_jobs.py "${configs[@]}" \
        --seeds $SEEDS --rounds "$ROUNDS" --compact --resume --no-plots \
        --override "{$priv}" --out "${OUT}_ich_eps${eps}.json" "$@"
    else
      jobs=()
      has fedmlp && jobs+=(fedmlp_cxr14)
      has fedlsm && jobs+=(fedlsm_cxr14)
      "$PY" benchmarks/run_jobs.py --jobs "${jobs[@]}" --sites 8 \
        --seeds $SEEDS --rounds "$ROUNDS" --compact --resume --no-plots \
        --override "{$priv, \"dataset\": {\"prepare\": {\"root\": \"$CXR_ROOT\"}}}" \
        --out "${OUT}_cxr14_eps${eps}.json" "$@"
    fi
  done
done
"$PY" - "$OUT" $DATASETS -- $EPSILONS <<'PYEOF' | tee "${OUT}.md"
import json, sys
from pathlib import Path
import numpy as np
out, rest = sys.argv[1], sys.argv[2:]
datasets, epsilons = rest[:rest.index("--")], rest[rest.index("--") + 1:]
print(f"Test macro AUC (%) of the last-round global model, mean +- std over seeds; spent: the largest epsilon a "
      f"site spent ({Path(out).name})\n")
print("| dataset | method | " + " | ".join(f"eps {e}" if e != "none" else "no noise" for e in epsilons) + " |")
print("|---|---|" + "---|" * len(epsilons))
for ds in datasets:
    cells = {}
    for eps in epsilons:
        f = Path(f"{out}_{ds}_eps{eps}.json")
        if not f.is_file():
            continue
        for name, runs in json.loads(f.read_text())["runs"].items():
            for run in runs:
                auc = run["final"]["FL_global_model.pt"]["test"]["macro"].get("auc")
                spent = [t.get("epsilon") for t in (run.get("privacy") or {}).values()]
                if auc is not None:
                    cells.setdefault(name, {}).setdefault(eps, []).append((100 * auc, max(
                        (e for e in spent if e is not None), default=None)))
    for name, by_eps in sorted(cells.items()):
        def cell(v):
            aucs, spent = [a for a, _ in v], [s for _, s in v if s is not None]
            eps = f", spent {max(spent):.2f}" if spent else ""
            return f"{np.mean(aucs):.2f} +- {np.std(aucs):.2f} (n={len(aucs)}{eps})"
        row = [cell(v) if (v := by_eps.get(e)) else "-" for e in epsilons]
        print(f"| {ds} | {name} | " + " | ".join(row) + " |")
PYEOF
