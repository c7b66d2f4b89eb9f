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
# Time here (2 shared CPU cores, one thread; each chunk's steps are recorded in
# checkpoints/smollm2-135m-instruct-wip/recipe.json and README.md as they run): see benchmarks/results/
# pipeline-throughput.md for the rates of each step.
set -euo pipefail
exec python -m training.recipe "$@"
