#!/usr/bin/env bash
# Issue 36: the library's claim with the scorer's one budget over all layers in the loop.
# Trains the compress_global arm (seeds 0 and 1; seed 1 with data order 1, as control seed 1
# ran) and reruns control seed 1 (its export was not kept), all from revision REV, two lanes of
# one thread each on 2 cores, then evaluates each export query-agnostically at the global
# scorer's 8x/16x (and uncompressed) from the same revision; the per-prompt rows are copied into
# experiments/long_context/raw/. About 55 minutes on 2 cores (measured at 1f5fd6c).
#   bash experiments/long_context/claim_global.sh REV
set -euo pipefail
REV=${1:?usage: claim_global.sh REV}
SHA=$(git rev-parse "$REV")
S=experiments/long_context/study.py
CFG=runs/long_context/study_1thread.yaml
mkdir -p runs/long_context
sed 's/^threads: .*/threads: 1/' experiments/long_context/study.yaml > "$CFG"
FROZEN=${UNICACHE_TRAIN_CACHE:-$HOME/.cache/unicache_train}/revs/$SHA/experiments/long_context
UT=.venv/bin/unicache-train
SETTINGS="none attention_global@8 attention_global@16"

train() {  # ARM SEED DATA_SEED
  local label=$1_seed$2; [ "$3" = 0 ] || label+=_data$3
  [ -f runs/long_context/$label/export/model.safetensors ] ||
    $UT run --rev "$SHA" $S finetune --config "$CFG" --arm $1 --seed $2 --data-seed $3
}
evaluate() {  # LABEL
  until [ -f runs/long_context/$1/export/model.safetensors ]; do sleep 30; done
  $UT run --rev "$SHA" $S run --config "$CFG" --model runs/long_context/$1/export --label $1 \
    --only $SETTINGS
  for s in $SETTINGS; do cp "$FROZEN/raw/$1_$s.jsonl" experiments/long_context/raw/; done
}
(train compress_global 0 0; train control 1 1; evaluate control_seed1_data1) \
  > runs/long_context/claim_lane1.log 2>&1 &
(train compress_global 1 1; evaluate compress_global_seed1_data1; evaluate compress_global_seed0) \
  > runs/long_context/claim_lane2.log 2>&1 &
wait
echo "done: python $S table"
