#!/usr/bin/env bash
# The papers' layouts from where a model starts: EfficientNet-Lite0 from ImageNet (the weights shipped with the
# project, model.pretrained: imagenet) or from random weights, the same architecture, rounds, steps and optimiser.
# One table and one start per command; 3 seeds; the JSON is rewritten after every run and --resume continues an
# interrupted table (the tables take hours on a CPU: run them piece by piece, e.g. SEEDS=0 first).
#
#   TABLE=fedlsm START=imagenet bash benchmarks/start_tables.sh   # FedLSM Table 2 layout: HAM10000, 5 sites x 3
#       classes: FedAvg, FedAvg*, FedLSM, FedLSM w/o UE / UDE / AWPA, all labels, FedLSM with a lower pseudo-label
#       threshold (tau 0.8: its 0.95 admits NV alone from this start), the table's other comparison methods
#       (FedProx*, MOON*, FedRS, FedAvg*+FixMatch, FedPU) and the HAM10000 jobs' FedLC and FedAvg-PL; the share of
#       the macro-F1 gap
#   TABLE=fedmlp START=imagenet bash benchmarks/start_tables.sh   # FedMLP missing 7 on the NIH images: FedAvg,
#       FedAvg-PL, FedMLP, all labels (8 sites); the share of the AUC gap between FedAvg-PL and all labels
#   TABLE=fedirm START=imagenet bash benchmarks/start_tables.sh   # FedIRM: HAM10000, 10 sites, 2 labelled: FedAvg on
#       the labelled sites, FedIRM (its defaults, and the paper's 200-round schedule scaled to ROUNDS), FedAvg on
#       all sites' labels, Fed-Consistency (FedIRM without the relation matching), Fed-SelfTraining (the paper's
#       other baseline: confident pseudo labels of the received model), FedIRM with the teacher's EMA
#       decay scaled to the round's steps (the paper's ~3 rounds of memory), FedIRM with the released code's
#       unlabelled loss weight (15: against Adam's weight decay), FedIRM whose unlabelled sites step at a tenth of
#       LR (Adam's steps are the learning rate's size whatever the loss's scale); the share of the AUC gap
#   TABLE=surgical START=imagenet bash benchmarks/start_tables.sh # surgical aggregation (FedBN+: norm layers kept at
#       the start's statistics), FedBN, FL-PL, vanilla FL, PFL, individual on the NIH images (4 sites, 7 of 14
#       findings each; DATA=ich: the ICH phantom, 5 sites)
#
# START=random: the same rows from random weights; START=selfsup / imagenet_selfsup: from the encoder of the
# federated self-supervised stage (BYOL, jobs/selfsup_*) on the table's own sites, begun from random weights / from
# ImageNet (run first, once per table; the job normalises as the stage did). Knobs: ROUNDS (20), STEPS (10 local
# steps of batch 32; epoch: one local epoch), SIZE (64 px), LR (3e-4, Adam; the same for every start), FREEZE
# (encoder parts kept at their start, e.g. FREEZE='"stem", "stage1", "stage2"'), SEEDS ("0 1 2"), TEACHER (FedIRM's
# scaled EMA decay); extra arguments go to run_jobs.py.
# Results: benchmarks/results/start_<table>_<start>_r<R>_s<S>_px<P>.{json,md,_curves.png,_final.png}
set -euo pipefail
TABLE="${TABLE:-fedlsm}"
START="${START:-imagenet}"
ROUNDS="${ROUNDS:-20}"
STEPS="${STEPS:-10}"
SIZE="${SIZE:-64}"
LR="${LR:-0.0003}"
FREEZE="${FREEZE:-}"
SEEDS="${SEEDS:-0 1 2}"
if [ "$STEPS" = epoch ]; then LOCAL='"local_epochs": 1, "local_steps": null'; else LOCAL='"local_steps": '"$STEPS"; fi

