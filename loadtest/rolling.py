"""A rolling restart under load, for real, on one machine: two ``specd serve`` replicas behind
HAProxy (least connections, health-checked on ``/ready``), streamed greedy chat requests sent
through it at a steady rate, and each replica in turn stopped with SIGTERM and started again, the
way a Kubernetes rollout with ``maxUnavailable: 0`` replaces pods.

    python -m loadtest.rolling [--rate 0.5] [--max-tokens 24] [--timeout 900]

It passes (exit 0) when no request failed or was cut (each stream ended with a finish_reason and
``[DONE]``, loadtest/replica.py reads it byte for byte) and every output equals the reference:
the same prompt answered by one replica alone before the load. The replicas run in fp32, where
greedy output does not depend on the batch (docs/speculation.md, "What holds in which dtype").

The gateway's part: it stops sending to a replica once ``/ready`` answers 503 (checked every
``CHECK_MS``), and a request that reached a replica just as it began to drain (503, answered
before any byte of a stream) or just after it closed (connection refused) is retried on the other
one (``retry-on``). The client itself never retries (no retry in :func:`stream_chat`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .replica import HOST, Replica, StreamResult, free_port, stream_chat

CHECK_MS = 300  # the gateway's health-check interval
PROMPTS = [
    "Name three animals that live in water.",
    "Write a haiku about rain.",
    "What is the capital of France?",
    "Give two tips for sleeping well.",
    "Explain what a CPU does in one sentence.",
    "List three colours of the rainbow.",
]

HAPROXY_CFG = """\
global
    maxconn 512
defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    option http-buffer-request
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
frontend specd
    bind {host}:{port}
    default_backend replicas
backend replicas
    balance leastconn
    option httpchk GET /ready
    http-check expect status 200
    default-server check inter {check}ms fall 1 rise 2
{servers}
"""


def haproxy_bin() -> str | None:
    """Debian's haproxy (in /usr/sbin, which a non-root PATH may lack), or None."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def haproxy_config(port: int, backends: list[int]) -> str:
    servers = "\n".join(f"    server r{i} {HOST}:{p}" for i, p in enumerate(backends))
    return HAPROXY_CFG.format(host=HOST, port=port, check=CHECK_MS, servers=servers)


@dataclass
class Outcome:
    """What a run saw; ``passed`` is the verdict."""

    sent: int = 0
    failed: list[StreamResult] = field(default_factory=list)  # an error, a cut, a refusal
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)  # (prompt, got, ref)
    restarts: list[dict] = field(default_factory=list)  # per replica: exit code, drain, ready s
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        drained = all(r["exit_code"] == 0 for r in self.restarts)
        return self.sent > 0 and not self.failed and not self.mismatched and drained

    def summary(self) -> str:
        head = f"requests {self.sent}: failed or cut {len(self.failed)}, output differs from"
        lines = [f"{head} the reference {len(self.mismatched)} ({self.wall_s:.0f} s)"]
        for r in self.restarts:
            lines.append(
                f"  replica :{r['port']}: SIGTERM -> exit {r['exit_code']} in {r['drain_s']:.1f} s"
                f" ({r['held']} requests in flight), ready again in {r['ready_s']:.1f} s"
            )
        lines += [f"  failed: {f}" for f in self.failed[:5]]
        lines += [f"  differs: {p!r}: {g!r} vs {r!r}" for p, g, r in self.mismatched[:5]]
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def body(prompt: str, max_tokens: int) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip


