#!/usr/bin/env bash
# The shipped heads for the embedded SmolLM2-135M-Instruct target, from data to checkpoints (CPU, resumable).
#
# Every head follows the same three-stage schedule on the same features and differs only in what the paper's
# ablation varies: stage 1 trains K=1 (EAGLE training) for several epochs, stages 2 and 3 continue from the previous
# stage with K=2 and K=3 passes (K stays 1 for the single-pass heads). Stage 1 is shared by the heads of one
# architecture.
#
#   GRIFFIN   griffin  K=1,2,3  top-3 alignment mask
#   w/o TAT   griffin  K=1,1,1
#   w/o TAD   eagle    K=1,2,3  top-3 alignment mask
#   HASS      eagle    K=1,2,3  no mask (topk 0)
#   EAGLE-2   eagle    K=1,1,1
#
# Usage: bash training/recipes/smollm2-135m.sh [WORKDIR]   (rerun to resume after a kill)
#   CHAIN=griffin or CHAIN=eagle trains one architecture's heads only: once the features exist, two such runs with
#   OMP_NUM_THREADS=1 each use two cores better than one run with both. S1_EPOCHS (default 8) and EPOCHS (default 1)
#   set the epochs of the shared first stage and of each later stage.
set -euo pipefail
work=${1:-work}
data=$work/regen
features=$work/features
heads=$work/heads
common=(--features "$features" --draft-vocab 8192 --batch-size 4 --mixed-precision bf16 --save-every 100)
first=${S1_EPOCHS:-8}  # epochs of the shared K=1 stage
later=${EPOCHS:-1}     # epochs of each later stage

# 1. answers written by the target itself (greedy) for the first turns of the first 1536 ShareGPT records
python -m training.regenerate --out "$data" --max-samples 1536 --max-new-tokens 320 --batch-size 48 --dtype bf16
# 2. target features (bf16 compute, stored as bf16): the regenerated conversations, then 600 original ShareGPT ones
n=$(wc -l < "$data/conversations.jsonl")
python -m training.build_features --data "$data/conversations.jsonl" sharegpt --max-samples $((n + 600)) \
  --out "$features" --max-len 768 --dtype bf16

stage() {  # stage OUT ARCH STEPS TOPK LR EPOCHS [INIT]
  local out=$1 arch=$2 steps=$3 topk=$4 lr=$5 epochs=$6 init=${7:-}
  if [ -f "$out/validation.json" ] && [ -f "$out/model.safetensors" ]; then return; fi
  local resume=()
  [ -d "$out/train_state" ] && resume=(--resume)
  python -m training.train "${common[@]}" --out "$out" --arch "$arch" --steps "$steps" --topk "$topk" --lr "$lr" \
    --epochs "$epochs" ${init:+--init-from "$init"} "${resume[@]}"
}

chain=${CHAIN:-all}
if [ "$chain" = all ] || [ "$chain" = griffin ]; then
  stage "$heads/griffin-s1" griffin 1 3 1e-3 "$first"
  stage "$heads/griffin-s2" griffin 2 3 6e-4 "$later" "$heads/griffin-s1"
  stage "$heads/griffin" griffin 3 3 6e-4 "$later" "$heads/griffin-s2"
  stage "$heads/griffin-k1-s2" griffin 1 3 6e-4 "$later" "$heads/griffin-s1"
  stage "$heads/griffin-k1" griffin 1 3 6e-4 "$later" "$heads/griffin-k1-s2"
  names=(griffin griffin-k1)
fi
if [ "$chain" = all ] || [ "$chain" = eagle ]; then
  stage "$heads/eagle-s1" eagle 1 3 1e-3 "$first"
  stage "$heads/eagle2-s2" eagle 1 3 6e-4 "$later" "$heads/eagle-s1"
  stage "$heads/eagle2" eagle 1 3 6e-4 "$later" "$heads/eagle2-s2"
  stage "$heads/hass-s2" eagle 2 0 6e-4 "$later" "$heads/eagle-s1"
  stage "$heads/hass" eagle 3 0 6e-4 "$later" "$heads/hass-s2"
  stage "$heads/eagle-tat-s2" eagle 2 3 6e-4 "$later" "$heads/eagle-s1"
  stage "$heads/eagle-tat" eagle 3 3 6e-4 "$later" "$heads/eagle-tat-s2"
  names=(${names[@]+"${names[@]}"} eagle2 hass eagle-tat)
fi
declare -A label=([griffin]=GRIFFIN [griffin-k1]="GRIFFIN w/o TAT" [eagle2]=EAGLE-2 [hass]=HASS
                   [eagle-tat]="GRIFFIN w/o TAD")
for name in "${names[@]}"; do
  python -m training.export "$heads/$name" "checkpoints/smollm2-135m-instruct-$name" --name "${label[$name]}" \
    --notes "Built by training/recipes/smollm2-135m.sh: greedy answers of the target to the first turns of the \
first 1536 ShareGPT records plus 600 original ShareGPT conversations, up to 768 tokens."
done