# The self-supervised starts: the federated BYOL stage (jobs/selfsup_*) on the table's sites' training images (the
# train / val / test split depends on the source, seed and fractions only, never on the label protocol or the
# number of sites, so the stage sees no validation or test image of the table), from random weights (selfsup) or
# continued from ImageNet (imagenet_selfsup), at the table's rounds, local steps, size and learning rate, seed 0;
# run once per table and start, its encoder (and the normalisation record beside it) reused by every seed.
stage_encoder() {
  local job=selfsup_ham10000 sites=5 prepare='{"protocol": "full", "table": null, "val_frac": 0.05}'
  case "$TABLE" in
  fedirm) sites=10 ;;
  fedmlp) job=selfsup_cxr14 sites=8 prepare='{"protocol": "full", "k": null}' ;;
  surgical) [ "${DATA:-cxr14}" = ich ] && job=selfsup_ich sites=5 || job=selfsup_cxr14 sites=4
    prepare='{"protocol": "full", "k": null}' ;;
  esac
  local ws="/tmp/start_tables_stage/${TABLE}${DATA:+_$DATA}_${START}_r${ROUNDS}_s${STEPS}_px${SIZE}"
  if [ ! -f "$ws/encoder.txt" ]; then
    rm -rf "$ws"
    python "jobs/$job/job.py" --rounds "$ROUNDS" --sites "$sites" --seed 0 --workspace "$ws/run" \
      --set model.arch=efficientnet_lite0 --set "model.pretrained=$1" \
      --set "train={\"optimizer\": \"adam\", \"batch_size\": 32, $LOCAL, \"lr\": $LR}" \
      --set "dataset.image_size=$SIZE" --set dataset.cache=disk --set dataset.cache_dir=/tmp/start_tables_cache \
      --set "dataset.prepare=$prepare" >&2
    python -c "import json, pathlib, sys; print(json.loads(next(pathlib.Path(sys.argv[1]).rglob('results.json'))\
.read_text())['encoder'])" "$ws/run" > "$ws/encoder.txt"
  fi
  cat "$ws/encoder.txt"
}

case "$START" in
imagenet) PRETRAINED='"imagenet"' ;;
random) PRETRAINED=null ;;
selfsup) PRETRAINED="\"$(stage_encoder null)\"" ;;
imagenet_selfsup) PRETRAINED="\"$(stage_encoder '"imagenet"')\"" ;;
*) echo "START must be imagenet, random, selfsup or imagenet_selfsup" >&2; exit 2 ;;
esac
MODEL='"model": {"arch": "efficientnet_lite0", "pretrained": '"$PRETRAINED"', "freeze": ['"$FREEZE"']}'
TRAIN='"train": {"batch_size": 32, '"$LOCAL"', "lr": '"$LR"'}'
CACHE='"cache": "disk", "cache_dir": "/tmp/start_tables_cache"'
OUT="benchmarks/results/start_${TABLE}_${START}_r${ROUNDS}_s${STEPS}_px${SIZE}${FREEZE:+_frozen}.json"
case "$TABLE" in
fedlsm)
  python benchmarks/run_jobs.py --variant 'FedAvg=fedavg_ham10000:{}' --variant 'FedAvg*=fedavg_masked_ham10000:{}' \
    --variant 'FedLSM=fedlsm_isic:{"n_mix": 2}' --variant 'FedLSM w/o UE=fedlsm_isic:{"n_mix": 2, "ue": false}' \
    --variant 'FedLSM w/o UDE=fedlsm_isic:{"n_mix": 2, "ude": false}' \
    --variant 'FedLSM* w/o AWPA=fedlsm_isic:{"n_mix": 2, "awpa": "masked"}' \
    --variant 'FedAvg-full=fedavg_full_ham10000:{}' \
    --variant 'FedLSM, tau 0.8=fedlsm_isic:{"n_mix": 2, "tau": 0.8}' \
    --variant 'FedProx*=fedavg_masked_ham10000:{"method": "fedprox_masked"}' \
    --variant 'MOON*=fedavg_masked_ham10000:{"method": "moon_masked"}' --variant 'FedRS=fedrs_ham10000:{}' \
    --variant 'FedAvg*+FixMatch=fixmatch_masked_ham10000:{}' --variant 'FedPU=fedpu_ham10000:{}' \
    --variant 'FedLC=fedlc_ham10000:{}' --variant 'FedAvg-PL=fedavg_pl_ham10000:{}' \
    --seeds $SEEDS --rounds "$ROUNDS" --compact \
    --override '{'"$MODEL"', '"$TRAIN"', "dataset": {"image_size": '"$SIZE"', '"$CACHE"', "prepare": {"val_frac": 0.05}}, "evaluation": {"test_every": 0}}' \
    --gap FedAvg FedAvg-full --gap-metric f1 --out "$OUT" "$@" ;;
