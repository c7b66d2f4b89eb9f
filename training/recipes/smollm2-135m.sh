#!/usr/bin/env bash
# The shipped heads for the embedded SmolLM2-135M-Instruct target, from data to checkpoints (CPU, resumable, and
# continued across machines from the committed heads). The driver is training/recipe.py; its --help describes the
# data (all of ShareGPT plus the target's own answers to first turns), the chunks, the one schedule of the five heads
# (GRIFFIN, w/o TAT, w/o TAD, HASS, EAGLE-2) and what is committed when.
#
# Usage: bash training/recipes/smollm2-135m.sh [--commit] [other training.recipe options]
#   Run from the repository root; rerun (on this or a fresh machine) to continue. At one thread, in the background:
#   nohup bash training/recipes/smollm2-135m.sh --commit > work/recipe.log 2>&1 &
#   python -m training.recipe --plan     # what is done and what comes next
#
# Time here, one thread, 2 CPU cores shared with other engineers' jobs (2026-11-23; load average about 15 while these
# ran, so a quiet machine is several times faster): ShareGPT features 190 target tokens/s (490 at a load near 2);
# K=1 training 255 tokens/s (chunk 0, 412k tokens of ShareGPT: about 25 min per head); regeneration (bf16, batch 16)
# 3-4 new tokens/s. All of it: 18 groups of 4 shards, about 7.2M ShareGPT tokens and 4,600 regenerated first turns;
# at quiet-machine rates roughly a day of one thread, so it runs across many sessions. The seconds of every step of
# every chunk are recorded as it runs in checkpoints/smollm2-135m-instruct-wip/recipe.json and README.md.
set -euo pipefail
exec python -m training.recipe "$@"
