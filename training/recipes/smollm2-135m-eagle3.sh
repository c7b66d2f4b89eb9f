#!/usr/bin/env bash
# EAGLE-3-generation heads for the embedded SmolLM2-135M-Instruct target, first step: the recipe's chunk 0 (the first
# 1024 ShareGPT records, --max-len 1024) with the inputs of three target layers, then eagle3 (EAGLE-3's own training:
# training-time test over 7 passes, no alignment mask) and griffin3 (Token-Guided Fusion + dual heads, alignment mask
# top-3), each one epoch over it, with the shipped heads' draft vocabulary size (8192). Rerun to resume.
# Usage, at one thread in the background:  OMP_NUM_THREADS=1 nohup bash training/recipes/smollm2-135m-eagle3.sh &
set -euo pipefail
work=${WORK:-work/eagle3}
python -m training.build_features --out "$work/features-chunk0" --max-samples 1024 --max-len 1024 --feature-layers auto
for head in "eagle3 0" "griffin3 3"; do
  set -- $head
  [ -f "$work/$1/validation.json" ] && continue
  resume=$([ -d "$work/$1/train_state" ] && echo --resume || true)
  python -m training.train --features "$work/features-chunk0" --out "$work/$1" --arch "$1" --topk "$2" \
    --draft-vocab 8192 --batch-size 4 --epochs 1 --save-every 50 $resume
done
