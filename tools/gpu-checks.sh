#!/usr/bin/env bash
# The GPU checks of runtime/BENCHMARKS.md as one prepared run on a GPU machine (CI has none), in
# order of importance (a run cut short loses the last steps only):
#   cuda-tests       tests/runtime/test_cuda.py and tests/serving/test_cuda_serving.py: the kernels
#                    compiled against their references, fused against unfused, FP8 against bf16,
#                    graphs against eager, the graph warm-up
#   step-bf16        `lopa bench step`, 7B shapes: the D2F step (k = 0) and LoPA k = 1, 3, 7 at
#                    windows 32 and 64 against the memory floor, bf16 weights, the Triton steps
#   step-fp8         the same with FP8 weights
#   step-llada       the LLaDA-8B-shaped step (bf16, k = 0, 1, 3, 7, window 32) against its floor
#   products         `lopa bench products`: a step's matrix products alone, bf16 against the Triton
#                    FP8 kernel and torch._scaled_mm, per shape at 32-256 tokens; its JSON holds the
#                    choice table the measurements suggest (LOPA_FP8_PRODUCTS)
#   sweep-7b         `lopa bench concurrency`, 7B checkpoint, k = 3: 1 and 8 in flight, two passes in a
#                    fresh process (pass 1: cold, after the start-up graph warm-up; pass 2: warm)
#   weights-7b       `lopa bench weights`: FP8 against bf16 logits on the 7B checkpoint
#   bundled-lone     the bundled model, one request at a time (and 8 in flight) at k = 0 and k = 7
#   weights-bundled  FP8 against bf16 on the bundled model: exact match, greedy agreement (k = 0, 7)
#   step-unfused     the step table again with LOPA_KERNELS=torch (the torch references), k = 0 and 7
# Each step has a time limit (554 s in all: the run is sized for under 9.5 minutes on an H200);
# every step's output is in $OUT/logs/<step>.log (each line after the epoch time it was printed at,
# beside the GPU's utilisation samples) and its JSON beside it; at the end all of it goes to one
# tarball, ${OUT:-gpu-checks}/gpu-checks.tgz.
#
# GPU_CHECKS_DEVICE=cpu GPU_CHECKS_SCALE=tiny runs every bench step with tiny settings on the CPU
# and skips the CUDA tests (tests/runtime/test_gpu_checks.py does, so the commands cannot rot).
#
# It uses the machine's python3 and torch. Wheels the machine lacks (grpcio >= 1.85.4, the stubs'
# runtime, and grpcio-health-checking: the versions of requirements/lock.txt) are installed from
# .whl/ when present; get them where PyPI is reachable:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl grpcio==1.85.4 grpcio-health-checking==1.85.1
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
logs="$out/logs"
mkdir -p "$logs"
python=${PYTHON:-python3}
device=${GPU_CHECKS_DEVICE:-cuda}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lopa-site .whl/*.whl
fi
export PYTHONPATH="/tmp/lopa-site:$PWD/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

slack=1  # the time limits' factor
if [ "${GPU_CHECKS_SCALE:-full}" = tiny ]; then
    slack=8  # a CPU's runs are the interpreter's and torch's start-up, not the GPU's work
    checkpoint="$out/tiny-checkpoint" preset=tiny llada_preset=tiny-llada dtype=bfloat16
    step_grid=(--rows 1 --widths 8 --caches 0 --ks 0,1 --step-widths 8 --step-cache 16 --batches 1,2
               --repeat 2 --copy-gb 0.01)
    llada_grid=("${step_grid[@]}")
    unfused_grid=("${step_grid[@]}")
    products=(--tokens 8,32 --repeat 2)
    sweep=(--levels 1,2 --requests 2 --max-new-tokens 4 --passes 2)
    lone=(--levels 1 --requests 1 --max-new-tokens 8)
    limit=1
else
    checkpoint=/tmp/lopa-d7b preset=dream-7b llada_preset=llada-8b dtype=bfloat16
    step_grid=(--rows 1,8 --widths 32,64 --caches 512 --ks 0,1,3,7 --step-widths 32,64 --step-cache 512
               --batches 1,8 --no-eager)
    llada_grid=(--rows 1 --widths 32 --caches 512 --ks 0,1,3,7 --step-widths 32 --step-cache 512 --batches 1
                --no-eager)
    unfused_grid=(--rows 1 --widths 32 --caches 512 --ks 0,7 --step-widths 32 --step-cache 512 --batches 1
                  --no-eager)
    products=(--tokens 32,64,128,256)
    sweep=(--levels 1,8 --requests 16 --max-new-tokens 64 --passes 2)
    lone=(--levels 1,8 --requests 16)
    limit=100
fi

step() {  # name, time limit in s, command...: its output in $logs/name.log (each line after the
    # epoch time it was printed at, to match the utilisation samples), a summary here
    local name=$1 limit=$(($2 * slack)) began=$SECONDS
    shift 2
    # `timeout` runs a program, not a shell function: lopa is this Python's module
    [ "$1" = lopa ] && set -- "$python" -m lopa "${@:2}"
    timeout "$limit" "$@" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done \
        > "$logs/$name.log"
    echo "$name: exit ${PIPESTATUS[0]} after $((SECONDS - began)) s"
    grep -E "passed|failed|skipped|error|Error|captured|\| [0-9]" "$logs/$name.log" | cut -d' ' -f2- | tail -8
}

sampler=
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader > "$logs/gpu.txt" 2>&1
    # The share of time a kernel ran, sampled every 100 ms through every step: a level whose GPU
    # idles is held back by the host, one at ~100 % by the GPU.
    nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > "$logs/gpu-util.csv" 2>&1 &
    sampler=$!
    step cuda-tests 130 "$python" -m pytest -q -p no:cacheprovider \
        tests/runtime/test_cuda.py tests/serving/test_cuda_serving.py
fi
step checkpoint 60 lopa bench write-checkpoint --preset "$preset" --out "$checkpoint" --device "$device"
step step-bf16 40 lopa bench step --preset "$preset" --device "$device" --dtype "$dtype" "${step_grid[@]}" \
    --json "$logs/step-bf16.json"
step step-fp8 50 lopa bench step --preset "$preset" --device "$device" --dtype "$dtype" --weights fp8 \
    "${step_grid[@]}" --json "$logs/step-fp8.json"
step step-llada 40 lopa bench step --preset "$llada_preset" --device "$device" --dtype "$dtype" \
    "${llada_grid[@]}" --json "$logs/step-llada.json"
step products 45 lopa bench products --preset "$preset" --device "$device" --dtype "$dtype" "${products[@]}" \
    --kernels "$([ "$device" = cuda ] && echo dtype,triton,scaled_mm || echo dtype,scaled_mm)" \
    --json "$logs/products.json"
step sweep-7b 70 lopa bench concurrency --model "$checkpoint" --device "$device" --dtype "$dtype" \
    --branches 3 "${sweep[@]}" --json "$logs/sweep-7b.json"
step weights-7b 50 lopa bench weights --model "$checkpoint" --device "$device" --dtype "$dtype" --limit 0 \
    --json "$logs/weights-7b.json"
for k in 0 7; do
    step "bundled-lone-k$k" 12 lopa bench concurrency --device "$device" --dtype "$dtype" --branches "$k" \
        "${lone[@]}" --json "$logs/bundled-lone-k$k.json"
done
step weights-bundled 20 lopa bench weights --device "$device" --dtype "$dtype" --limit "$limit" --ks 0,7 \
    --json "$logs/weights-bundled.json"
LOPA_KERNELS=torch step step-unfused 25 lopa bench step --preset "$preset" --device "$device" --dtype "$dtype" \
    "${unfused_grid[@]}" --json "$logs/step-unfused.json"
[ -n "$sampler" ] && kill "$sampler" 2> /dev/null
rm -rf "$checkpoint"
tar -czf "$out/gpu-checks.tgz" -C "$out" logs && rm -rf "$logs"
