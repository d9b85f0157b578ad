#!/usr/bin/env bash
# What a lent GPU machine lacks, made here before a GPU session (docs/gpu.md; all git-ignored):
#   .whl       the server's wheels for the machine's Python 3.12, with their needs (fastapi,
#              uvicorn, sse-starlette, openai, llguidance, pydantic): scripts/gpu_checks.sh
#   .gpu/tok   SmolLM2's tokenizer files (scripts/gpu_server_smoke.py --tokenizer)
#   .gpu/whl   gguf, the one package transformers' GGUF loader needs there: scripts/gpu_train.sh
# Then `python scripts/gpu_train_pack.py` packs the head's fit (docs/gpu.md, "Training the head").
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl .gpu/whl .gpu/tok
mkdir -p .whl .gpu/whl .gpu/tok
"$PY" -m pip download -q "${PLAT[@]}" -d .whl fastapi uvicorn sse-starlette openai llguidance pydantic
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d .gpu/whl gguf==0.19.0
"$PY" - <<'PYEOF'
from engine.config import DEFAULT_TARGET
from engine.model.loader import load_model

_, tok = load_model(DEFAULT_TARGET, "bfloat16")
tok.save_pretrained(".gpu/tok")
PYEOF
du -sh .whl .gpu/whl .gpu/tok
