#!/usr/bin/env bash
# Issue 36's follow-ups on the fine-tuned arms (their exports were not kept): rerun compress
# seed 1 and control seed 0 from a named revision, check the reruns reproduce the committed
# predictions, then held-out perplexity at 8x and the old 8-pair recall at 4x/8x.
#   bash experiments/long_context/followup.sh REV     (REV: a commit; about 60 min on 2 cores)
set -euo pipefail
REV=${1:?usage: followup.sh REV}
PY=.venv/bin/python
S=experiments/long_context/study.py
for arm in "compress 1" "control 0"; do
  set -- $arm
  [ -f runs/long_context/$1_seed$2/export/model.safetensors ] ||
    .venv/bin/unicache-train run --rev "$REV" $S finetune --arm $1 --seed $2
done
# Reproduction: the reruns' uncompressed and 16x predictions against the committed rows.
for m in compress_seed1 control_seed0; do
  $PY $S run --model runs/long_context/$m/export --label rerun_$m --only none attention@16
  for s in none attention@16; do
    mv experiments/long_context/raw/rerun_${m}_$s.jsonl experiments/long_context/raw/identical/
  done
done
$PY - <<'PY' | tee experiments/long_context/raw/identical/rerun_check.csv
import json
from pathlib import Path
raw = Path("experiments/long_context/raw")
print("model,setting,n,same_prediction,hits_committed,hits_rerun")
for m in ("compress_seed1", "control_seed0"):
    for s in ("none", "attention@16"):
        a = [json.loads(x) for x in (raw / f"{m}_{s}.jsonl").read_text().splitlines()]
        b = {r["id"]: r for r in map(json.loads, (raw / "identical" / f"rerun_{m}_{s}.jsonl").read_text().splitlines())}
        same = sum(r["prediction"] == b[r["id"]]["prediction"] for r in a)
        print(f"{m},{s},{len(a)},{same},{sum(r['correct'] for r in a)},{sum(r['correct'] for r in b.values())}")
PY
$PY $S perplexity --model runs/long_context/compress_seed1/export --label compress_seed1 \
  --only none int4 attention@8 sinks_recent@8 snapkv@8
$PY $S perplexity --model runs/long_context/control_seed0/export --label control_seed0 \
  --only none int4 attention@8 sinks_recent@8 snapkv@8
mkdir -p runs/long_context/recall8_arms
ln -sfn ../compress_seed1 runs/long_context/recall8_arms/lc_compress_seed1
ln -sfn ../control_seed0 runs/long_context/recall8_arms/lc_control_seed0
$PY experiments/smollm2_evidence/smollm2_evidence.py run --config experiments/long_context/recall8.yaml
