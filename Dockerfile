# specd's image, two variants of one file (see docs/operations.md, "Deployment"):
#   GPU: docker build -t specd .
#        (base nvidia/cuda:13.0.2-runtime-ubuntu24.04: PyPI's torch 2.13.0 is built for CUDA 13.0)
#   CPU: docker build -t specd:cpu --build-arg VARIANT=cpu --build-arg BASE_IMAGE=debian:bookworm-slim .
#        (torch's CPU wheel from https://download.pytorch.org/whl/cpu: a 1.9 GB image, not ~6 GB)
# scripts/test_image.sh builds and runs the CPU variant on a development machine (a Debian bookworm
# base made with debootstrap, the legacy builder, read-only root, the compiled forward checked),
# and builds the GPU variant on an Ubuntu 24.04 stand-in for the CUDA base (checked without a GPU).
# Bases: Debian or Ubuntu with python3 3.11 or 3.12 (the locks' versions have wheels for both); a user
# `ubuntu` (uid 1000 on Ubuntu 24.04) is removed so that `specd` gets uid/gid 1000 (the chart's
# runAsUser).
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# VARIANT: cuda | cpu: the lock file installed (docker/requirements-<VARIANT>.txt) and SPECD_DEVICE.
ARG VARIANT=cuda
# TORCH_INDEX_URL: an extra index holding the lock's torch wheel; empty: PyPI (cuda) or
# https://download.pytorch.org/whl/cpu (cpu). scripts/test_image.sh points it at a local copy.
ARG TORCH_INDEX_URL=

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 VIRTUAL_ENV=/opt/specd PATH=/opt/specd/bin:$PATH
# g++ and python3-dev: torch.compile's CPU kernels are C++ that includes Python.h (without them the
# compiled forward fails and specd serves eagerly), and specd's 4-bit CPU kernel is compiled on first
# use (engine/model/q4_matmul.py; without a compiler torch's int4 kernel serves instead)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ curl \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/specd \
 && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && if getent group ubuntu >/dev/null; then groupdel ubuntu; fi \
 && groupadd --gid 1000 specd && useradd --create-home --uid 1000 --gid 1000 specd \
 && mkdir -p /models /cache && chown specd:specd /models /cache

# the dependency layer: only the lock file, so that a code change reuses it
COPY docker/requirements-${VARIANT}.txt /tmp/requirements.txt
RUN index="$TORCH_INDEX_URL" \
 && if [ -z "$index" ] && [ "$VARIANT" = cpu ]; then index=https://download.pytorch.org/whl/cpu; fi \
 && pip install --no-deps ${index:+--extra-index-url "$index"} -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY loadtest loadtest
COPY train train
COPY prompts prompts
COPY configs configs
COPY models models
# the project alone (its dependencies are the layer above; setuptools is in the lock: no download)
RUN pip install --no-deps --no-build-isolation . && rm -rf build ./*.egg-info

USER specd
# Everything specd writes goes to the volumes (/cache: GGUF conversions, inductor's compiled
# forward, the 4-bit kernel's build, Triton's cache; /models: the Hugging Face cache) or /tmp, so
# the root filesystem can be read-only (docker run --read-only --tmpfs /tmp; the chart's
# readOnlyRootFilesystem). A warm /cache makes /ready come ~2 min sooner (no compile).
ENV HF_HOME=/models/huggingface SPECD_CACHE_DIR=/cache HF_HUB_OFFLINE=1 \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions TRITON_CACHE_DIR=/cache/triton \
    XDG_CACHE_HOME=/cache/xdg \
    SPECD_HOST=0.0.0.0 SPECD_PORT=8000 SPECD_DEVICE=${VARIANT} \
    SPECD_CONFIG=/app/configs/default.yaml
VOLUME ["/models", "/cache"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD curl -fsS "http://127.0.0.1:${SPECD_PORT}/ready" || exit 1
# every specd command (serve, prepare, generate) reads its config from SPECD_CONFIG
CMD ["specd", "serve"]
