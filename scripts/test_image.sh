#!/usr/bin/env bash
# Builds the Dockerfile's two variants. The CPU variant is built and proven to serve as operators
# run it: read-only root filesystem, /tmp a tmpfs, /cache a volume, all capabilities dropped, the
# compiled forward on specd's 4-bit kernel (fails on any fallback to eager or to torch's int4
# kernel), a chat completion streamed with the official openai client, the health check healthy;
# then a second start on the warm /cache volume. The CUDA variant is built only (no GPU here), so
# that its Dockerfile path cannot rot, and checked for what needs no GPU: torch built for the
# lock's CUDA, importing torch, engine and server without a crash, torch.cuda.is_available() False,
# `specd --help` and `specd serve --help`, user and config, and a short eager `specd generate` on
# the CPU (--device auto). Removes everything it started (containers, volume, images, the Docker
# daemon if it started it, its work folder); the apt packages it installed stay.
#
#   sudo scripts/test_image.sh [--variant cpu|cuda|both] [--out FILE]
#     --variant: what to build (default both: the CPU variant built and run, then the CUDA one built)
#     --out FILE: a record of the run (loadtest/results/image.txt)
#
# Run it before every change to the Dockerfile, .dockerignore or docker/requirements-*.txt (opt-in,
# not in CI). On 2 vCPUs the CPU variant takes 8.5-11.5 min cold and ~3 GB of disk, the CUDA build
# about as long again (mostly downloading PyPI's CUDA wheels) and ~12 GB more while it runs
# (loadtest/results/image.txt).
# Needs root on a Debian-like host with apt (installs docker.io and debootstrap where missing) and,
# for the CPU variant, an x86 CPU with AVX-512 VNNI and BF16 (specd's 4-bit kernel; elsewhere
# torch's serves and the run fails, as it should); .venv from scripts/setup.sh (the openai client).
# Without systemd: it starts dockerd itself (under nice -n 19, host networking only: no bridge, no
# iptables changes) when none answers; the build uses the legacy builder (DOCKER_BUILDKIT=0).
# The bases need no registry: made with debootstrap and `docker import`. CPU: Debian bookworm,
# standing in for debian:bookworm-slim. CUDA: Ubuntu 24.04 (noble) with the user `ubuntu` (uid
# 1000) that ubuntu:24.04 has and nvidia/cuda's environment variables, standing in for
# nvidia/cuda:13.0.2-runtime-ubuntu24.04 (the CUDA libraries torch loads come from the lock's
# nvidia-* wheels, not the base); Ubuntu's archive key from the ubuntu-keyring package, checked
# against a pinned SHA-256. IMAGE_TEST_BASE=debian:bookworm-slim and
# IMAGE_TEST_CUDA_BASE=nvidia/cuda:13.0.2-runtime-ubuntu24.04 use a registry's instead.
# torch's CPU wheel: from https://download.pytorch.org/whl/cpu where that answers, else fetched by
# this host's pip (its own index / find-links configuration) and served to the build on 127.0.0.1.
# The CUDA variant's wheels come from PyPI, as the Dockerfile installs them.
# Environment: IMAGE_TEST_BASE, IMAGE_TEST_CUDA_BASE, IMAGE_TEST_MIRROR (Debian mirror, default
# http://deb.debian.org/debian), IMAGE_TEST_UBUNTU_MIRROR (default http://archive.ubuntu.com/ubuntu),
# IMAGE_TEST_READY_S (seconds to wait for /ready, default 900), IMAGE_TEST_WARM=0 (no second start),
# TORCH_INDEX_URL (an index with the CPU lock's torch wheel), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=""
VARIANTS=both
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    --variant) VARIANTS=$2; shift 2 ;;
    *) echo "usage: $0 [--variant cpu|cuda|both] [--out FILE]" >&2; exit 2 ;;
  esac
done
case "$VARIANTS" in
  cpu | cuda | both) ;;
  *) echo "test_image.sh: --variant is cpu, cuda or both, not '$VARIANTS'" >&2; exit 2 ;;
