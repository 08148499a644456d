#!/usr/bin/env bash
# The GPU checks of runtime/BENCHMARKS.md as one run on a GPU machine (CI has none):
# the CUDA tests, then the concurrency sweeps of the 7B-shaped random checkpoint
# (it prints its measured branch budget and, per level, the CUDA graphs it captured), with every
# round captured, with large rounds eager (LOPA_CUDA_GRAPH_TOKENS) and with the layers' elementwise
# steps compiled (LOPA_TORCH_COMPILE), torch.profiler tables of the first two, and the GPU's
# utilisation.
# Every step has a time limit (670 s in all, most steps finish well within theirs: a run limited to
# 600 s may cut the last sweep short, whose log is still under $OUT/logs); when the script
# finishes, the logs and JSON go to one tarball, ${OUT:-gpu-checks}/gpu-checks.tgz.
# It uses the machine's python3 and torch. Wheels the machine lacks (grpcio >= 1.85.1,
# grpcio-health-checking) are installed from .whl/ when present; get them where PyPI is reachable:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl grpcio==1.85.3 grpcio-health-checking==1.85.1
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
logs="$out/logs"
mkdir -p "$logs"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lopa-site .whl/*.whl
fi
export PYTHONPATH="/tmp/lopa-site:$PWD/runtime" PYTHONUNBUFFERED=1

step() {  # name, time limit in s, command...: its output in $logs/name.log (each line after the
    # epoch time it was printed at, to match the utilisation samples), a summary here
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    timeout "$limit" "$@" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done \
        > "$logs/$name.log"
    echo "$name: exit ${PIPESTATUS[0]} after $((SECONDS - began)) s"
    grep -E "passed|failed|skipped|error|budget|\| [0-9]" "$logs/$name.log" | cut -d' ' -f2- | tail -8
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$logs/gpu.txt" 2>&1
# The share of time a kernel ran, sampled every 100 ms through every step: a batched level whose
# GPU idles is held back by the host, one at ~100 % by the GPU.
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > "$logs/gpu-util.csv" 2>&1 &
sampler=$!
step cuda-tests 130 python3 -m pytest -q -p no:cacheprovider \
    tests/runtime/test_cuda.py tests/serving/test_cuda_serving.py
step checkpoint 90 python3 -m lopa bench write-checkpoint --preset dream-7b --out /tmp/lopa-d7b --device cuda
# Two passes: the first pays the graph captures (columns captures, capture_s), the second runs warm;
# then 16 in flight once more under torch.profiler (kernels by device time, how busy the GPU was).
step sweep-7b 170 python3 -m lopa bench concurrency --model /tmp/lopa-d7b --device cuda --dtype bfloat16 \
    --levels 1,8,16 --requests 32 --branches 3 --max-new-tokens 64 --passes 2 --json "$logs/sweep-7b.json" \
    --profile "$logs/profile-7b"
# The same with rounds of more than 256 linear tokens run eagerly (no captures for them; a lone
# request's rounds stay captured while its 4 rows' window is at most 64 wide): compare the speedups,
# each over its own run's lone level. Its profile attributes the eager rounds' kernels to their ops
# and input shapes.
LOPA_CUDA_GRAPH_TOKENS=256 step sweep-7b-eager-large 150 python3 -m lopa bench concurrency \
    --model /tmp/lopa-d7b --device cuda --dtype bfloat16 --levels 1,8 --requests 32 --branches 3 \
    --max-new-tokens 64 --passes 2 --json "$logs/sweep-7b-eager-large.json" \
    --profile "$logs/profile-7b-eager-large"
# The layers' elementwise steps fused by torch.compile (every round captured): last, as the least
# sure to fit; the logs are kept even when a time limit on the whole run cuts it short.
LOPA_TORCH_COMPILE=1 step sweep-7b-compiled 130 python3 -m lopa bench concurrency --model /tmp/lopa-d7b \
    --device cuda --dtype bfloat16 --levels 1,8 --requests 32 --branches 3 --max-new-tokens 64 \
    --passes 2 --json "$logs/sweep-7b-compiled.json"
kill "$sampler" 2> /dev/null
tar -czf "$out/gpu-checks.tgz" -C "$out" logs && rm -rf "$logs"
