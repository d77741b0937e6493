#!/usr/bin/env bash
# Issue 36: the strongest training-free anchor (kvpress KVzip + our int4 storage, 16x fewer KV
# bytes) on the fine-tuned weights, so the compression-aware arm is compared with what a
# training-free method gets from a checkpoint trained on the same data without compression.
# Two lanes of one thread each (2 cores): each control seed's export gets KVzip + int4 @16 on
# the 200 held-out prompts, then the no-press sanity row on a 50-prompt subset (every 4th
# prompt, 12-13 per family: the full no-press row costs as much again), checked against our
# own uncompressed predictions of the same export. Rows land in experiments/long_context/raw/.
#   bash experiments/long_context/kvzip_arms.sh [LABEL ...]   # default: both control seeds
set -euo pipefail
PY=.venv-kvpress/bin/python
H=experiments/kvpress/kvpress_baseline.py
RAW=experiments/long_context/raw
P=runs/long_context/kvpress_prompts.jsonl
SUB=runs/long_context/kvpress_prompts_sub50.jsonl
[ -f $P ] || .venv/bin/python experiments/long_context/study.py kvpress-prompts
LABELS=("$@"); [ ${#LABELS[@]} -gt 0 ] || LABELS=(control_seed0 control_seed1_data1)
.venv/bin/python - "$P" "$SUB" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
open(sys.argv[2], "w").write("\n".join(lines[::4]) + "\n")
PY
lane() {  # LABEL
  local m=runs/long_context/$1/export ref=runs/long_context/$1_none_sub50.jsonl
  [ -f $m/model.safetensors ] || { echo "$m: no export (run the arm's finetune first)"; exit 1; }
  .venv/bin/python - "$SUB" "$RAW/$1_none.jsonl" "$ref" <<'PY'
import json, sys
ids = {json.loads(l)["id"] for l in open(sys.argv[1])}
rows = [l for l in open(sys.argv[2]).read().splitlines() if json.loads(l)["id"] in ids]
open(sys.argv[3], "w").write("\n".join(rows) + "\n")
PY
  $PY $H run --prompts $P --model $m --name $1 --out-dir $RAW --threads 1 \
    --presses KVzip --reductions 16 --storage 4 --no-plain --only KVzip_int4_16x
  $PY $H run --prompts $SUB --model $m --name $1 --out-dir $RAW --threads 1 \
    --presses KVzip --reductions 16 --storage 16 --no-plain --only none_16bit --reference $ref
}
pids=()
for l in "${LABELS[@]}"; do lane "$l" > runs/long_context/kvzip_$l.log 2>&1 & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done  # a failed lane (its log says why) fails the script
echo "done: python experiments/long_context/study.py table"