esac
want() { [ "$VARIANTS" = both ] || [ "$VARIANTS" = "$1" ]; }
[ "$(id -u)" = 0 ] || { echo "test_image.sh: run as root (apt, debootstrap, dockerd)" >&2; exit 2; }
PY=${PYTHON:-$ROOT/.venv/bin/python}
READY_S=${IMAGE_TEST_READY_S:-900}
MIRROR=${IMAGE_TEST_MIRROR:-http://deb.debian.org/debian}
UBUNTU_MIRROR=${IMAGE_TEST_UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
BASE_PY=3.11  # bookworm's python3: the CPU lock's wheels (docker/requirements-cpu.txt) are for it
# Ubuntu's archive keyring for debootstrap (Debian does not package it): this .deb from noble's
# main, its SHA-256 as noble's Packages index lists it
UBUNTU_KEYRING_DEB=pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
UBUNTU_KEYRING_SHA256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8

T0=$(date +%s)
ID=specd-imgtest-$$
WORK=$(mktemp -d /var/tmp/$ID.XXXX)
TAG=$ID:cpu
BASE_TAG=$ID-base:bookworm
CUDA_TAG=$ID:cuda
CUDA_BASE_TAG=$ID-base:noble
CONTAINER=$ID
VOLUME=$ID-cache
DOCKERD_PID=""
HTTP_PID=""
REPORT=$WORK/report.txt
: >"$REPORT"

say() { echo "== $*"; }
record() { printf '%s\n' "$@" >>"$REPORT"; }
elapsed() { echo $(($(date +%s) - T0)); }

cleanup() {
  rc=$?
  set +e
  say "cleanup"
  if [ -n "$DOCKERD_PID" ] || docker info >/dev/null 2>&1; then
    docker rm -f "$CONTAINER" >/dev/null 2>&1
    docker volume rm "$VOLUME" "$VOLUME-cuda" >/dev/null 2>&1
    docker rmi -f "$TAG" "$CUDA_TAG" >/dev/null 2>&1
    [ -n "${IMAGE_TEST_BASE:-}" ] || docker rmi -f "$BASE_TAG" >/dev/null 2>&1
    [ -n "${IMAGE_TEST_CUDA_BASE:-}" ] || docker rmi -f "$CUDA_BASE_TAG" >/dev/null 2>&1
  fi
  [ -n "$HTTP_PID" ] && kill "$HTTP_PID" 2>/dev/null
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- 1. tools and daemon ------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
[ -e /usr/share/keyrings/debian-archive-keyring.gpg ] || missing+=(debian-archive-keyring)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (nice 19, no bridge, no iptables)"
  nice -n 19 dockerd --iptables=false --ip6tables=false --ip-masq=false --bridge=none \
    >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; exit 1; }
fi
export DOCKER_BUILDKIT=0

# -- 2. the bases: debootstrap + docker import (no registry) --------------------------------------
import_rootfs() {  # ROOTFS TAG [--change ...]: this host's CA bundle for pip (a TLS-inspecting
  # proxy), then the tree imported as an image
  local rootfs=$1 tag=$2
  shift 2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  local changes=(--change 'CMD ["bash"]' "$@")
  if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$rootfs/etc/ssl"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/host-ca-bundle.crt"
    changes+=(--change 'ENV PIP_CERT=/etc/ssl/host-ca-bundle.crt')
  fi
  tar -C "$rootfs" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
  rm -rf "$rootfs"
}

make_bookworm_base() {  # debian:bookworm-slim's stand-in -> $BASE_TAG
  say "debootstrap bookworm -> $BASE_TAG"
  nice -n 19 debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # the suites debian:bookworm-slim has
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
    "$MIRROR" "$MIRROR" >"$WORK/rootfs/etc/apt/sources.list"
  import_rootfs "$WORK/rootfs" "$BASE_TAG"
}

make_noble_base() {  # nvidia/cuda:13.0.2-runtime-ubuntu24.04's stand-in -> $CUDA_BASE_TAG
  say "debootstrap noble -> $CUDA_BASE_TAG"
  local deb=$WORK/ubuntu-keyring.deb script=/usr/share/debootstrap/scripts/noble
  curl -fsS -m 120 -o "$deb" "$UBUNTU_MIRROR/$UBUNTU_KEYRING_DEB"
  echo "$UBUNTU_KEYRING_SHA256  $deb" | sha256sum -c --quiet - \
    || { echo "FAIL: $UBUNTU_KEYRING_DEB does not have the pinned SHA-256"; exit 1; }
  dpkg-deb -x "$deb" "$WORK/ubuntu-keyring"
  [ -e "$script" ] || script=/usr/share/debootstrap/scripts/gutsy  # (older debootstrap: every Ubuntu's)
  nice -n 19 debootstrap --variant=minbase --components=main,universe \
    --keyring="$WORK/ubuntu-keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg" \
    noble "$WORK/rootfs-noble" "$UBUNTU_MIRROR" "$script" >"$WORK/debootstrap-noble.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap-noble.log"; exit 1; }
  # the pockets and components ubuntu:24.04 has (the security pocket from the same mirror)
  printf 'deb %s %s main restricted universe multiverse\n' \
    "$UBUNTU_MIRROR" noble "$UBUNTU_MIRROR" noble-updates "$UBUNTU_MIRROR" noble-security \
    >"$WORK/rootfs-noble/etc/apt/sources.list"
  # ubuntu:24.04's user `ubuntu` holds uid/gid 1000: the Dockerfile must remove it for specd
  chroot "$WORK/rootfs-noble" useradd --uid 1000 --user-group --create-home --shell /bin/bash ubuntu
  # nvidia/cuda's environment (the driver's libraries are mounted by the NVIDIA runtime there)
  import_rootfs "$WORK/rootfs-noble" "$CUDA_BASE_TAG" \
    --change 'ENV NVIDIA_VISIBLE_DEVICES=all' \
    --change 'ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility' \
    --change 'ENV CUDA_VERSION=13.0.2' \
    --change 'ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64' \
    --change 'ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

check_config() {  # IMAGE: every specd command (prepare, generate, not only the CMD's serve) finds
  # the config: SPECD_CONFIG, else /app/configs/default.yaml (site-packages has no configs/)
  local env cfg
  for env in "" "-e SPECD_CONFIG="; do
    # shellcheck disable=SC2086
    cfg=$(docker run --rm --network none --read-only $env "$1" \
      python -c 'from server.cli import config_file; print(config_file(None))')
    [ "$cfg" = /app/configs/default.yaml ] || { echo "FAIL: specd's config in $1 is '$cfg'"; exit 1; }
  done
}

# -- 3. the CPU variant: built and run ----------------------------------------------------------
test_cpu() {
  local t0 b0 PORT URL
  t0=$(date +%s)
  if [ -n "${IMAGE_TEST_BASE:-}" ]; then
    BASE=$IMAGE_TEST_BASE
  else
    make_bookworm_base
    BASE=$BASE_TAG
  fi
  T_BASE=$(($(date +%s) - t0))

  # torch's CPU wheel
  local TORCH
  TORCH=$(sed -n 's/^torch==//p' docker/requirements-cpu.txt)
  INDEX=${TORCH_INDEX_URL:-}
  if [ -z "$INDEX" ] && ! curl -fsS -m 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    say "download.pytorch.org unreachable: torch==$TORCH from this host's pip, served on 127.0.0.1"
    mkdir -p "$WORK/index/torch"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$BASE_PY" \
      --platform manylinux_2_28_x86_64 --dest "$WORK/index/torch" "torch==$TORCH"
    (cd "$WORK/index/torch" && for f in *.whl; do
       printf '<a href="%s">%s</a>\n' "${f//+/%2B}" "$f"; done >index.html)
    local port
    port=$(free_port)
    "$PY" -m http.server --bind 127.0.0.1 --directory "$WORK/index" "$port" >/dev/null 2>&1 &
    HTTP_PID=$!
    INDEX=http://127.0.0.1:$port/
    for _ in $(seq 20); do curl -fsS -o /dev/null "$INDEX/torch/" 2>/dev/null && break; sleep 0.5; done
  fi

  say "docker build (VARIANT=cpu, BASE_IMAGE=$BASE)"
  b0=$(date +%s)
  local build_args=(--build-arg "BASE_IMAGE=$BASE" --build-arg VARIANT=cpu)
  [ -n "$INDEX" ] && build_args+=(--build-arg "TORCH_INDEX_URL=$INDEX")
  if ! nice -n 19 docker build --network host "${build_args[@]}" -t "$TAG" . >"$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log"
    exit 1
  fi
  T_BUILD=$(($(date +%s) - b0))
  SIZE=$(docker image inspect -f '{{.Size}}' "$TAG")
  cfg_user=$(docker image inspect -f '{{.Config.User}}' "$TAG")
  local cfg_env
  cfg_env=$(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$TAG")
  [ "$cfg_user" = specd ] || { echo "FAIL: image user is '$cfg_user', not specd"; exit 1; }
  grep -qx 'SPECD_DEVICE=cpu' <<<"$cfg_env" || { echo "FAIL: SPECD_DEVICE is not cpu in the CPU variant"; exit 1; }
  uid=$(docker run --rm --network none --read-only "$TAG" id -u)
  [ "$uid" = 1000 ] || { echo "FAIL: specd's uid is $uid, not 1000"; exit 1; }
  check_config "$TAG"

  # run: read-only root, as the chart runs it
  PORT=$(free_port)
  URL=http://127.0.0.1:$PORT
  docker volume create "$VOLUME" >/dev/null

  start() {  # start the container; wait for /ready; print the seconds it took
    docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
    local s0 ok=""
    s0=$(date +%s)
    docker run -d --name "$CONTAINER" --network host --read-only --tmpfs /tmp \
      --volume "$VOLUME:/cache" --cap-drop ALL --security-opt no-new-privileges \
      -e SPECD_HOST=127.0.0.1 -e "SPECD_PORT=$PORT" "$TAG" >/dev/null || return 1
    while [ $(($(date +%s) - s0)) -lt "$READY_S" ]; do
      if [ "$(docker inspect -f '{{.State.Running}}' "$CONTAINER")" != true ]; then
        echo "FAIL: the container exited ($(docker inspect -f '{{.State.ExitCode}}' "$CONTAINER"))" >&2
        docker logs --tail 40 "$CONTAINER" >&2
        return 1
      fi
      if curl -fsS -m 5 -o /dev/null "$URL/ready" 2>/dev/null; then ok=1; break; fi
      sleep 2
    done
    [ -n "$ok" ] || { echo "FAIL: no /ready in $READY_S s" >&2; docker logs --tail 40 "$CONTAINER" >&2; return 1; }
    echo $(($(date +%s) - s0))
  }

  check_paths() {  # the start-up log and /metrics: compiled, on specd's 4-bit kernel, no fallback
    local log bad paths gauge
    log=$(docker logs "$CONTAINER" 2>&1)
    paths=$(grep 'forward paths after warm-up' <<<"$log" || true)
    bad=$(grep -iE "eager|using torch's|q4-torch|InductorError|CppCompileError|disagrees with its reference" <<<"$log" || true)
    gauge=$(curl -fsS "$URL/metrics" | grep '^specd_forward_path{' || true)
    echo "$paths"
    echo "$gauge"
    [ -n "$paths" ] || { echo "FAIL: no 'forward paths after warm-up' line in the log"; return 1; }
    [ -z "$bad" ] || { echo "FAIL: the log shows a fallback:"; echo "$bad"; return 1; }
    grep -F 'component="target"' <<<"$gauge" | grep -F 'path="compiled+q4-specd"' | grep -qE ' 1(\.0)?$' \
      || { echo "FAIL: the target does not run compiled on specd's 4-bit kernel"; return 1; }
    grep -F 'component="head"' <<<"$gauge" | grep -F 'path="compiled+q4-specd"' | grep -qE ' 1(\.0)?$' \
      || { echo "FAIL: the EAGLE-3 head does not run compiled on specd's 4-bit kernel"; return 1; }
    ! grep -qE 'eager|q4-torch| 0(\.0)?$' <<<"$gauge" \
      || { echo "FAIL: the forward-path gauge shows eager, torch's kernel or a path left"; return 1; }
  }

  say "run (cold /cache: compiles the forward)"
  T_READY=$(start)
  say "ready after $T_READY s"
  PATHS_COLD=$(check_paths) || { echo "$PATHS_COLD"; exit 1; }
  health=""
  for _ in $(seq 40); do
    health=$(docker inspect -f '{{.State.Health.Status}}' "$CONTAINER")
    [ "$health" = healthy ] && break
    sleep 2
  done
  [ "$health" = healthy ] || { echo "FAIL: health check '$health'"; exit 1; }

  say "stream a chat completion (openai client)"
  REPLY=$("$PY" - "$URL" <<'EOF'
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name the three primary colours, one line each."}],
    max_tokens=64,
    temperature=0,
    stream=True,
)
chunks, text = 0, ""
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        chunks += 1
        text += chunk.choices[0].delta.content
assert chunks > 1 and text.strip(), (chunks, text)
print(f"model {model}, {chunks} streamed chunks:")
print(text)
EOF
  )
  echo "$REPLY"
  PATHS_SERVED=$(check_paths) || { echo "$PATHS_SERVED"; exit 1; }  # after serving: still compiled
  LOG_TAIL=$(docker logs "$CONTAINER" 2>&1 | tail -15)

  T_WARM=""
  PATHS_WARM=""
  if [ "${IMAGE_TEST_WARM:-1}" != 0 ]; then
    say "restart on the warm /cache volume"
    docker stop -t 30 "$CONTAINER" >/dev/null
    T_WARM=$(start)
    say "ready after $T_WARM s"
    PATHS_WARM=$(check_paths) || { echo "$PATHS_WARM"; exit 1; }
  fi
  docker rm -f "$CONTAINER" >/dev/null

  record "## CPU variant: built and run" \
    "# base: $BASE$([ -n "${IMAGE_TEST_BASE:-}" ] || echo ' (debootstrap bookworm + docker import)')" \
    "# torch wheel from: ${INDEX:-https://download.pytorch.org/whl/cpu (the Dockerfile default)}" \
    "" \
    "wall time, CPU variant           $(($(date +%s) - t0)) s" \
    "  base (debootstrap + import)    $T_BASE s" \
    "  docker build                   $T_BUILD s" \
    "  to /ready, cold /cache         $T_READY s   (compiles the forward into the /cache volume)" \
    "  to /ready, warm /cache         ${T_WARM:-not run} s" \
    "image size                       $((SIZE / 1000000)) MB ($TAG, VARIANT=cpu)" \
    "user / uid                       $cfg_user / $uid; SPECD_DEVICE=cpu" \
    "run flags                        --read-only --tmpfs /tmp -v <volume>:/cache --cap-drop ALL --security-opt no-new-privileges" \
    "health check                     $health" \
    "" "### build log (tail)" "$(grep -v '^ ---> \|^Removing intermediate' "$WORK/build.log" | tail -25)" \
    "" "### streamed reply" "$REPLY" \
    "" "### forward paths, cold start (log line, then /metrics)" "$PATHS_COLD" \
    "" "### forward paths after the streamed request" "$PATHS_SERVED" \
    "" "### forward paths, warm restart" "${PATHS_WARM:-not run}" \
    "" "### container log (tail, cold start)" "$LOG_TAIL" ""
}

# -- 4. the CUDA variant: built, checked without a GPU ------------------------------------------
test_cuda() {
  local t0 b0 base t_base t_build size user env uid pyver imports help serve_help gen
  t0=$(date +%s)
  if [ -n "${IMAGE_TEST_CUDA_BASE:-}" ]; then
    base=$IMAGE_TEST_CUDA_BASE
  else
    make_noble_base
    base=$CUDA_BASE_TAG
  fi
  t_base=$(($(date +%s) - t0))

  say "docker build (VARIANT=cuda, BASE_IMAGE=$base): the wheels from PyPI"
  b0=$(date +%s)
  if ! nice -n 19 docker build --network host --build-arg "BASE_IMAGE=$base" --build-arg VARIANT=cuda \
      -t "$CUDA_TAG" . >"$WORK/build-cuda.log" 2>&1; then
    tail -40 "$WORK/build-cuda.log"
    exit 1
  fi
  t_build=$(($(date +%s) - b0))
  size=$(docker image inspect -f '{{.Size}}' "$CUDA_TAG")
  user=$(docker image inspect -f '{{.Config.User}}' "$CUDA_TAG")
  env=$(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$CUDA_TAG")
  [ "$user" = specd ] || { echo "FAIL: CUDA image user is '$user', not specd"; exit 1; }
  grep -qx 'SPECD_DEVICE=cuda' <<<"$env" || { echo "FAIL: SPECD_DEVICE is not cuda in the CUDA variant"; exit 1; }
  # the base's user `ubuntu` had uid 1000: the Dockerfile removed it and gave it to specd
  uid=$(docker run --rm --network none --read-only "$CUDA_TAG" id -u)
  [ "$uid" = 1000 ] || { echo "FAIL: specd's uid is $uid in the CUDA image, not 1000"; exit 1; }
  ! docker run --rm --network none --read-only "$CUDA_TAG" id ubuntu >/dev/null 2>&1 \
    || { echo "FAIL: the base's user ubuntu is still in the CUDA image"; exit 1; }
  check_config "$CUDA_TAG"
  pyver=$(docker run --rm --network none --read-only "$CUDA_TAG" python --version)

  say "CUDA image: imports without a GPU"
  # torch's import loads the CUDA libraries of the nvidia-* wheels (cuBLAS, cuDNN, NCCL, ...):
  # a missing or mismatched one fails here, GPU or not; without a GPU is_available() is False
  # (not an error), and cuDNN reports its version from its own library
  imports=$(docker run --rm --network none --read-only --tmpfs /tmp "$CUDA_TAG" python -c '
import torch, engine, server, triton
import engine.api, server.app
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, triton {triton.__version__}")
print(f"torch.cuda.is_available() {torch.cuda.is_available()}, device count {torch.cuda.device_count()}")
assert torch.version.cuda == "13.0", torch.version.cuda
assert not torch.cuda.is_available()
assert torch.backends.cudnn.version() is not None
') || { echo "FAIL: the CUDA image's imports: $imports"; exit 1; }
  echo "$imports"
  help=$(docker run --rm --network none --read-only --tmpfs /tmp "$CUDA_TAG" specd --help)
  serve_help=$(docker run --rm --network none --read-only --tmpfs /tmp "$CUDA_TAG" specd serve --help)
  grep -q -- '--speculative-config' <<<"$serve_help" || { echo "FAIL: specd serve --help:"; echo "$serve_help"; exit 1; }

  say "CUDA image: specd generate on the CPU (--device auto, eager)"
  # the whole stack (config, GGUF conversion, tokenizer, the round) on this image's packages,
  # read-only root as served; auto picks the CPU where no GPU is visible
  docker volume create "$VOLUME-cuda" >/dev/null
  gen=$(docker run --rm --network none --read-only --tmpfs /tmp --volume "$VOLUME-cuda:/cache" \
    -e SPECD_ENFORCE_EAGER=1 "$CUDA_TAG" \
    specd generate --device auto --max-tokens 24 "Name the three primary colours." 2>&1) \
    || { echo "FAIL: specd generate in the CUDA image:"; echo "$gen" | tail -30; exit 1; }
  grep -q '^--- .* tokens in ' <<<"$gen" || { echo "FAIL: no generate summary:"; echo "$gen" | tail -30; exit 1; }
  gen=$(tr '\r' '\n' <<<"$gen" | grep -vE '(it/s|s/it)\]$' | tail -8)  # (without the progress bars)
  echo "$gen"
  docker volume rm "$VOLUME-cuda" >/dev/null
  docker rmi -f "$CUDA_TAG" >/dev/null  # ~10 GB: not kept past its checks

  record "## CUDA variant: built only (no GPU), checked without one" \
    "# base: $base$([ -n "${IMAGE_TEST_CUDA_BASE:-}" ] || echo ' (debootstrap noble + user ubuntu uid 1000 + nvidia/cuda ENV, docker import; standing in for nvidia/cuda:13.0.2-runtime-ubuntu24.04)')" \
    "# wheels from: PyPI (docker/requirements-cuda.txt, as the Dockerfile installs them)" \
    "" \
    "wall time, CUDA variant          $(($(date +%s) - t0)) s" \
    "  base (debootstrap + import)    $t_base s" \
    "  docker build                   $t_build s" \
    "image size                       $((size / 1000000)) MB ($CUDA_TAG, VARIANT=cuda)" \
    "user / uid                       $user / $uid (the base's user ubuntu removed); SPECD_DEVICE=cuda; $pyver" \
    "" "### imports (python -c 'import torch, engine, server, triton ...', no GPU)" "$imports" \
    "" "### specd --help (head)" "$(head -8 <<<"$help")" \
    "" "### specd generate --device auto (eager, CPU; tail)" "$gen" \
    "" "### build log (tail)" "$(grep -v '^ ---> \|^Removing intermediate' "$WORK/build-cuda.log" | tail -25)" ""
}

if want cpu; then test_cpu; fi
if want cuda; then test_cuda; fi

# -- 5. record ----------------------------------------------------------------------------------
T_ALL=$(elapsed)
{
  printf '%s\n' "# scripts/test_image.sh --variant $VARIANTS: PASS, $(date -u '+%Y-%m-%d %H:%M UTC'), git $(git rev-parse --short HEAD)$([ -z "$(git status --porcelain -- Dockerfile .dockerignore docker scripts/test_image.sh)" ] || echo ' + uncommitted image files')" \
    "# machine: $(nproc) vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(free -g | awk '/Mem:/ {print $2}') GiB," \
    "#   Docker $(docker version -f '{{.Server.Version}}'), legacy builder" \
    "# wall time, all steps: $T_ALL s" ""
  cat "$REPORT"
} >"$WORK/record.txt"
say "PASS in $T_ALL s"
cat "$WORK/record.txt"
if [ -n "$OUT" ]; then cp "$WORK/record.txt" "$OUT"; fi