def run(
    *,
    rate: float = 2.0,
    max_tokens: int = 32,
    warm_s: float = 4.0,
    settle_s: float = 3.0,
    shutdown_timeout_s: float = 60.0,
    threads: int | None = None,
    extra_args: tuple[str, ...] = (),
    workdir: Path | None = None,
    timeout: float = 900.0,
) -> Outcome:
    """Start the replicas and the gateway, compute the references, send ``rate`` requests a
    second through the gateway while each replica in turn is restarted (``warm_s`` of load
    before the first, ``settle_s`` after each is ready again), then wait for every request.
    ``threads``: torch's threads per replica (two replicas share the machine; default torch's)."""
    if (haproxy := haproxy_bin()) is None:
        raise RuntimeError("haproxy is not installed (scripts/setup.sh installs it with apt)")
    work = Path(workdir or tempfile.mkdtemp(prefix="specd-rolling-"))
    work.mkdir(parents=True, exist_ok=True)
    args = ["--dtype", "float32", "--shutdown-timeout", str(shutdown_timeout_s), *extra_args]
    args += ["--threads", str(threads)] if threads else []
    replicas = [Replica(free_port(), args, work / f"replica{i}.log") for i in range(2)]
    gateway_port, out = free_port(), Outcome()
    cfg = work / "haproxy.cfg"
    cfg.write_text(haproxy_config(gateway_port, [r.port for r in replicas]))
    gateway: subprocess.Popen | None = None
    t_end = time.monotonic() + timeout
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready(max(1.0, t_end - time.monotonic()))
        ref = {p: stream_chat(replicas[0].url, body(p, max_tokens)).text for p in PROMPTS}
        log = (work / "haproxy.log").open("w")
        gateway = subprocess.Popen([haproxy, "-f", str(cfg), "-db"], stdout=log, stderr=log)
        gw = f"http://{HOST}:{gateway_port}"
        _wait_gateway(gw, t_end)
        t0 = time.monotonic()
        futures: list[tuple[str, Future]] = []
        stop = threading.Event()
        with ThreadPoolExecutor(64) as pool:

            def load() -> None:  # a steady rate, whatever the answers take
                i = 0
                while not stop.is_set() and time.monotonic() < t_end:
                    p = PROMPTS[i % len(PROMPTS)]
                    futures.append((p, pool.submit(stream_chat, gw, body(p, max_tokens))))
                    i += 1
                    stop.wait(max(0.0, t0 + i / rate - time.monotonic()))

            sender = threading.Thread(target=load, daemon=True)
            sender.start()
            time.sleep(warm_s)
            for r in replicas:
                out.restarts.append(_restart(r, futures, t_end))
                time.sleep(settle_s)
            stop.set()
            sender.join()
            for p, f in futures:
                res = f.result(max(1.0, t_end - time.monotonic()))
                out.sent += 1
                if not res.ok:
                    out.failed.append(res)
                elif res.text != ref[p]:
                    out.mismatched.append((p, res.text, ref[p]))
        out.wall_s = time.monotonic() - t0
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        for r in replicas:
            r.kill()
    return out


def _wait_gateway(gw: str, t_end: float) -> None:
    """Until a request through the gateway succeeds (both backends checked up)."""
    time.sleep(2 * CHECK_MS / 1000 * 2)
    while not stream_chat(gw, body(PROMPTS[0], 1)).ok:
        if time.monotonic() > t_end:
            raise RuntimeError("the gateway never answered")
        time.sleep(0.2)


def _restart(r: Replica, futures: list, t_end: float) -> dict:
    """SIGTERM ``r`` once a request is in flight (waiting up to 10 s for one: at a low rate the
    gaps between requests are long), start it again, and wait until it is ready."""
    wait_end = min(t_end, time.monotonic() + 10.0)
    while all(f.done() for _, f in futures) and time.monotonic() < wait_end:
        time.sleep(0.01)
    held = sum(1 for _, f in futures if not f.done())  # in flight on both replicas
    code, drain_s = r.terminate(kill_after=max(1.0, t_end - time.monotonic()))
    r.start()
    ready_s = r.wait_ready(max(1.0, t_end - time.monotonic()))
    return {"port": r.port, "exit_code": code, "drain_s": drain_s, "ready_s": ready_s,
            "held": held}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.rolling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rate", type=float, default=0.5, help="requests a second")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--warm", type=float, default=4.0, help="seconds of load before the restarts")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after each restart")
    ap.add_argument("--shutdown-timeout", type=float, default=60.0)
    ap.add_argument("--threads", type=int, help="torch's threads per replica")
    ap.add_argument("--timeout", type=float, default=900.0, help="the whole run at most")
    ap.add_argument("--workdir", type=Path, help="logs and the gateway's config (default: temp)")
    a = ap.parse_args(argv)
    out = run(rate=a.rate, max_tokens=a.max_tokens, warm_s=a.warm, settle_s=a.settle,
              shutdown_timeout_s=a.shutdown_timeout, threads=a.threads, workdir=a.workdir,
              timeout=a.timeout)  # fmt: skip
    print(out.summary())
    return 0 if out.passed else 1


if __name__ == "__main__":
    sys.exit(main())
