#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call, most important first:
#   1. the CUDA tests (pytest -m gpu), 2. benchmarks/gpu.py in fp32, bf16 and compiled,
#   3. the CPU tests with CUDA visible (they must still pin CPU and gloo; Ray, SLURM and torchft
#      tests skip or fail where those are not installed).
# Run from the repository root: bash benchmarks/gpu_session.sh [OUT_DIR] [CPU_TEST_SECONDS]
# Each phase has its own time limit, so a slow one leaves the others their results; every
# phase's whole output is written to OUT_DIR (default: gpu-session/).
set -u
out=${1:-gpu-session}
cpu_seconds=${2:-200}  # the whole call then ends within about 560 s
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cores=$(nproc)

phase() {  # phase NAME SECONDS COMMAND...: run it, keep its output, print its tail and status
    local name=$1 seconds=$2
    shift 2
    echo "=== $name (limit ${seconds}s): $*"
    local start=$SECONDS
    timeout -k 10 "$seconds" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start))s"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
        "gpus", torch.cuda.device_count())'
    echo "cores $cores"
} 2>&1 | tee "$out/machine.log"

phase gpu-tests 240 python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rs \
    tests/test_gpu.py tests/test_gpu_multi.py
phase bench-fp32 150 python3 benchmarks/gpu.py --rounds 5
phase bench-bf16 90 python3 benchmarks/gpu.py --rounds 5 --workload transformer --amp bf16
phase bench-compile 150 python3 benchmarks/gpu.py --rounds 3 --workload transformer --compile
phase cpu-tests "$cpu_seconds" python3 -m pytest -m 'not long and not gpu' -p no:cacheprovider \
    -n "$((cores - 2))" --dist loadfile -v  # -v: each result as it comes, should the limit stop it
