#!/usr/bin/env bash
# FedMLP's two loss balances on ../shared/data/nih_cxr14_1000 (8 sites, "missing 7 classes"),
# against FedAvg-PL and the all-labels bound (FedAvg-PL on the `full` protocol), same rounds and seeds.
#   fedmlp_eq4       the paper's Eq. 4 (WPC sum / C) + CR mean over missing entries (loss_balance: eq4)
#   fedmlp_per_term  each term averaged over its own entries, as the released code (loss_balance: per_term)
#   fedmlp_before    the code before the issue-16 fixes, rebuilt from options (tag-ratio pi, CR in the warm-up)
# Run from the project root with the venv active; ROUNDS (default 20) and SEEDS (default "0") from the environment.
# Each configuration is its own run_jobs.py call (at most one simulator at a time on the shared 2-core machine);
# an interrupted benchmark goes on with the same command (--resume).
set -euo pipefail
ROUNDS="${ROUNDS:-20}"
SEEDS="${SEEDS:-0}"
OUT="benchmarks/results/fedmlp_cxr14_balance_r${ROUNDS}.json"
PY="${PY:-python}"
for only in fedmlp_eq4 fedmlp_per_term fedavg_pl_cxr14 fedmlp_before; do
  "$PY" benchmarks/run_jobs.py --jobs fedavg_pl_cxr14 \
    --variant 'fedmlp_eq4=fedmlp_cxr14:{"loss_balance": "eq4"}' \
    --variant 'fedmlp_per_term=fedmlp_cxr14:{"loss_balance": "per_term"}' \
    --variant 'fedmlp_before=fedmlp_cxr14:{"loss_balance": "eq4", "missing_rates": "pseudo_labels", "cr_warmup": true}' \
    --only "$only" --seeds $SEEDS --rounds "$ROUNDS" --sites 8 --compact --resume --out "$OUT"
done
# the all-labels bound: the dataset override applies to every job of a call, so it has its own file
"$PY" benchmarks/run_jobs.py --jobs fedavg_pl_cxr14 --seeds $SEEDS --rounds "$ROUNDS" --sites 8 --compact --resume \
  --override '{"dataset": {"prepare": {"protocol": "full", "k": null}}}' \
  --out "benchmarks/results/fedmlp_cxr14_full_r${ROUNDS}.json"
