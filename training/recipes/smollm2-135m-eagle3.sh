#!/usr/bin/env bash
# EAGLE-3-generation heads for the embedded SmolLM2-135M-Instruct target, first step: the first shard of the recipe's
# chunk 0 (256 ShareGPT records at --max-len 1024) stored with the inputs of three target layers, then three heads one
# epoch each at the recipe's stage-1 learning rate: griffin (the shipped arch, K=1, for reference), eagle3 (EAGLE-3's
# own training: training-time test over 7 passes, no alignment mask) and griffin3 (Token-Guided Fusion + dual heads,
# alignment mask top-3), each also with its lm_head and final norm started from the target's (-init), scored on the
# recipe's fixed validation sets; then python -m benchmarks.eagle3_first_step and inference.tau (benchmarks/README.md).
# Rerun to resume. (2026-11-26 ran the five trainings two or three at a time, one thread each.)
# Usage, at one thread in the background:  OMP_NUM_THREADS=1 nohup bash training/recipes/smollm2-135m-eagle3.sh &
set -euo pipefail
work=${WORK:-work/eagle3}
features=(--max-len 1024 --feature-layers auto)
python -m training.build_features --out "$work/features-shard0" --max-samples 256 "${features[@]}"
for kind in regen sharegpt; do
  python -m training.build_features --out "$work/fixed-val-$kind" "${features[@]}" \
    --data "benchmarks/results/recipe/fixed-val-$kind.jsonl"
done
for head in "griffin griffin 1 3 random" "eagle3 eagle3 7 0 random" "griffin3 griffin3 7 3 random" \
            "eagle3-init eagle3 7 0 target" "griffin3-init griffin3 7 3 target"; do
  set -- $head
  if [ ! -f "$work/$1/validation.json" ]; then
    resume=$([ -d "$work/$1/train_state" ] && echo --resume || true)
    ttt=$([ "$2" = griffin ] && echo --steps 1 || echo --ttt-steps "$3")
    python -m training.train --features "$work/features-shard0" --out "$work/$1" --arch "$2" $ttt --topk "$4" \
      --lm-head-init "$5" --lr 1e-3 --draft-vocab 8192 --batch-size 4 --epochs 1 --save-every 25 $resume
  fi
  for kind in regen sharegpt; do
    [ -f "$work/$1/fixed-val-$kind.json" ] || python -m training.evaluate "$work/$1" --features \
      "$work/fixed-val-$kind" --steps 1 --topk 3 --out "$work/$1/fixed-val-$kind.json"
  done
done
