#!/usr/bin/env bash
# One prepared check of promptcache on a machine with one NVIDIA GPU, PyTorch preinstalled and no
# network, in at most 8 minutes (the step caps add up to 480 s). Design: docs/benchmarks.md, "GPU".
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--smoke]
#   STEPS="0 2 3" scripts/gpu_check.sh          # only these steps
#   scripts/gpu_check.sh --device cpu --smoke    # every step, tiny, on this CPU: argument errors cost no GPU time
#
# | step | what                                                                   | cap   | output          |
# | 0    | probe: GPU, torch/transformers/triton versions, the attention op schemas | 20 s  | env.json        |
# | 1    | CPU control: one exactness test on this machine's transformers          | 30 s  | check.log       |
# | 2    | CUDA tests (test_cuda.py, the Triton kernels, graphs, static steps, sampling), then tiny-model tests
# |      | with PROMPTCACHE_TEST_DEVICE=cuda                                        | 110 s | junit.xml       |
# | 3    | attention microbenchmark: B = 32, 8K shared + 256 own, bf16             | 50 s  | attention.jsonl |
# | 4    | TTFT at 4K, ~1B Llama shape, bf16: cached modules (graphs on, off; the engine's own ttft_ms and
# |      | prefill_ms beside wall time) vs HF full prefill                          | 70 s  | ttft.jsonl      |
# | 5    | engine decode B = 32 x 8K shared: shared / per-sequence SDPA / no attention, each eager and replayed
# |      | from a CUDA graph; a profiled step eager and graphed (device kernels, host launches) | 110 s | decode.jsonl |
# | 6    | promptcache serve --device cuda: PML, chat, exact repeat; GPU memory over 1,000 requests | 90 s | check.log |
# Every step's exit status and duration: steps.jsonl. Results go to $OUT when set (the device machine's
# return folder), else benchmarks/results/gpu/ ($TMPDIR/promptcache_gpu_smoke with --smoke). The C++
# CPU-kernel tests never run here.
#
# Wheels: the GPU machine has Python 3.12 with torch, transformers, triton, numpy, lxml, httpx,
# prometheus-client, pytest, pytest-timeout, jinja2, tokenizers and sentencepiece. What else the tests
# and the server import travels as cp312 manylinux x86_64 wheels in .whl/ (ignored by git, ~4.3 MiB),
# pinned in scripts/gpu_wheels.txt: redis, xxhash, pytest-asyncio; for the server step also fastapi,
# starlette, opentelemetry-api, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# typing-inspection, annotated-types, typing-extensions, uvicorn, limits, deprecated, hiredis.
# Fetch them once, where pip reaches PyPI, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl -r scripts/gpu_wheels.txt
# They are installed into /tmp/site (never into the machine's Python) when this runs on Python 3.12.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DEVICE=cuda
SMOKE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --smoke) SMOKE="--smoke"; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--smoke]" >&2; exit 2 ;;
  esac
done
STEPS="${STEPS:-0 1 2 3 4 5 6}"
for step in $STEPS; do
  case "$step" in [0-6]) ;; *) echo "STEPS: '$step' is not a step; expected numbers 0 to 6" >&2; exit 2 ;; esac
