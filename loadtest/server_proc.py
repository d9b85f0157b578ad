"""``specd serve`` in a child process on a free loopback port, for benchmarks: the server never
shares the load generator's GIL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml


@contextmanager
def specd_server(config: Path, max_running: int, dtype: str | None = None):
    """``specd serve`` in a child process on a free loopback port (at least ``max_running``
    sequences, ``dtype`` overriding the config's); yields (base_url ending in /v1, pid)."""
    data = yaml.safe_load(config.read_text()) or {}
    data.setdefault("engine", {})["max_running"] = max(
        data["engine"].get("max_running", 1), max_running
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECD_LOG_LEVEL="warning")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--config",
            f.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        + (["--dtype", dtype] if dtype else []),
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"specd serve exited with {proc.returncode}")
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("specd serve did not become ready")
            time.sleep(0.5)
        yield f"{base}/v1", proc.pid
    finally:
        stop_process(proc)
        os.unlink(f.name)


def stop_process(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM (a graceful drain for specd), then SIGKILL after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
