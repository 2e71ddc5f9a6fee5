#!/usr/bin/env bash
# A whole GPU check in one command, for a machine lent for a few minutes (a CUDA image with torch and Triton but
# not the web stack): install the wheels `make gpu-wheels` left in .gpu-wheels (carry that folder), then the
# gpu-marked tests, `make gpu-bench` for issue 14's models, a batch-1 sweep of the decode stacks' launch choices
# and a profile of mingru-100m's host loop at batch 256 (where the engine step loses to the model step).
# Each part has a time limit of its own (seconds, from the environment) so that a hang in one still leaves the
# others' logs; every log goes to $OUT (default ./gpu-check).
#
#   OUT=/tmp/out bash scripts/gpu_check.sh            # ~10 minutes on an H200 (PYTHON: python3)
#   TESTS_S=0 TUNE_S=0 bash scripts/gpu_check.sh      # the benchmark alone
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PYTHON=${PYTHON:-python3}
TESTS_S=${TESTS_S:-180}
BENCH_S=${BENCH_S:-240}
TUNE_S=${TUNE_S:-120}
HOST_S=${HOST_S:-45}
BENCH_MODELS=${BENCH_MODELS:-mamba-370m mamba2-370m mingru-100m}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu-wheels/*.whl || exit 1
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu-wheels/optional/*.whl 2>/dev/null || echo "optional wheels not installed (structured outputs off)"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{ nvidia-smi; "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$OUT/device.txt" 2>&1
# A part with a limit of 0 is skipped; each part's status is printed whatever it was.
part() {
    local name=$1 limit=$2
    shift 2
    [ "$limit" -gt 0 ] || return 0
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (log: $OUT/$name.log)"
    tail -n 40 "$OUT/$name.log"
}
part gpu-tests "$TESTS_S" "$PYTHON" -m pytest -q -m gpu -rfE tests/gpu tests/engine/test_looped.py
# shellcheck disable=SC2086  # the models are words
part gpu-bench "$BENCH_S" "$PYTHON" benchmarks/gpu_bench.py --models $BENCH_MODELS --batches 1 256 \
    --concurrency 256 --engine-process on --api-servers 4
part decode-tune "$TUNE_S" "$PYTHON" benchmarks/decode_tune.py --batches 1 --steps 100
part host-loop "$HOST_S" "$PYTHON" benchmarks/host_loop.py --device cuda --dtype bf16 --presets mingru-100m \
    --batch 256 --steps 50 --kinds final_only delta --profile
