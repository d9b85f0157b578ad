#!/usr/bin/env bash
# The GPU checks of issue 21, in one run on a lent GPU (the device tool): run from the repo root,
# with .whl (the server's wheels) and .gpu/tok (the SmolLM2 tokenizer files) carried, and $OUT set
# (not the whole .gpu: it also holds the packed fit's parts, over a call's 64 MiB).
#   phases: env, tests (engine tests with SPECD_TEST_DEVICE=cuda), server (specd serve on the
#   GPU, the official client), bench (loadtest/bench/gpu.py: Llama-3.1-8B shapes), slow (the
#   distribution tests), probe (scripts/gpu_probe.py: a decode layer's kernels and time, by
#   variant). PHASES="tests bench" runs some; each phase has its own time limit.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PHASES=${PHASES:-"env tests server bench compiling slow"}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 || echo "pip install FAILED"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
has() { case " $PHASES " in *" $1 "*) return 0;; esac; return 1; }

if has env; then
  say env
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
  python3 -c 'import fastapi, uvicorn, sse_starlette, openai, pydantic, llguidance; print("server deps ok")' 2>&1 | tail -1
fi
# the engine tests that take a device, in two groups: the quick ones, then those that compile
# with inductor on the GPU (cold cache: tens of seconds each). SIGINT at the time limit, so that
# pytest still prints its summary of failures.
QUICK="tests/engine/model/test_cuda_graphs.py tests/engine/round/test_round.py tests/engine/round/test_spec_coverage.py
  tests/engine/model/test_model_runner.py tests/engine/model/test_kv_cache.py tests/engine/round/test_rejection.py
  tests/engine/round/test_sampling.py tests/engine/round/test_penalties.py tests/engine/round/test_forced.py
  tests/engine/drafters/eagle/test_eagle.py tests/engine/drafters/eagle/test_eagle_paths.py tests/engine/drafters/test_hybrid.py
  tests/engine/requests/test_engine_stops.py
  tests/engine/worker/test_worker.py tests/engine/round/test_transfer.py tests/engine/requests/test_prefill.py
  tests/engine/model/test_tree_verify.py tests/engine/round/test_tree.py tests/engine/round/test_draft_tree.py
  tests/engine/model/test_blocks.py tests/engine/model/test_prefix_cache.py tests/engine/test_prefix_caching.py
  tests/engine/test_preemption.py tests/engine/test_paged_kv.py"
COMPILING="tests/engine/model/test_fast_forward.py"
pytest_cuda() {  # name, time limit, pytest arguments...
  local name=$1 limit=$2; shift 2
  SPECD_TEST_DEVICE=cuda timeout -s INT -k 15 "$limit" python3 -m pytest -q -rfE --tb=short \
    -p no:cacheprovider --timeout 120 "$@" >"$OUT/pytest_$name.log" 2>&1
  say "exit $?"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/pytest_$name.log" | tail -30
}
if has probe; then
  say "probe: a decode layer's kernels and time (8B shapes)"
  timeout ${T_PROBE:-150} python3 scripts/gpu_probe.py ${PROBE_ARGS:-} --json "$OUT/probe.json" >"$OUT/probe.log" 2>&1
  say "exit $?"; grep -E "^(==|torch|  sdpa|inductor)" "$OUT/probe.log" | head -40
fi
if has tests; then
  say "engine tests on cuda (quick)"
  pytest_cuda quick ${T_TESTS:-100} -m "not slow and not full and not real_model" $QUICK
fi
if has server; then
  say "server on the GPU, official client"
  timeout ${T_SERVER:-100} python3 scripts/gpu_server_smoke.py --tokenizer .gpu/tok --log "$OUT/server.log" \
    >"$OUT/smoke.log" 2>&1
  say "exit $?"; tail -20 "$OUT/smoke.log"
fi
if has bench; then
  say "bench: Llama-3.1-8B shapes"
  timeout ${T_BENCH:-260} python3 -m loadtest.bench.gpu ${BENCH_ARGS:-} --json "$OUT/gpu_bench.json" >"$OUT/gpu_bench.log" 2>&1
  say "exit $?"; tail -60 "$OUT/gpu_bench.log"
fi
if has compiling; then
  say "engine tests on cuda (inductor compiles)"
  pytest_cuda compiling ${T_COMPILING:-100} -m "not slow and not full and not real_model" $COMPILING
fi
if has slow; then
  say "distribution tests on cuda (slow: the compiled paths)"
  pytest_cuda slow ${T_SLOW:-100} -m "slow and not full and not real_model" -k "compiled or adaptive" \
    tests/engine/test_engine_distribution.py
fi
say done
