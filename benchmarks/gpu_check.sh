#!/usr/bin/env bash
# Issue 14 on a lent GPU machine, in one command from the repository root (needs no network):
#
#     bash benchmarks/gpu_check.sh                     # results and logs in $OUT (default ./gpu-check)
#     GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh    # the same steps at tiny sizes: checks this script on a CPU
#
# Steps, each under its own time limit and all of them within GPU_CHECK_BUDGET seconds (default 500):
#   1. environment: nvidia-smi, python, torch and CUDA, transformers, accelerate       -> summary.txt
#   2. python -m pytest -v -m cuda   (the CUDA tier: lossless at bf16/fp16, training)   -> pytest-cuda.log
#      (GPU_CHECK_TESTS=0 skips it)
#   3. python -m benchmarks.gpu_engine --shapes llama2-7b                                 -> engine-<gpu>.{json,md}
#   4. python -m benchmarks.gpu_engine --shapes llama3-8b                                 -> the same files
#   5. python -m benchmarks.gpu_engine --shapes llama2-7b --quick --compile --tag compile -> engine-<gpu>-compile.*
#      (with the time left; GPU_CHECK_COMPILE=0 skips it, and tiny runs skip it unless GPU_CHECK_COMPILE=1)
# GPU_CHECK_SHAPES="llama3-8b" picks the shapes of steps 3-4; GPU_CHECK_QUICK=1 runs them with --quick.
# Benchmark output goes to bench.log. At most 7 files in $OUT. Exit code: the first failing step's (0: all passed).
set -u
OUT=${OUT:-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-500}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: >"$summary"
start=$(date +%s)
status=0
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 GRIFFIN_LOG=${GRIFFIN_LOG:-INFO}

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
}

{
    echo "== environment ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    else
        echo "no nvidia-smi"
    fi
    python -c "import sys, torch, transformers, accelerate
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| transformers', transformers.__version__, '| accelerate', accelerate.__version__)
print('GPU:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>&1
    echo "== steps"
} >>"$summary"

if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
    step "CUDA tests" 240 "$OUT/pytest-cuda.log" python -m pytest -v -m cuda -rs --durations=20 -p no:cacheprovider
fi
for shape in "${shapes[@]}"; do
    step "benchmark $shape" 140 "$OUT/bench.log" python -m benchmarks.gpu_engine --shapes "$shape" "${quick[@]}" \
        --out-dir "$OUT"
done
if [ "$compile" = 1 ]; then
    step "benchmark ${shapes[0]} with torch.compile" 300 "$OUT/bench.log" \
        python -m benchmarks.gpu_engine --shapes "${shapes[0]}" --quick --compile --tag compile --out-dir "$OUT"
fi
echo "total $(($(date +%s) - start)) s, exit $status" >>"$summary"
cat "$summary"
exit $status
