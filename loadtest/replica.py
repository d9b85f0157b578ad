"""What the drain and rolling-restart checks drive: a ``specd serve`` replica on a fixed port
(started, found ready, stopped with SIGTERM and timed) and one streamed chat request read
byte for byte, so that a stream cut short is told apart from one that ended properly.

A stream ended properly when it sent ``data: [DONE]``; it succeeded when, before that, it sent a
``finish_reason`` and no error event. A proxy or client that hides a cut (the ``openai`` client
ends its iteration quietly on some) would count a cut stream as a short answer: this reader
does not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class StreamResult:
    status: int = 0  # HTTP status; 0: no response (connection refused or reset before one)
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None  # an error event's message, the HTTP error, or the exception
    retry_after: str | None = None  # the Retry-After header of a refusal

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and bool(self.finish_reason)


def stream_chat(base: str, body: dict, timeout: float = 120.0) -> StreamResult:
    """POST ``body`` (streamed) to ``base``/v1/chat/completions and read the whole answer."""
    res = StreamResult()
    try:
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=timeout
        ) as r:
            res.status, res.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200:
                r.read()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"].get("message", "error event")
                    continue
                for choice in event.get("choices", []):
                    res.text += (choice.get("delta") or {}).get("content") or ""
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def free_port() -> int:
    """A port free now. (HAProxy's backends need fixed ports: a replica restarts on its own.)"""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Replica:
    """``specd serve`` on ``HOST:port`` with ``args`` (e.g. --config, --dtype,
    --shutdown-timeout), logging to ``log``; start again after :meth:`terminate`."""

    def __init__(self, port: int, args: list[str], log: Path):
        self.port, self.args, self.log = port, args, log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "server.cli", "serve", *self.args]
        argv += ["--host", HOST, "--port", str(self.port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECD_LOG_LEVEL": "warning"}
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds until ``/ready`` answers 200 (RuntimeError if it exits or takes too long)."""
        assert self.proc is not None
        t0 = time.monotonic()
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"replica :{self.port} exited ({self.proc.returncode}); {self.log}"
                )
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"replica :{self.port} not ready in {timeout:.0f} s; {self.log}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def terminate(self, kill_after: float = 120.0) -> tuple[int, float]:
        """SIGTERM, then wait for the exit: (exit code, seconds); SIGKILL after ``kill_after``
        (exit code -9 then says the drain overran)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(kill_after)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return code, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