done
RESULTS="${OUT:-$ROOT/benchmarks/results/gpu}"
[ -n "$SMOKE" ] && [ -z "${OUT:-}" ] && RESULTS="${TMPDIR:-/tmp}/promptcache_gpu_smoke"  # smoke output is not a result
mkdir -p "$RESULTS"
LOG="$RESULTS/check.log"
: >"$RESULTS/steps.jsonl"
: >"$LOG"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ls .whl/*.whl >/dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
  export PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH#"$ROOT"}"
fi

PYTEST=(python3 -m pytest -q -p no:cacheprovider)
# The tiny-model tests step 2 moves to the device (test_cuda.py names its device itself).
DEVICE_TESTS=(tests/model_runtime/test_cuda.py tests/model_runtime/test_attention_backend.py
  tests/model_runtime/test_sampling_device.py tests/model_runtime/test_exactness.py
  tests/model_runtime/test_module_reuse.py tests/model_runtime/test_engine.py
  tests/model_runtime/test_prefix_reuse.py tests/model_runtime/test_generation.py
  tests/model_runtime/test_kv_pool.py tests/model_runtime/test_torch_layer_ops.py
  tests/model_runtime/test_triton_decode.py tests/model_runtime/test_triton_shared.py
  tests/model_runtime/test_cuda_graphs.py tests/model_runtime/test_static_step.py
  tests/model_runtime/test_graphed_greedy.py tests/model_runtime/test_own_decode.py
  tests/model_runtime/test_sampling_batch.py tests/model_runtime/test_sampling_processors.py
  tests/model_runtime/test_sampling_syncs.py)
# What step 2 runs in a CPU smoke run (the rest only collects there): the static step and its greedy path.
SMOKE_TESTS=(tests/model_runtime/test_static_step.py tests/model_runtime/test_graphed_greedy.py)

step_0() {
  DEVICE="$DEVICE" python3 - "$RESULTS/env.json" <<'EOF'
import importlib, json, os, platform, sys
import torch
ops = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
       "_flash_attention_forward", "_efficient_attention_forward"]
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": os.environ["DEVICE"], "cuda_available": torch.cuda.is_available(),
       "op_schemas": {op: str(getattr(torch.ops.aten, op).default._schema) for op in ops}}
for name in ("transformers", "triton", "flash_attn", "flashinfer", "fastapi", "redis", "pytest_asyncio"):
    try:
        env[name] = getattr(importlib.import_module(name), "__version__", "present")
    except Exception as error:  # absent, or broken against this torch
        env[name] = f"unavailable: {type(error).__name__}"
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    env |= {"gpu": props.name, "sms": props.multi_processor_count, "gpu_memory_gb": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}"}
with open(sys.argv[1], "w") as out:
    json.dump(env, out, indent=1)
print(json.dumps(env))
EOF
}

step_1() {
  PROMPTCACHE_TEST_DEVICE=cpu "${PYTEST[@]}" "tests/model_runtime/test_exactness.py::test_no_optional_parts_is_exact[llama]"
}

step_2() {
  if [ -n "$SMOKE" ]; then  # a CPU smoke run: every file collects (imports, markers), the static step runs
    "${PYTEST[@]}" --collect-only "${DEVICE_TESTS[@]}" >/dev/null || return 1
    PROMPTCACHE_TEST_DEVICE="$DEVICE" "${PYTEST[@]}" --junitxml="$RESULTS/junit.xml" "${SMOKE_TESTS[@]}"
    return
  fi
  PROMPTCACHE_TEST_DEVICE="$DEVICE" "${PYTEST[@]}" --junitxml="$RESULTS/junit.xml" "${DEVICE_TESTS[@]}"
}

step_3() {
  python3 -m benchmarks.kernels.gpu_attention --device "$DEVICE" $SMOKE --out "$RESULTS/attention.jsonl"
}

step_4() {
  python3 -m benchmarks.engine.gpu_ttft --device "$DEVICE" $SMOKE --out "$RESULTS/ttft.jsonl"
}

step_5() {
  python3 -m benchmarks.engine.gpu_decode --device "$DEVICE" $SMOKE --out "$RESULTS/decode.jsonl"
}

step_6() {
  python3 scripts/gpu_serve_check.py --device "$DEVICE" --requests "$([ -n "$SMOKE" ] && echo 50 || echo 1000)"
}

NAMES=(probe cpu_control cuda_tests attention ttft decode serve)
IS_SMOKE=$([ -n "$SMOKE" ] && echo true || echo false)
CAPS=(20 30 110 50 70 110 90)  # on an H200: tests 36 s; serve 27-37 s before the 1,000 requests
failed=0
started_all=$(date +%s)
for step in $STEPS; do
  name=${NAMES[$step]}
  cap=${CAPS[$step]}
  echo "=== step $step: $name (cap ${cap} s, device $DEVICE${SMOKE:+, smoke})" | tee -a "$LOG"
  started=$(date +%s.%N)
  # SIGINT first: pytest still writes its junit report; then KILL 5 s later.
  timeout -s INT -k 5 "$cap" bash -c "$(declare -f "step_$step"); $(declare -p DEVICE SMOKE RESULTS PYTEST DEVICE_TESTS SMOKE_TESTS); step_$step" \
    2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  seconds=$(python3 -c "import time; print(round(time.time() - $started, 1))")
  echo "{\"step\": $step, \"name\": \"$name\", \"rc\": $rc, \"seconds\": $seconds, \"cap_s\": $cap, \"device\": \"$DEVICE\", \"smoke\": $IS_SMOKE}" \
    | tee -a "$RESULTS/steps.jsonl"
  [ "$rc" -eq 0 ] || failed=1
done
echo "gpu_check: done in $(( $(date +%s) - started_all )) s; results in $RESULTS" | tee -a "$LOG"
exit $failed
