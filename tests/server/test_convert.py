"""The one HTTP -> engine conversion of the ``speculation`` extension: which defaults win."""

import pytest

from engine.records.params import SpecParams
from server.convert import EngineCapacity, _spec
from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.settings import ServerSettings

SETTINGS = ServerSettings(spec_k_max=6)
NGRAM = EngineCapacity(max_model_len=2048, vocab_size=100, drafter="ngram")


def spec(option, capacity=NGRAM):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if option is not None:
        body["speculation"] = option
    return _spec(ChatCompletionRequest(**body), SETTINGS, capacity)


def test_default_is_the_engine_controller_capped_by_the_server():
    assert spec(None) == SpecParams(enabled=True, k=None, k_max=6)
    assert spec(None, EngineCapacity(2048, 100, "none")).enabled is False


@pytest.mark.parametrize(
    "option,expected",
    [
        ({}, SpecParams(enabled=True, k=None, k_max=6)),
        ({"enabled": False}, SpecParams(enabled=False, k=None, k_max=6)),
        ({"k": 3}, SpecParams(enabled=True, k=3, k_max=6)),  # a fixed K for every round
        ({"k": 0}, SpecParams(enabled=False, k=0, k_max=6)),  # plain decoding
        ({"k_max": 2}, SpecParams(enabled=True, k=None, k_max=2)),  # adaptive, at most 2
        ({"k_max": 0}, SpecParams(enabled=False, k=None, k_max=0)),
        ({"method": "ngram", "k": 6}, SpecParams(enabled=True, k=6, k_max=6)),
    ],
)
def test_speculation_option(option, expected):
    assert spec(option) == expected


@pytest.mark.parametrize(
    "option,param",
    [
        ({"k": 7}, "speculation.k"),
        ({"k_max": 9}, "speculation.k_max"),
        ({"method": "draft"}, "speculation.method"),  # a model-based drafter, not n-gram
        ({"method": "eagle3"}, "speculation.method"),
    ],
)
def test_refused(option, param):
    with pytest.raises(APIError) as e:
        spec(option)
    assert e.value.status == 400 and e.value.param == param


def params(deterministic, mode: str):
    """The engine's SamplingParams of a chat request sending ``deterministic`` to an engine in
    deterministic ``mode``."""
    from server.convert import _params

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    if deterministic is not None:
        body["deterministic"] = deterministic
    cap = EngineCapacity(2048, 100, "ngram", deterministic=mode)
    return _params(ChatCompletionRequest(**body), SETTINGS, cap, 3, 4, None, None)


@pytest.mark.parametrize(
    "sent,mode,expected",
    [(None, "off", False), (True, "request", True), (None, "request", False)]
    + [(False, "request", False), (None, "always", True), (False, "always", True)],
)
def test_deterministic_follows_the_request_within_the_engine_mode(sent, mode, expected):
    assert params(sent, mode).deterministic is expected


def test_deterministic_is_refused_by_name_where_the_mode_is_off():
    with pytest.raises(APIError) as e:
        params(True, "off")
    assert e.value.status == 400 and e.value.param == "deterministic"
    assert "--deterministic" in e.value.message


def test_the_cap_is_the_engines_k_max_where_it_is_lower():
    """A server whose ``spec_k_max`` (6 here) is above the engine's K_max (4) refuses a K the
    engine would cut: the cap is the lower of the two."""
    low = EngineCapacity(2048, 100, "eagle3", k_max=4)
    assert spec(None, low) == SpecParams(enabled=True, k=None, k_max=4)
    assert spec({"k": 4, "method": "eagle3"}, low) == SpecParams(enabled=True, k=4, k_max=4)
    assert spec({"method": "draft"}, low).enabled  # "draft": the configured model-based one
    for option in ({"k": 5}, {"k_max": 6}):
        with pytest.raises(APIError) as e:
            spec(option, low)
        assert e.value.status == 400 and "<= 4" in e.value.message


def test_a_temperature_near_zero_is_greedy_wherever_params_are_made():
    """The clamp lives in the engine's parameters, so ``specd generate`` and the benchmarks get
    it as the server does."""
    from engine.records.params import SamplingParams

    assert (
        SamplingParams(temperature=1e-6).greedy
        and SamplingParams(temperature=1e-6).temperature == 0
    )
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
