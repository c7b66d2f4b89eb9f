#!/usr/bin/env bash
# The shipped heads for the embedded SmolLM2-135M-Instruct target, from data to checkpoints (CPU, resumable). The
# driver is python -m training.recipe (the training/recipe package); its --help describes the data (all of ShareGPT
# plus the target's own answers to first turns), the chunks, the one schedule of the five heads (GRIFFIN, w/o TAT,
# w/o TAD, HASS, EAGLE-2) and what survives a machine.
#
# Usage: bash training/recipes/smollm2-135m.sh [other training.recipe options]
#   Run from the repository root; rerun to continue (from work/recipe/heads, or on a fresh clone from the record of
#   the shipped heads). At one thread, in the background:
#   nohup bash training/recipes/smollm2-135m.sh --jobs 2 > work/recipe.log 2>&1 &
#   python -m training.recipe --plan     # what is done and what comes next
#
# Time here: every step runs at one thread, two at a time (--jobs 2) on 2 CPU cores shared with other jobs. The
# complete recipe (36 chunks, 15.76M training tokens per head, 2026-11-23 to 2026-11-26, several machines, bf16 where
# the CPU has bf16 instructions, else fp32) recorded 33.8 hours of one thread: features 8.8 h, the target's answers
# 6.0 h, training the heads 19.0 h (a few early steps ran before their seconds were recorded). The seconds of every
# step of every chunk are in benchmarks/results/recipe/recipe.json and progress.md.
# Once every head has consumed every chunk: python -m training.recipe --promote   # -> checkpoints/<target>-<head>
set -euo pipefail
exec python -m training.recipe "$@"
