#!/usr/bin/env bash
# FedMLP on real chest X-rays (../shared/data/nih_cxr14_1000, 8 sites "missing 7 classes", 30 rounds, 3 seeds)
# against FedAvg, FedAvg-PL and the all-labels bound, with FedMLP's pseudo-label counts under three readings of Eq. 8-9:
#   fedmlp_floor  tau * #candidates rounded down every round (the released code; no tag on 88-image sites), with the
#                 released code's loss balance (per_term, the default when this row was measured)
#   fedmlp_carry  the fractional part carried to the next round (pseudo_label_rounding: carry, the default until 2026-11-24)
#   fedmlp_T450   carry + T0 / T1 rescaled from the paper's 450 stage-2 rounds to the job's 25 (T_rounds: 450)
#   fedmlp_defaults  the job as shipped on 2026-11-24 (floor + the paper's Eq. 4 balance, stage 1 L_WPC alone as the
#                    paper: cr_warmup false)
#   fedmlp_crwarm    the job as shipped since 2026-11-25: the same + the released code's stage-1 consistency
#                    (cr_warmup: true)
# Every run is kept (--keep) so that `python -m fedpartial.tools.tag_audit WS` can compare the tags with the true labels.
# Run from the project root with the venv active; an interrupted benchmark goes on with the same command (--resume).
set -euo pipefail
SEEDS="${SEEDS:-0 1 2}"
PY="${PY:-python}"
"$PY" benchmarks/run_jobs.py \
  --variant 'fedmlp_carry=fedmlp_cxr14:{"pseudo_label_rounding": "carry", "loss_balance": "per_term"}' \
  --variant 'fedmlp_T450=fedmlp_cxr14:{"pseudo_label_rounding": "carry", "T_rounds": 450, "loss_balance": "per_term"}' \
  --variant 'fedavg_pl_cxr14=fedavg_pl_cxr14:{}' \
  --variant 'fedmlp_floor=fedmlp_cxr14:{"pseudo_label_rounding": "floor", "loss_balance": "per_term"}' \
  --variant 'fedmlp_defaults=fedmlp_cxr14:{"cr_warmup": false}' \
  --variant 'fedmlp_crwarm=fedmlp_cxr14:{"cr_warmup": true}' \
  --variant 'fedavg_all_labels=fedavg_pl_cxr14:{"dataset": {"prepare": {"protocol": "full", "k": null}}}' \
  --variant 'fedavg_cxr14=fedavg_cxr14:{}' \
  --seeds $SEEDS --rounds 30 --sites 8 --compact --keep --resume \
  --gap fedavg_pl_cxr14 fedavg_all_labels --gap-metric auc \
  --out benchmarks/results/fedmlp_cxr14_tags_r30.json "$@"
