"""The long-context bench's measures: decode speed counts the tokens after the first over the
time from the first streamed content to the last (the prefill excluded), every request asks for
ignore_eos; each prompt goes twice to every mode, the modes' order alternating by prompt, and the
prefill time is read only from a prompt's first send on the server (the others may hit its
prompt cache, whichever mode sent them)."""

from contextlib import contextmanager

import pytest

from loadtest.bench import long_context


class Lines:
    def __init__(self, lines):
        self.status_code, self.lines = 200, lines

    def iter_lines(self):
        yield from self.lines


def test_decode_speed_excludes_the_prefill_and_counts_the_usage(monkeypatch):
    clock = iter([0.0, 2.0, 2.5, 3.0, 3.1])  # sent, first content (TTFT 2 s), two more, done
    monkeypatch.setattr(long_context.time, "perf_counter", lambda: next(clock))
    bodies = []
    chunk = 'data: {"choices": [{"delta": {"content": "x"}}]}'
    usage = 'data: {"choices": [], "usage": {"completion_tokens": 11, "prompt_tokens": 6000}}'

    @contextmanager
    def stream(method, url, json, timeout):
        bodies.append(json)
        yield Lines([chunk, chunk, chunk, usage, "data: [DONE]"])

    monkeypatch.setattr(long_context.httpx, "stream", stream)
    r = long_context.send("http://x", "m", [], 10, {"speculation": {"enabled": False}})
    assert r["ttft_s"] == 2.0 and r["decode_tok_s"] == pytest.approx(10 / 1.0)
    assert r["prompt_tokens"] == 6000
    assert bodies[0]["ignore_eos"] is True and bodies[0]["speculation"] == {"enabled": False}


def test_each_prompt_twice_to_every_mode_alternating_and_prefill_from_cold_sends(monkeypatch):
    sent = []

    def send(base, model, msgs, max_tokens, extra):
        sent.append((msgs, extra.get("m")))
        n = len(sent)
        return {"ttft_s": float(n), "decode_tok_s": 1.0, "prompt_tokens": 5, "cached_tokens": 4}

    monkeypatch.setattr(long_context, "send", send)
    modes = {"a": {"m": "a"}, "b": {"m": "b"}}
    out = long_context.run("http://x", "m", ["p0", "p1"], modes, 8)
    assert [m for _, m in sent] == ["a", "a", "b", "b", "b", "b", "a", "a"]
    assert [p for p, _ in sent] == ["p0"] * 4 + ["p1"] * 4
    # a prompt's first send on the server is the only cold one: a's first of p0, b's first of p1
    assert [r["cold"] for r in out["a"]] == [True, False, False, False]
    assert [r["cold"] for r in out["b"]] == [False, False, True, False]
    a, b = long_context.summary(out["a"]), long_context.summary(out["b"])
    assert a["prefill_s"] == 1.0 and b["prefill_s"] == 5.0 and a["cached_tokens_warm"] == 4
