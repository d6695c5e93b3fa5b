#!/usr/bin/env bash
# FedMLP's component ablation in the layout of the paper's Table 3 (rows add MLD, WPC, CR, ST in turn),
# on the ICH phantom ("missing 4 classes", 5 sites, the fedmlp_ich job's budget), ROUNDS rounds (default 30), with
# the baselines of the README's FedMLP table (FedAvg-PL, FedAvg-PL + masked rows, all labels) on the same budget:
#   FedAvg           fedavg_ich (missing labels as negatives)
#   +MLD             FedMLP's missing-label detection only: Eq. 1 BCE (wpc: false), no CR, fixed T0 / T1 (st: false)
#   +MLD+WPC         + weighted partial-class loss with logit adjustment
#   +MLD+WPC+CR      + consistency to the received global model
#   FedMLP           + self-adaptive thresholds (all components)
#   FedMLP-floor     FedMLP with tau * #candidates rounded down every round (this project's reading before)
#   FedMLP+T450      FedMLP with T0 / T1 rescaled from the paper's 450 stage-2 rounds to the job's (T_rounds: 450)
# Run from the project root with the venv active; SEEDS (default "0 1 2"); --resume continues an interrupted run.
set -euo pipefail
ROUNDS="${ROUNDS:-30}"
SEEDS="${SEEDS:-0 1 2}"
PY="${PY:-python}"
"$PY" benchmarks/run_jobs.py \
  --variant 'FedAvg=fedavg_ich:{}' \
  --variant '+MLD=fedmlp_ich:{"wpc": false, "cr": false, "st": false}' \
  --variant '+MLD+WPC=fedmlp_ich:{"cr": false, "st": false}' \
  --variant '+MLD+WPC+CR=fedmlp_ich:{"st": false}' \
  --variant 'FedMLP=fedmlp_ich:{}' \
  --variant 'FedMLP+T450=fedmlp_ich:{"T_rounds": 450}' \
  --variant 'FedMLP-floor=fedmlp_ich:{"pseudo_label_rounding": "floor"}' \
  --variant 'FedAvg-PL=fedavg_pl_ich:{}' \
  --variant 'FedAvg-PL+masked=fedavg_masked_ich:{}' \
  --variant 'all labels=fedavg_full_ich:{}' \
  --seeds $SEEDS --rounds "$ROUNDS" --compact --resume \
  --out "benchmarks/results/fedmlp_ablation_ich_r${ROUNDS}.json" "$@"
