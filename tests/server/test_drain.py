"""SIGTERM on a real ``specd serve`` process, with the CPU kept busy by other processes (the
normal state of a loaded replica): /ready turns 503, new requests get 503 with Retry-After,
every request the server holds ends with its whole output (or, at the deadline, with an error
event) and ``[DONE]``, and the process exits when drained, within ``--shutdown-timeout``.

No assert here rests on the test's own clock (a loaded machine stretches any of it): each wait
polls for the event it needs with a deadline that only bounds a hang, and "within the
timeout" is the server's own: past ``--shutdown-timeout`` + ``HARD_EXIT_S`` its watchdog ends
the process with exit code 1, so an exit code of 0 says it ended in time by itself."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx

from loadtest.replica import Replica, StreamResult, free_port, stream_chat
from tests.conftest import wait_until

PROMPTS = [f"Name {n} animals that live in {w}." for n in (3, 4) for w in ("water", "trees")]
PROMPTS += ["Write a haiku about rain.", "What is 7 times 8?", "Say hello.", "List 3 colours."]
NO_END = {"0": -100, "2": -100}  # logit_bias: no <|endoftext|> / <|im_end|>: runs to max_tokens


def body(prompt: str, max_tokens: int, **extra) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


@contextmanager
def busy_cpu(n: int = 2):
    """``n`` processes spinning on the CPU until the block ends."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def held(url: str) -> int:
    """Sequences the engine holds (running + waiting), from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith(("specd_running", "specd_waiting"))]
    return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in lines))


@contextmanager
def replica(tmp_path, timeout_s: float):
    args = ["--dtype", "float32", "--shutdown-timeout", str(timeout_s), "--max-running", "4"]
    args += ["--enforce-eager"]  # draining is the subject, not the compiled forward
    r = Replica(free_port(), args, tmp_path / "specd.log")
    r.start()
    try:
        r.wait_ready()
        yield r
    finally:
        r.kill()


def all_held(r: Replica, futures) -> bool:
    """The engine holds every stream (none may have ended before)."""
    assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
    return held(r.url) >= len(futures)


def draining(r: Replica) -> bool:
    """/ready answers 503: the server took the signal (it answered 200 before)."""
    code = httpx.get(f"{r.url}/ready", timeout=30).status_code
    assert code in (200, 503), code
    return code == 503


def drain_under_load(
    r: Replica, bodies: list[dict], spinners: int = 2, look: bool = True, kill_after: float = 120
) -> tuple[list[StreamResult], dict]:
    """Start ``bodies`` as streams, wait until the engine holds all of them (4 running, the rest
    queued), SIGTERM, and (``look``) once /ready answers 503, look at the server while it
    drains (``spinners`` processes keep the CPU busy meanwhile); SIGKILL after
    ``kill_after`` s (exit code -9)."""
    seen: dict = {}
    with busy_cpu(spinners), ThreadPoolExecutor(len(bodies) + 1) as pool:
        futures = [pool.submit(stream_chat, r.url, b) for b in bodies]
        wait_until(lambda: all_held(r, futures), what="the engine holding every stream")
        exit_info = pool.submit(r.terminate, kill_after)
        if look:
            wait_until(lambda: draining(r), what="/ready answering 503")
            seen["ready"] = httpx.get(f"{r.url}/ready", timeout=30)
            seen["refused"] = stream_chat(r.url, bodies[0])
        seen["code"], seen["exit_s"] = exit_info.result()
        return [f.result() for f in futures], seen


def test_sigterm_lets_every_held_stream_finish_under_cpu_load(tmp_path):
    # a drain deadline far past any wait: every stream must finish, however slow the machine
    timeout_s = 1200.0
    bodies = [body(p, 24) for p in PROMPTS]
    with replica(tmp_path, timeout_s) as r:
        reference = [stream_chat(r.url, b) for b in bodies]  # alone, before any load
        assert all(x.ok for x in reference)
        # one spinner: with two, torch's OpenMP team (2 threads on 2 cores) can take seconds a
        # step; the deadline test below uses two
        results, seen = drain_under_load(r, bodies, spinners=1, kill_after=timeout_s + 60)
    assert seen["ready"].status_code == 503
    assert seen["ready"].json()["error"]["message"] == "the server is shutting down"
    refused = seen["refused"]
    assert refused.status == 503 and refused.retry_after == "1", refused
    assert "shutting down" in (refused.error or "")
    for got, ref in zip(results, reference):
        assert got.ok, got  # a finish_reason, no error, [DONE]
        assert got.text == ref.text  # fp32: the same output alone and in a batch
    assert seen["code"] == 0  # it exited by itself once drained (not SIGKILLed, -9)


def test_drain_deadline_ends_streams_with_an_error_event_and_exits_in_time(tmp_path):
    """A 4 s deadline against streams of 1,500 tokens (minutes on 2 cores): each is cut with the
    error event, and the process ends with 0, which its watchdog allows only within the deadline
    plus ``HARD_EXIT_S`` (the server's clock). /ready and refusals while draining are the test
    above's (a 4 s window is too short to look at reliably on a loaded machine)."""
    timeout_s = 4.0
    bodies = [body(p, 1500, logit_bias=NO_END) for p in PROMPTS[:6]]
    with replica(tmp_path, timeout_s) as r:
        results, seen = drain_under_load(r, bodies, look=False)
    for got in results:
        assert got.status == 200 and got.done, got  # every stream closed properly
        assert got.error == "the server shut down before this response finished", got
        assert got.finish_reason is None
    assert seen["code"] == 0, f"the watchdog had to end the process (exit code {seen['code']})"


def test_a_second_signal_cuts_the_drain_short(tmp_path):
    """Streams of 1,500 tokens and a drain deadline past their end: after the second signal
    both end with an error event (cut: the first signal alone lets them finish) and the process
    exits (the wait bounds a hang only)."""
    bodies = [body(p, 1500, logit_bias=NO_END) for p in PROMPTS[:2]]
    with replica(tmp_path, 3600) as r, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(stream_chat, r.url, b) for b in bodies]
        wait_until(lambda: all_held(r, futures), what="the engine holding every stream")
        assert r.proc is not None
        r.proc.terminate()
        wait_until(lambda: draining(r), what="/ready answering 503")  # the first one landed
        r.proc.terminate()  # impatient: Ctrl-C twice
        r.proc.wait(1200)
        results = [f.result() for f in futures]
        assert all(x.done and x.error for x in results), results
