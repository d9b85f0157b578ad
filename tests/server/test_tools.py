"""Tool calling through the official client on the real model, for every tool_choice, streamed
and not: calls come back as OpenAI's message.tool_calls / delta.tool_calls with arguments that
validate against the tool's parameters; earlier calls and tool results round-trip in the
history; inconsistent tool requests get a 400. On the default config's server
(bf16, 4-bit, compiled, EAGLE-3 head + n-gram: tests/server/conftest.py), with speculation
forced (``speculation.k``) and checked from ``usage.speculation``; the streamed and the
non-streamed response are compared in deterministic mode on the bf16 server (``served.exact``)."""

import json

import jsonschema_rs
import openai
import pytest

from tests.conftest import MODEL
from tests.helpers import assert_speculated

pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "get_time"}}, "auto", "none"]

# the shipped server only (the CI's time): token-exact fp32 over HTTP is test_openai_client's
SERVED = ["live_default"]


SPEC = {"speculation": {"k": 3}}


def client_of(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=300)


def spec_of(r) -> tuple[int, int]:
    """A response's ``usage.speculation`` as (drafted, accepted)."""
    s = r.usage.model_extra["speculation"]
    return s["drafted_tokens"], s["accepted_tokens"]


def check_calls(calls, allowed):
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in allowed
        args = json.loads(c.function.arguments)
        assert jsonschema_rs.validator_for(tools[c.function.name]).is_valid(args)


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named", "auto", "none"])
def test_tool_choice_streamed_and_not(served, choice):
    client = client_of(served)
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    kw |= dict(temperature=0, max_tokens=120, extra_body={**SPEC, **served.exact})
    r = client.chat.completions.create(**kw)
    m, reason = r.choices[0].message, r.choices[0].finish_reason
    # speculation ran: drafts (a call's name and argument values: few, often all rejected) or
    # the grammar's forced runs (its keys and punctuation, free drafts): fewer target passes
    assert_speculated([spec_of(r)], can_reject=False)
    passes = r.usage.model_extra["speculation"]["target_passes"]
    assert passes < r.usage.completion_tokens
    if choice == "none":
        assert m.tool_calls is None and m.content and reason in ("stop", "length")
        return
    if choice == "auto" and m.tool_calls is None:  # a plain answer (cut or not)
        assert m.content and reason in ("stop", "length")
    else:
        named = isinstance(choice, dict)
        allowed = {"get_time"} if named else {"get_weather", "get_time"}
        assert m.content is None and m.tool_calls
        check_calls(m.tool_calls, allowed)
        assert reason == ("stop" if named else "tool_calls")
        if named:
            assert len(m.tool_calls) == 1
    streamed: dict[int, dict] = {}
    content, last, pieces = "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            first = tc.index not in streamed  # a call's first delta names it, later ones do not
            assert (tc.id is not None, tc.function.name is not None) == (first, first)
            entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
            pieces += 1
        last = chunk.choices[0].finish_reason or last
    assert last == reason
    if m.tool_calls:
        want = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        assert [streamed[i] for i in sorted(streamed)] == want
        assert pieces > len(want)  # the arguments came as the model wrote them, in pieces
    else:
        assert content == m.content


def test_history_with_calls_and_results_and_single_calls(served):
    client = client_of(served)
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        temperature=0,
        max_tokens=80,
        extra_body=SPEC,
    )
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    runs = [spec_of(r)]
    one = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=2,
        n=3,
        max_tokens=120,
        extra_body=SPEC,  # sampled and seeded: drafts only with a K of its own
    )
    for c in one.choices:
        assert len(c.message.tool_calls) == 1
    runs.append(spec_of(one))
    assert_speculated(runs, can_reject=True)


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ],
)
def test_bad_tool_requests(live, patch, param):
    import httpx

    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **patch}
    r = httpx.post(f"{live.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
