"""A ``vllm serve`` command line as vLLM's docs write one (the model positional, the quickstart's
``--dtype auto --api-key``, the engine and logging flags of its engine-arguments page, the n-gram
``--speculative-config`` of its speculative-decoding page) starts a real ``specd serve`` process
that serves: the official openai client, with the key, gets a streamed chat answer under the
served name, speculation ran, and a request without the key is refused."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from loadtest.replica import Replica, free_port
from tests.conftest import REAL_SPEC

KEY = "token-abc123"


@pytest.fixture
def vllm_replica(tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    argv = [REAL_SPEC, "--dtype", "auto", "--api-key", KEY]
    argv += ["--served-model-name", "smollm2", "--max-model-len", "2048", "--max-num-seqs", "4"]
    argv += ["--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--seed", "0"]
    argv += ["--tensor-parallel-size", "1", "--disable-log-requests", "--enforce-eager"]
    argv += ["--uvicorn-log-level", "warning", "--generation-config", "auto"]
    argv += ["--speculative-config", json.dumps(spec)]
    r = Replica(free_port(), argv, tmp_path / "specd.log")
    r.start()
    try:
        r.wait_ready(timeout=600)
        yield r
    finally:
        r.kill()


def test_a_vllm_docs_command_line_starts_specd_and_serves(vllm_replica):
    url = vllm_replica.url
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Repeat after me: red green blue, red green blue."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert text.strip() and usage is not None and usage.completion_tokens > 0
    spec = (usage.model_extra or {})["speculation"]  # the --speculative-config drafter ran
    assert spec["drafted_tokens"] > 0, spec
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 401 and r.json()["error"]["type"]
