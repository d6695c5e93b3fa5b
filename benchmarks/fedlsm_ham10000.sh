#!/usr/bin/env bash
# FedLSM benchmark on HAM10000 (5 sites x 3 classes): 3 baselines + FedLSM + 3 ablations, identical budget, 3 seeds,
# the small CNN from random weights at 64 px (the jobs' own start, ImageNet's: benchmarks/start_tables.sh).
# Run from the project root with the venv active. Budget: ROUNDS rounds (default 25) x STEPS local steps (default
# 10; the paper uses 30 local iterations) of batch 32; extra arguments go to run_jobs.py (e.g. --resume, --seeds 0,
# --only fedlsm to run a subset, --out FILE). Per seed on an idle 2-core machine: about 30 min with STEPS=10, 48 with 30.
set -euo pipefail
ROUNDS="${ROUNDS:-25}"
STEPS="${STEPS:-10}"
python benchmarks/run_jobs.py --jobs fedavg_ham10000 fedavg_masked_ham10000 fedavg_full_ham10000 \
  --variant 'fedlsm=fedlsm_isic:{"n_mix": 2}' \
  --variant 'fedlsm_no_ue=fedlsm_isic:{"n_mix": 2, "ue": false}' \
  --variant 'fedlsm_no_ude=fedlsm_isic:{"n_mix": 2, "ude": false}' \
  --variant 'fedlsm_no_awpa=fedlsm_isic:{"n_mix": 2, "awpa": "masked"}' \
  --seeds 0 1 2 --rounds "$ROUNDS" --compact \
  --override '{"model": {"arch": "small_cnn", "pretrained": null}, "dataset": {"cache": "disk", "cache_dir": "/tmp/fedlsm_bench_cache", "prepare": {"val_frac": 0.05}}, "train": {"batch_size": 32, "local_steps": '"$STEPS"', "lr": 0.001, "betas": [0.9, 0.99]}, "evaluation": {"test_every": 0}}' \
  --gap fedavg_ham10000 fedavg_full_ham10000 --gap-metric f1 \
  --out "benchmarks/results/fedlsm_ham10000_r${ROUNDS}_s${STEPS}.json" "$@"
