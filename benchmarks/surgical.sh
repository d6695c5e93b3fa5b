#!/usr/bin/env bash
# Surgical aggregation benchmarks (scaled down; run from the project root with the venv active). Extra arguments go
# to run_jobs.py (e.g. --resume, --seeds 0, --only surgical). EXP selects the experiment:
#   baselines (default): surgical aggregation vs vanilla FL, FL + partial loss (same pipeline: warm-up, unweighted
#       means), PFL and the individually trained models, under FedBN+ (NORM=frozen), FedBN (local) or FedAvg
#       (average); ICH phantom (DATA=ich, synthetic) or the real NIH images (DATA=cxr14, 1000 images, 14 classes).
#   sites: data heterogeneity, K = 2..10 sites (SITES="2 4 6 8 10"), each class annotated by about half the sites.
#   overlap: class heterogeneity, K = 4 sites, each site annotating S classes (S="2 3 4 5": from disjoint to all).
#   vocab: two groups of sites with different vocabularies. DATA=ich (synthetic): sites 3-4 name the ICH subtypes
#       by abbreviation. DATA=cxr14 (the real NIH images): the paper's real-world setting as far as NIH images allow:
#       sites 1-2 use NIH names for the 7 findings NIH and CheXpert share plus 4 NIH-only findings, sites 3-4 use
#       CheXpert names ("Pleural Effusion") for the shared 7 plus 3 findings under their closest CheXpert column
#       (Lung Lesion = Mass, Lung Opacity = Infiltration, Pleural Other = Pleural_Thickening); the union is 14.
#       all_labels: the same pipeline with every site annotating every class in one vocabulary (the upper bound).
# Budget: ROUNDS rounds (default 10) of one local epoch; the warm-up (round 0) has WARMUP epochs (default 5; the
# paper 15). Measured on the shared 2-core machine: about 1-2 min per ICH run of 6 rounds (see the job READMEs).
# IMAGES: the ICH phantom's size for EXP=vocab (default: the preset's 1,500 images), e.g. IMAGES=4500.
set -euo pipefail
EXP="${EXP:-baselines}"; DATA="${DATA:-ich}"; NORM="${NORM:-frozen}"; ROUNDS="${ROUNDS:-10}"; WARMUP="${WARMUP:-5}"
SEEDS="${SEEDS:-0 1 2}"
JOB="surgical_${DATA}"
EVAL='"evaluation": {"test_every": 0}'
case "$EXP" in
baselines)
  python benchmarks/run_jobs.py --jobs "$JOB" \
    --variant "fl_pl=${JOB}:{\"task_block\": \"average\"}" \
    --variant "vanilla_fl=${JOB}:{\"task_block\": \"average\", \"missing\": \"negatives\"}" \
    --variant "pfl=${JOB}:{\"method\": \"pfl\"}" \
    --variant "individual=${JOB}:{\"method\": \"individual\"}" \
    --seeds $SEEDS --rounds "$ROUNDS" --compact --sites "$([ "$DATA" = ich ] && echo 5 || echo 4)" \
    --compare "$JOB" fl_pl --compare "$JOB" vanilla_fl --compare "$JOB" individual \
    --override "{\"method_args\": {\"warmup_epochs\": $WARMUP, \"norm\": \"$NORM\"}, $EVAL}" \
    --out "benchmarks/results/surgical_${DATA}_${NORM}_r${ROUNDS}.json" "$@" ;;
sites)
  for K in ${SITES:-2 4 6 8 10}; do
    python benchmarks/run_jobs.py --jobs surgical_ich --variant "fl_pl=surgical_ich:{\"task_block\": \"average\"}" \
      --seeds $SEEDS --rounds "$ROUNDS" --compact --sites "$K" --compare surgical_ich fl_pl \
      --override "{\"method_args\": {\"warmup_epochs\": $WARMUP}, \"dataset\": {\"prepare\": {\"num_sites\": $K, \"protocol\": \"random_s\", \"k\": null, \"s\": 3}}, $EVAL}" \
      --out "benchmarks/results/surgical_sites_k${K}.json" "$@"
  done ;;
overlap)
  for S in ${S:-2 3 4 5}; do
    python benchmarks/run_jobs.py --jobs surgical_ich --variant "fl_pl=surgical_ich:{\"task_block\": \"average\"}" \
      --seeds $SEEDS --rounds "$ROUNDS" --compact --sites 4 --compare surgical_ich fl_pl \
      --override "{\"method_args\": {\"warmup_epochs\": $WARMUP}, \"dataset\": {\"prepare\": {\"num_sites\": 4, \"protocol\": \"random_s\", \"k\": null, \"s\": $S}}, $EVAL}" \
      --out "benchmarks/results/surgical_overlap_s${S}.json" "$@"
  done ;;
vocab)
  if [ "$DATA" = ich ]; then
    TABLE='[["epidural", "subdural", "intraventricular"], ["epidural", "subdural", "intraparenchymal"], ["epidural", "subdural", "subarachnoid"], ["epidural", "subdural", "subarachnoid"]]'
    VOCAB='{"site-3": "ich_abbreviations", "site-4": "ich_abbreviations"}'
  else
    SHARED='"Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Pneumonia", "Pneumothorax"'
    NIH="[$SHARED, \"Nodule\", \"Emphysema\", \"Fibrosis\", \"Hernia\"]"
    CHX="[$SHARED, \"Mass\", \"Infiltration\", \"Pleural_Thickening\"]"
    TABLE="[$NIH, $NIH, $CHX, $CHX]"
    VOCAB='{"site-3": "chexpert", "site-4": "chexpert"}'
  fi
  python benchmarks/run_jobs.py --jobs "$JOB" --variant "fl_pl=${JOB}:{\"task_block\": \"average\"}" \
    --variant "all_labels=${JOB}:{\"dataset\": {\"prepare\": {\"protocol\": \"full\", \"table\": null, \"vocabularies\": null}}}" \
    --seeds $SEEDS --rounds "$ROUNDS" --compact --sites 4 --compare "$JOB" fl_pl \
    --override "{\"method_args\": {\"warmup_epochs\": $WARMUP}, \"dataset\": {\"prepare\": {\"num_sites\": 4, \"protocol\": \"table\", \"k\": null, \"table\": $TABLE, \"vocabularies\": $VOCAB${IMAGES:+, \"source_args\": {\"n_images\": $IMAGES\}}}}, $EVAL}" \
    --out "benchmarks/results/surgical_vocab$([ "$DATA" = ich ] || echo "_$DATA")${IMAGES:+_n$IMAGES}.json" "$@" ;;
*) echo "EXP must be baselines, sites, overlap or vocab" >&2; exit 2 ;;
esac
