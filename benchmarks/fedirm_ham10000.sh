#!/usr/bin/env bash
# FedIRM benchmark on HAM10000 (10 sites: 2 labelled, 8 unlabelled; the paper's task 2, Table 1): the lower bound
# (FedAvg over the labelled sites), the all-labelled upper bound, Fed-SelfTraining, Fed-Consistency and FedIRM,
# identical budget (the small CNN from random weights at 64 px, Adam lr 1e-3, rounds, local steps, seeds; the jobs'
# own start, ImageNet's: benchmarks/start_tables.sh); fedirm_code_filter = FedIRM with the released
# code's uncertainty filter (entropy < 2.0, which never filters 7 classes, and max probability >= 0.3); the *_warm
# variants use the released code's schedule: only the labelled sites train in the first WARM rounds (default 10).
# Run from the project root with the venv active. Budget: ROUNDS rounds (default 30) x STEPS local steps (default 10)
# of batch 32 at every site; RAMP = the ramp-up length Omega in rounds (default: the paper's 30); extra arguments go
# to run_jobs.py (--seeds 0 1 2, --resume, --only NAME ..., --out FILE).
set -euo pipefail
ROUNDS="${ROUNDS:-30}"
STEPS="${STEPS:-10}"
RAMP="${RAMP:-30}"
WARM="${WARM:-10}"
SEEDS="${SEEDS:-0 1 2}"
python benchmarks/run_jobs.py --sites 10 \
  --jobs fedavg_labelled_isic fedavg_labelled_full_isic fed_selftraining_isic fed_consistency_isic fedirm_isic \
  --variant 'fedirm_code_filter=fedirm_isic:{"entropy_threshold": 2.0, "min_confidence": 0.3}' \
  --variant 'fed_selftraining_warm=fed_selftraining_isic:{"warm_rounds": '"$WARM"'}' \
  --variant 'fed_consistency_warm=fed_consistency_isic:{"warm_rounds": '"$WARM"'}' \
  --variant 'fedirm_warm=fedirm_isic:{"warm_rounds": '"$WARM"'}' \
  --seeds $SEEDS --rounds "$ROUNDS" --compact \
  --override '{"model": {"arch": "small_cnn", "pretrained": null}, "dataset": {"cache": "disk", "cache_dir": "/tmp/fedirm_bench_cache", "prepare": {"val_frac": 0.05}}, "train": {"batch_size": 32, "local_steps": '"$STEPS"', "lr": 0.001}, "evaluation": {"test_every": 0}, "method_args": {"rampup_rounds": '"$RAMP"'}}' \
  --gap fedavg_labelled_isic fedavg_labelled_full_isic --gap-metric auc \
  --out "benchmarks/results/fedirm_ham10000_r${ROUNDS}_s${STEPS}.json" "$@"
