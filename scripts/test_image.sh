#!/usr/bin/env bash
# Builds the Dockerfile's CPU variant and proves the image serves as operators run it: read-only
# root filesystem, /tmp a tmpfs, /cache a volume, all capabilities dropped, the compiled forward on
# specd's 4-bit kernel (fails on any fallback to eager or to torch's int4 kernel), a chat completion
# streamed with the official openai client, the health check healthy; then a second start on the
# warm /cache volume. Removes everything it started (container, volume, images, the Docker daemon
# if it started it, its work folder); the apt packages it installed stay.
#
#   sudo scripts/test_image.sh [--out FILE]     # FILE: a record of the run (loadtest/results/image.txt)
#
# Run it before every change to the Dockerfile, .dockerignore or docker/requirements-*.txt (opt-in,
# not in CI): a cold run takes 8.5-11.5 min on 2 vCPUs and needs ~3 GB of disk
# (loadtest/results/image.txt).
# Needs root on a Debian-like host with apt (installs docker.io and debootstrap where missing) and
# an x86 CPU with AVX-512 VNNI and BF16 (specd's 4-bit kernel; elsewhere torch's serves and the run
# fails, as it should); .venv from scripts/setup.sh (the openai client).
# Without systemd: it starts dockerd itself (under nice -n 19, host networking only: no bridge, no
# iptables changes) when none answers; the build uses the legacy builder (DOCKER_BUILDKIT=0).
# The base: Debian bookworm made with debootstrap and `docker import` (no registry needed), standing in
# for debian:bookworm-slim; IMAGE_TEST_BASE=debian:bookworm-slim uses a registry's instead.
# torch's CPU wheel: from https://download.pytorch.org/whl/cpu where that answers, else fetched by
# this host's pip (its own index / find-links configuration) and served to the build on 127.0.0.1.
# Environment: IMAGE_TEST_BASE, IMAGE_TEST_MIRROR (Debian mirror, default http://deb.debian.org/debian),
# IMAGE_TEST_READY_S (seconds to wait for /ready, default 900), IMAGE_TEST_WARM=0 (no second start),
# TORCH_INDEX_URL (an index with the lock's torch wheel), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    *) echo "usage: $0 [--out FILE]" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "test_image.sh: run as root (apt, debootstrap, dockerd)" >&2; exit 2; }
PY=${PYTHON:-$ROOT/.venv/bin/python}
READY_S=${IMAGE_TEST_READY_S:-900}
MIRROR=${IMAGE_TEST_MIRROR:-http://deb.debian.org/debian}
BASE_PY=3.11  # bookworm's python3: the CPU lock's wheels (docker/requirements-cpu.txt) are for it

T0=$(date +%s)
ID=specd-imgtest-$$
WORK=$(mktemp -d /var/tmp/$ID.XXXX)
TAG=$ID:cpu
BASE_TAG=$ID-base:bookworm
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
    docker volume rm "$VOLUME" >/dev/null 2>&1
    docker rmi -f "$TAG" >/dev/null 2>&1
    [ -n "${IMAGE_TEST_BASE:-}" ] || docker rmi -f "$BASE_TAG" >/dev/null 2>&1
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

# -- 2. the base --------------------------------------------------------------------------------
if [ -n "${IMAGE_TEST_BASE:-}" ]; then
  BASE=$IMAGE_TEST_BASE
else
  say "debootstrap bookworm -> $BASE_TAG"
  nice -n 19 debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # the suites debian:bookworm-slim has, and this host's CA bundle for pip (a TLS-inspecting proxy)
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
    "$MIRROR" "$MIRROR" >"$WORK/rootfs/etc/apt/sources.list"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  changes=(--change 'CMD ["bash"]')
  if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$WORK/rootfs/etc/ssl"
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/host-ca-bundle.crt"
    changes+=(--change 'ENV PIP_CERT=/etc/ssl/host-ca-bundle.crt')
  fi
  tar -C "$WORK/rootfs" -c . | docker import "${changes[@]}" - "$BASE_TAG" >/dev/null
  rm -rf "$WORK/rootfs"
  BASE=$BASE_TAG
fi
T_BASE=$(elapsed)

# -- 3. torch's CPU wheel -----------------------------------------------------------------------
TORCH=$(sed -n 's/^torch==//p' docker/requirements-cpu.txt)
INDEX=${TORCH_INDEX_URL:-}
if [ -z "$INDEX" ] && ! curl -fsS -m 15 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
  say "download.pytorch.org unreachable: torch==$TORCH from this host's pip, served on 127.0.0.1"
  mkdir -p "$WORK/index/torch"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$BASE_PY" \
    --platform manylinux_2_28_x86_64 --dest "$WORK/index/torch" "torch==$TORCH"
  (cd "$WORK/index/torch" && for f in *.whl; do
     printf '<a href="%s">%s</a>\n' "${f//+/%2B}" "$f"; done >index.html)
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PY" -m http.server --bind 127.0.0.1 --directory "$WORK/index" "$port" >/dev/null 2>&1 &
  HTTP_PID=$!
  INDEX=http://127.0.0.1:$port/
  for _ in $(seq 20); do curl -fsS -o /dev/null "$INDEX/torch/" 2>/dev/null && break; sleep 0.5; done
fi

# -- 4. build -----------------------------------------------------------------------------------
say "docker build (VARIANT=cpu, BASE_IMAGE=$BASE)"
b0=$(date +%s)
build_args=(--build-arg "BASE_IMAGE=$BASE" --build-arg VARIANT=cpu)
[ -n "$INDEX" ] && build_args+=(--build-arg "TORCH_INDEX_URL=$INDEX")
if ! nice -n 19 docker build --network host "${build_args[@]}" -t "$TAG" . >"$WORK/build.log" 2>&1; then
  tail -40 "$WORK/build.log"
  exit 1
fi
T_BUILD=$(($(date +%s) - b0))
SIZE=$(docker image inspect -f '{{.Size}}' "$TAG")
cfg_user=$(docker image inspect -f '{{.Config.User}}' "$TAG")
cfg_env=$(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$TAG")
[ "$cfg_user" = specd ] || { echo "FAIL: image user is '$cfg_user', not specd"; exit 1; }
grep -qx 'SPECD_DEVICE=cpu' <<<"$cfg_env" || { echo "FAIL: SPECD_DEVICE is not cpu in the CPU variant"; exit 1; }
uid=$(docker run --rm --network none --read-only "$TAG" id -u)
[ "$uid" = 1000 ] || { echo "FAIL: specd's uid is $uid, not 1000"; exit 1; }
# every specd command (prepare, generate, not only the CMD's serve) finds the config: SPECD_CONFIG,
# else /app/configs/default.yaml (site-packages has no configs/ beside the package)
for env in "" "-e SPECD_CONFIG="; do
  # shellcheck disable=SC2086
  cfg=$(docker run --rm --network none --read-only $env "$TAG" \
    python -c 'from server.cli import config_file; print(config_file(None))')
  [ "$cfg" = /app/configs/default.yaml ] || { echo "FAIL: specd's config in the image is '$cfg'"; exit 1; }
done

# -- 5. run: read-only root, as the chart runs it -----------------------------------------------
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
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
  grep -F 'component="head"' <<<"$gauge" | grep -F 'path="compiled"' | grep -qE ' 1(\.0)?$' \
    || { echo "FAIL: the EAGLE-3 head does not run compiled"; return 1; }
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
if [ "${IMAGE_TEST_WARM:-1}" != 0 ]; then
  say "restart on the warm /cache volume"
  docker stop -t 30 "$CONTAINER" >/dev/null
  T_WARM=$(start)
  say "ready after $T_WARM s"
  PATHS_WARM=$(check_paths) || { echo "$PATHS_WARM"; exit 1; }
fi

# -- 6. record ----------------------------------------------------------------------------------
T_ALL=$(elapsed)
record "# scripts/test_image.sh: PASS, $(date -u '+%Y-%m-%d %H:%M UTC'), git $(git rev-parse --short HEAD)$([ -z "$(git status --porcelain -- Dockerfile .dockerignore docker)" ] || echo ' + uncommitted image files')" \
  "# machine: $(nproc) vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(free -g | awk '/Mem:/ {print $2}') GiB," \
  "#   Docker $(docker version -f '{{.Server.Version}}'), legacy builder, base: $BASE$([ -n "${IMAGE_TEST_BASE:-}" ] || echo ' (debootstrap bookworm + docker import)')" \
  "# torch wheel from: ${INDEX:-https://download.pytorch.org/whl/cpu (the Dockerfile default)}" \
  "" \
  "wall time, all steps             $T_ALL s" \
  "  base (debootstrap + import)    $T_BASE s" \
  "  docker build                   $T_BUILD s" \
  "  to /ready, cold /cache         $T_READY s   (compiles the forward into the /cache volume)" \
  "  to /ready, warm /cache         ${T_WARM:-not run} s" \
  "image size                       $((SIZE / 1000000)) MB ($TAG, VARIANT=cpu)" \
  "user / uid                       $cfg_user / $uid; SPECD_DEVICE=cpu" \
  "run flags                        --read-only --tmpfs /tmp -v <volume>:/cache --cap-drop ALL --security-opt no-new-privileges" \
  "health check                     $health" \
  "" "## build log (tail)" "$(grep -v '^ ---> \|^Removing intermediate' "$WORK/build.log" | tail -25)" \
  "" "## streamed reply" "$REPLY" \
  "" "## forward paths, cold start (log line, then /metrics)" "$PATHS_COLD" \
  "" "## forward paths after the streamed request" "$PATHS_SERVED" \
  "" "## forward paths, warm restart" "${PATHS_WARM:-not run}" \
  "" "## container log (tail, cold start)" "$LOG_TAIL"
say "PASS in $T_ALL s"
cat "$REPORT"
if [ -n "$OUT" ]; then cp "$REPORT" "$OUT"; fi
