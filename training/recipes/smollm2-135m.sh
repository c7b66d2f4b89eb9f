#!/usr/bin/env bash
# The shipped heads for the embedded SmolLM2-135M-Instruct target, from data to checkpoints (CPU, resumable, and
# continued across machines from the committed heads). The driver is the training/recipe package (python -m training.recipe); its --help describes the
# data (all of ShareGPT plus the target's own answers to first turns), the chunks, the one schedule of the five heads
# (GRIFFIN, w/o TAT, w/o TAD, HASS, EAGLE-2) and what is committed when.
#
# Usage: bash training/recipes/smollm2-135m.sh [--commit] [other training.recipe options]
#   Run from the repository root; rerun (on this or a fresh machine) to continue. At one thread, in the background:
#   nohup bash training/recipes/smollm2-135m.sh --commit > work/recipe.log 2>&1 &
#   python -m training.recipe --plan     # what is done and what comes next
#
# Time here: every step runs at one thread, two at a time (--jobs 2) on 2 CPU cores shared with other jobs. The
# complete recipe (36 chunks, 15.76M training tokens per head, 2026-11-23 to 2026-11-26, several machines, bf16 where
# the CPU has bf16 instructions, else fp32) recorded 33.8 hours of one thread: features 8.8 h, the target's answers
# 6.0 h, training the heads 19.0 h (a few early steps ran before their seconds were recorded). The seconds of every
# step of every chunk are in checkpoints/smollm2-135m-instruct-wip/recipe.json and README.md.
# Once every head has consumed every chunk: python -m training.recipe --promote   # -> checkpoints/<target>-<head>
set -euo pipefail
exec python -m training.recipe "$@"
