"""The model's sampling defaults (vLLM's --generation-config): read from a generation config's
sampling keys (``auto``: the model's; a folder's; none with ``vllm``), applied where a request
sends no value of its own, after the server config's ``default_*`` -- shown on the live fp32
model: a server whose model defaults to top_k 1 and a repetition penalty answers a request that
sets neither as an explicit request for them answers, and a request's own values win."""

import json

import httpx
import pytest
from transformers import GenerationConfig

from server.app import create_app
from server.assembly import engine_capacity
from server.convert import EngineCapacity, _params
from server.generation_defaults import resolve, sampling_defaults
from server.protocol import CompletionRequest
from server.settings import ServerSettings
from tests.conftest import MODEL, QUIET, serving


class _Model:
    def __init__(self, **gen):
        self.generation_config = GenerationConfig(**gen)


def test_the_sampling_keys_of_a_generation_config():
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_new_tokens": 99}
    gen |= {"repetition_penalty": 1.1, "do_sample": True, "eos_token_id": 2, "top_a": True}
    assert sampling_defaults(gen) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_tokens": 99,
        "repetition_penalty": 1.1,
    }  # fmt: skip


def test_auto_vllm_and_a_folder(tmp_path):
    model = _Model(temperature=0.6, top_p=0.9, do_sample=True)
    assert resolve("auto", model) == {"temperature": 0.6, "top_p": 0.9}
    assert resolve("vllm", model) == {}
    assert resolve("auto", _Model()) == {}  # transformers' own defaults are not the model's
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5, "bos_token_id": 1}))
    assert resolve(str(tmp_path), model) == {"top_k": 5}
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        resolve(str(tmp_path / "nothing"), model)


def params(defaults, settings=None, **body):
    cap = EngineCapacity(2048, 100, "ngram", sampling_defaults=defaults)
    req = CompletionRequest(model="m", prompt="x", **body)
    return _params(req, settings or ServerSettings(), cap, 1, req.max_tokens, 16, None)


def test_which_default_wins():
    d = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_tokens": 99}
    d["repetition_penalty"] = 1.1
    p = params(d)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1,
    )  # fmt: skip
    assert p.max_tokens == 99
    # the request's own values win, zeros included
    p = params(d, temperature=0, top_p=1, top_k=-1, min_p=0, repetition_penalty=1, max_tokens=3)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0, 1, 0, 0, 1)
    assert p.max_tokens == 3
    # the server config's default_* come before the model's
    s = ServerSettings(default_temperature=0.3, default_top_p=0.5, default_max_tokens=7)
    p = params(d, s)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.3, 0.5, 7)
    # none: OpenAI's
    p = params({})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1, 1, 0, 0, 1)
    assert p.max_tokens == 16


@pytest.mark.real_model
def test_the_models_defaults_apply_over_http(built, live, tmp_path):
    """A server over the live engine whose generation config (a folder's, as
    ``--generation-config FOLDER`` reads it) sets top_k 1, a repetition penalty and
    max_new_tokens: a sampled request that sets none of them answers what an explicit request
    for them answers on the plain server; one that sets its own gets its own."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 1, "repetition_penalty": 1.4, "max_new_tokens": 12})
    )
    capacity = engine_capacity(built, str(tmp_path))
    assert capacity.sampling_defaults == {"top_k": 1, "repetition_penalty": 1.4, "max_tokens": 12}
    assert engine_capacity(built, "vllm").sampling_defaults == {}
    app = create_app(live.worker, built.tokenizer, MODEL, capacity, ServerSettings(**QUIET))
    prompt = "red green blue, red green blue, red green blue,"
    with serving(app) as url, httpx.Client(timeout=300) as c:

        def complete(base, **body):
            r = c.post(f"{base}/completions", json={"model": MODEL, "prompt": prompt, **body})
            assert r.status_code == 200, r.text
            return r.json()

        defaulted = complete(f"{url}/v1", temperature=1.0, seed=5, n=2)
        explicit = complete(
            live.base_url, temperature=1.0, top_k=1, repetition_penalty=1.4, max_tokens=12
        )
        plain = complete(live.base_url, temperature=0, max_tokens=12)
        texts = {ch["text"] for ch in defaulted["choices"]}
        assert texts == {explicit["choices"][0]["text"]}  # top_k 1: the penalised greedy answer
        assert defaulted["usage"]["completion_tokens"] == 2 * 12
        assert explicit["choices"][0]["text"] != plain["choices"][0]["text"]  # the penalty acts
        own = complete(f"{url}/v1", temperature=0, repetition_penalty=1.0, max_tokens=12)
        assert own["choices"][0]["text"] == plain["choices"][0]["text"]
        short = complete(f"{url}/v1", temperature=0, max_tokens=3)
        assert short["usage"]["completion_tokens"] == 3