fedmlp)
  python benchmarks/run_jobs.py --sites 8 --variant 'FedAvg=fedavg_cxr14:{}' --variant 'FedAvg-PL=fedavg_pl_cxr14:{}' \
    --variant 'FedMLP=fedmlp_cxr14:{}' \
    --variant 'all labels=fedavg_pl_cxr14:{"dataset": {"prepare": {"protocol": "full", "k": null}}}' \
    --seeds $SEEDS --rounds "$ROUNDS" --compact \
    --override '{'"$MODEL"', '"$TRAIN"', "dataset": {"image_size": '"$SIZE"', '"$CACHE"'}, "evaluation": {"test_every": 0}}' \
    --gap FedAvg-PL 'all labels' --gap-metric auc --out "$OUT" "$@" ;;
fedirm)
  # the paper's schedule (200 rounds: 20 labelled-only, the unlabelled loss ramped up over 30) scaled to ROUNDS
  # the teacher's memory the paper's epoch gives (decay 0.99 over ~36 steps a round: ~2.8 rounds) at STEPS a round
  if [ "$STEPS" = epoch ]; then TEACHER="${TEACHER:-0.99}"; else TEACHER="${TEACHER:-$(python -c \
    "import sys; print(round(1 - 1 / (2.8 * int(sys.argv[1])), 3))" "$STEPS")}"; fi
  SCALED='{"warm_rounds": '"$((ROUNDS / 10))"', "rampup_rounds": '"$(((3 * ROUNDS + 19) / 20))"'}'
  python benchmarks/run_jobs.py --sites 10 --variant 'FedAvg, labelled sites=fedavg_labelled_isic:{}' \
    --variant 'FedIRM=fedirm_isic:{}' --variant 'FedAvg, all labels=fedavg_labelled_full_isic:{}' \
    --variant "FedIRM, schedule scaled to the rounds=fedirm_isic:$SCALED" \
    --variant 'Fed-Consistency=fed_consistency_isic:{}' --variant 'Fed-SelfTraining=fed_selftraining_isic:{}' \
    --variant "FedIRM, teacher decay scaled to the round=fedirm_isic:{\"ema_max_decay\": $TEACHER}" \
    --variant 'FedIRM, loss weight 15 (the code'"'"'s)=fedirm_isic:{"loss_weight": 15}' \
    --variant "FedIRM, unlabelled sites at a tenth of the learning rate=fedirm_isic:{\"unlabelled_lr\": $(python -c \
      "import sys; print(round(float(sys.argv[1]) / 10, 12))" "$LR")}" \
    --seeds $SEEDS --rounds "$ROUNDS" --compact \
    --override '{'"$MODEL"', '"$TRAIN"', "dataset": {"image_size": '"$SIZE"', '"$CACHE"', "prepare": {"val_frac": 0.05}}, "evaluation": {"test_every": 0}}' \
    --gap 'FedAvg, labelled sites' 'FedAvg, all labels' --gap-metric auc --out "$OUT" "$@" ;;
surgical)
  JOB="surgical_${DATA:-cxr14}"
  python benchmarks/run_jobs.py --sites "$([ "$JOB" = surgical_ich ] && echo 5 || echo 4)" \
    --variant "surgical (FedBN+)=$JOB:{\"norm\": \"frozen\"}" --variant "surgical, FedBN=$JOB:{\"norm\": \"local\"}" \
    --variant "FL-PL=$JOB:{\"task_block\": \"average\", \"norm\": \"frozen\"}" \
    --variant "vanilla FL=$JOB:{\"task_block\": \"average\", \"missing\": \"negatives\", \"norm\": \"frozen\"}" \
    --variant "PFL=$JOB:{\"method\": \"pfl\"}" --variant "individual=$JOB:{\"method\": \"individual\"}" \
    --seeds $SEEDS --rounds "$ROUNDS" --compact --compare 'surgical (FedBN+)' FL-PL \
    --override '{'"$MODEL"', '"$TRAIN"', "dataset": {"image_size": '"$SIZE"', '"$CACHE"'}, "evaluation": {"test_every": 0}}' \
    --out "${OUT%.json}_${JOB#surgical_}.json" "$@" ;;
*) echo "TABLE must be fedlsm, fedmlp, fedirm or surgical" >&2; exit 2 ;;
esac
