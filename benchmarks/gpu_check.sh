#!/usr/bin/env bash
# The CUDA tier and the GPU benchmarks on a lent GPU machine, in one command from the repository root (no network):
#
#     bash benchmarks/gpu_check.sh                     # results and logs in $OUT (default ./gpu-check)
#     GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh    # the same steps at tiny sizes: checks this script on a CPU
#
# Steps, each under its own time limit and all of them within GPU_CHECK_BUDGET seconds (default 500):
#   0. smoke: the package imports and the batching benchmark runs at the tiny shape; if not, nothing else runs
#   1. environment: nvidia-smi, python, torch and CUDA, transformers, accelerate       -> summary.txt
#   2. python -m pytest -v -m cuda   (the CUDA tier: lossless at bf16/fp16, batches, fused heads, training)
#                                                                                        -> pytest-cuda.log
#      (GPU_CHECK_TESTS=0 skips it)
#   3. python -m benchmarks.gpu_batching --shape llama2-7b                               -> batching-<gpu>.json
#      (GPU_CHECK_BATCHING=0 skips it)
#   4. python -m benchmarks.gpu_engine --shapes llama2-7b                                 -> engine-<gpu>.json
#   5. python -m benchmarks.gpu_engine --shapes llama3-8b                                 -> the same file
#   6. python -m benchmarks.gpu_engine --shapes llama2-7b --quick --compile --tag compile -> engine-<gpu>-compile.json
#      (with the time left; GPU_CHECK_COMPILE=0 skips it, and tiny runs skip it unless GPU_CHECK_COMPILE=1)
# GPU_CHECK_SHAPES="llama3-8b" picks the shapes of steps 4-5; GPU_CHECK_QUICK=1 runs them with --quick.
# Benchmark output goes to bench.log. The results' JSON files are copied to $OUT after every step (their markdown
# is made again from them: `python -m benchmarks.gpu_engine --table FILE.json`, the same for gpu_batching), so $OUT
# holds at most 6 files. GPU_CHECK_TESTS_LIMIT (default 300) bounds the test tier, GPU_CHECK_TEST_TIMEOUT (180) a
# test; each failure's report is logged when it happens (GRIFFIN_PRINT_FAILURES=1), so a stopped tier still says why.
# Exit code: the first failing step's (0: all passed).
set -u
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}  # the GPU image has python3 (its torch), not always python
BUDGET=${GPU_CHECK_BUDGET:-500}
mkdir -p "$OUT"
results=$(mktemp -d)
summary="$OUT/summary.txt"
: >"$summary"
start=$(date +%s)
status=0
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 GRIFFIN_LOG=${GRIFFIN_LOG:-INFO} GRIFFIN_PRINT_FAILURES=1

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
    read -ra shapes <<<"${GPU_CHECK_SHAPES:-tiny}"
    compile=${GPU_CHECK_COMPILE:-0}
else
    read -ra shapes <<<"${GPU_CHECK_SHAPES:-llama2-7b llama3-8b}"
    compile=${GPU_CHECK_COMPILE:-1}
fi
quick=()
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && quick=(--quick)

step() {  # step NAME LIMIT LOG COMMAND...: runs COMMAND under min(LIMIT, time left) and notes the outcome
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET - ($(date +%s) - start)))
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        echo "$name: skipped (${left}s left of ${BUDGET}s)" >>"$summary"
        return
    fi
    local t0 rc verdict
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) verdict=ok ;;
        124 | 137) verdict="stopped at its time limit" ;;
        *) verdict=failed ;;
    esac
    echo "$name: $verdict (exit $rc, $(($(date +%s) - t0)) s)" >>"$summary"
    ((rc != 0 && status == 0)) && status=$rc
    cp "$results"/*.json "$OUT"/ 2>/dev/null
    return $rc
}

{
    echo "== environment ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    else
        echo "no nvidia-smi"
    fi
    "$PY" -c "import sys, torch, transformers, accelerate
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| transformers', transformers.__version__, '| accelerate', accelerate.__version__)
print('GPU:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>&1
    echo "== steps"
} >>"$summary"

if ! step "smoke" 90 "$OUT/bench.log" "$PY" -m benchmarks.gpu_batching --shape tiny --batch-sizes 1,2 --chains 2 \
    --new-tokens 8 --prompt-len 16 --out-dir "$(mktemp -d)"; then
    echo "total $(($(date +%s) - start)) s, exit $status: the smoke step failed, nothing else ran" >>"$summary"
    cat "$summary"
    exit $status
fi
if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
    per_test=()  # a hung test stops alone, where pytest-timeout is installed
    "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${GPU_CHECK_TEST_TIMEOUT:-180}")
    step "CUDA tests" "${GPU_CHECK_TESTS_LIMIT:-300}" "$OUT/pytest-cuda.log" "$PY" -m pytest -v -m cuda -rs \
        --durations=20 -p no:cacheprovider "${per_test[@]}"
fi
if [ "${GPU_CHECK_BATCHING:-1}" = 1 ]; then
    if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
        batching=(--shape tiny --batch-sizes 1,2 --new-tokens 16 --prompt-len 32)
    else
        batching=(--shape llama2-7b)
    fi
    step "batching ${batching[1]}" 120 "$OUT/bench.log" "$PY" -m benchmarks.gpu_batching "${batching[@]}" \
        --out-dir "$results"
fi
for shape in "${shapes[@]}"; do
    step "benchmark $shape" 140 "$OUT/bench.log" "$PY" -m benchmarks.gpu_engine --shapes "$shape" "${quick[@]}" \
        --out-dir "$results"
done
if [ "$compile" = 1 ]; then
    step "benchmark ${shapes[0]} with torch.compile" 300 "$OUT/bench.log" \
        "$PY" -m benchmarks.gpu_engine --shapes "${shapes[0]}" --quick --compile --tag compile --out-dir "$results"
fi
echo "total $(($(date +%s) - start)) s, exit $status" >>"$summary"
cat "$summary"
exit $status
