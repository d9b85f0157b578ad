"""A server in a child process: started, found ready, measured, stopped (Linux: reads /proc).

Contracts, for every tool here that runs a server (``python -m loadtest --spawn-specd``, the soak,
the benchmarks):

* Port: the child binds port 0 itself (``--port 0`` in its command line) and the port is read from
  the kernel: the TCP socket in LISTEN state held by the child's process tree. No port is picked,
  released and bound again, so no other process can take it in between, and the readiness probe
  reaches this child only.
* Ready: an HTTP 200 from ``ready_path`` on that port while the child lives, within ``timeout``
  seconds of the start; otherwise RuntimeError (the child is stopped).
* Peak RSS, the one definition every tool reports: the largest sum of VmRSS over a process and its
  descendants, sampled every ``RssSampler.every`` seconds from start to stop (warm-up and
  compilation included).
* Stop: SIGTERM (specd drains gracefully), then SIGKILL after ``grace`` seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

HOST = "127.0.0.1"


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (empty when ``pid`` is gone)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # the process is gone
        out.append(p)
        for t in tasks:
            try:
                todo += [int(k) for k in (t / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # a thread that ended meanwhile (the process itself lives on)
    return out


def rss_mib(pid: int) -> float:
    """Resident memory (MiB) of ``pid`` and its descendants now; NaN when ``pid`` is gone."""
    total, found = 0, False
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    found = True
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total / 1024 if found else float("nan")


class RssSampler(threading.Thread):
    """Samples :func:`rss_mib` of a process tree every ``every`` seconds until :meth:`stop` (which
    takes one last sample); ``samples`` holds (time.monotonic(), MiB) pairs."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True, name=f"rss-{pid}")
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop_ev = threading.Event()

    def _sample(self) -> None:
        rss = rss_mib(self.pid)
        if rss == rss:  # not NaN: the process is alive
            with self._lock:
                self.samples.append((time.monotonic(), rss))

    def run(self) -> None:
        while not self._stop_ev.is_set():
            self._sample()
            self._stop_ev.wait(self.every)

    def stop(self) -> float:
        self._stop_ev.set()
        if self.is_alive():
            self.join()
        self._sample()
        return self.peak

    def peak_between(self, start: float = -float("inf"), end: float = float("inf")) -> float:
        """Peak RSS (MiB) of the samples taken in [start, end) (monotonic clock); NaN if none."""
        with self._lock:
            xs = [rss for t, rss in self.samples if start <= t < end]
        return max(xs) if xs else float("nan")

    @property
    def peak(self) -> float:
        return self.peak_between()


def listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state on sockets held by ``pid`` or its descendants."""
    inodes = set()
    for p in process_tree(pid):
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def stop_process(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM (a graceful drain for specd), then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Server:
    """A started, ready child server. ``url``: its root (no /v1)."""

    proc: subprocess.Popen
    port: int
    ready_s: float  # start to ready, seconds
    rss: RssSampler

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API base (``url`` + /v1)."""
        return f"{self.url}/v1"


def _ready_port(proc: subprocess.Popen, ready_path: str) -> int | None:
    for port in sorted(listening_ports(proc.pid)):
        try:
            if httpx.get(f"http://{HOST}:{port}{ready_path}", timeout=2).status_code == 200:
                return port
        except httpx.HTTPError:
            pass
    return None


@contextmanager
def spawn(
    argv: list[str],
    *,
    ready_path: str,
    name: str = "server",
    env: dict | None = None,
    cwd: str | Path | None = None,
    log: Path | None = None,
    timeout: float = 300,
    poll: float = 0.2,
) -> Iterator[Server]:
    """Run ``argv`` (which must make the child listen on port 0 at ``HOST``) until the block
    ends; yields the ready :class:`Server`. ``log``: the child's stdout and stderr go to this file
    (default: this process's)."""
    with ExitStack() as stack:
        out = stack.enter_context(log.open("w")) if log is not None else None
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
        )
        rss = RssSampler(proc.pid)
        rss.start()
        stack.callback(rss.stop)
        stack.callback(stop_process, proc)
        t0 = time.monotonic()
        see = f"; see {log}" if log is not None else ""
        while (port := _ready_port(proc, ready_path)) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}{see}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{name} did not become ready in {timeout:.0f} s{see}")
            time.sleep(poll)
        yield Server(proc, port, time.monotonic() - t0, rss)


def specd_argv(config: str | Path, dtype: str | None = None) -> list[str]:
    """``specd serve`` on port 0 of ``HOST``, this interpreter."""
    argv = [sys.executable, "-m", "server.cli", "serve", "--config", str(config)]
    argv += ["--host", HOST, "--port", "0"]
    return argv + (["--dtype", dtype] if dtype else [])


@contextmanager
def specd_server(config: Path, max_running: int, dtype: str | None = None) -> Iterator[Server]:
    """``specd serve --config config`` in a child process, with at least ``max_running`` running
    sequences and ``dtype`` (when given) overriding the config's; logs at warning level."""
    data = yaml.safe_load(Path(config).read_text()) or {}
    engine = data.setdefault("engine", {})
    engine["max_running"] = max(engine.get("max_running", 1), max_running)
    with tempfile.TemporaryDirectory(prefix="specd-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(data))
        env = {"HF_HUB_OFFLINE": "1", "SPECD_LOG_LEVEL": "warning"}
        with spawn(specd_argv(path, dtype), ready_path="/ready", name="specd serve", env=env) as s:
            print(f"specd serve (pid {s.pid}) ready at {s.base_url}", file=sys.stderr, flush=True)
            yield s
