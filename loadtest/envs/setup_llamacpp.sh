#!/usr/bin/env bash
# Builds llama.cpp's server (llama-cpp-python 0.3.36, from its PyPI sdist, native CPU flags) in its
# own venv for the issue-9 comparison; never a dependency of specd. ~9 minutes on 2 cores.
#   loadtest/envs/setup_llamacpp.sh [VENV]   (default: loadtest/envs/llamacpp)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${1:-llamacpp}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
mkdir -p sdist
"$VENV/bin/pip" download -q --no-deps --no-binary :all: -d sdist llama-cpp-python==0.3.36
CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install "$(ls sdist/llama_cpp_python-0.3.36.tar.gz)[server]"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
