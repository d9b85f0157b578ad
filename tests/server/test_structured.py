"""Structured outputs on the real model, on the default config's server (bf16,
4-bit, compiled, EAGLE-3 head + n-gram: tests/server/conftest.py): every output at T = 0 and
T = 1 parses and validates against its schema (nested objects, arrays, enums, anyOf, $ref,
string formats); greedy output with speculation equals it without, token for token (deterministic
mode on the bf16 server); the other constraint kinds (json_object, regex, choice, Lark) hold,
sampled with speculation forced; bad schemas are refused with a 400. Speculation is forced
(``speculation.k``: a seeded sampled request drafts only then) and checked from
``usage.speculation``."""

import json
import re

import jsonschema_rs
import openai
import pytest

from tests.conftest import MODEL
from tests.helpers import assert_speculated

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "born": {"type": "string", "format": "date"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
        "contact": {
            "anyOf": [
                {"type": "string", "format": "email", "maxLength": 30},
                {"type": "null"},
            ]
        },
    },
    "required": ["name", "age", "born", "role", "tags", "address", "contact"],
    "additionalProperties": False,
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        }
    },
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 4,
}
ASK = [{"role": "user", "content": "Describe a person called Ada as JSON."}]

# the shipped server only (the CI's time): token-exact fp32 over HTTP is test_openai_client's
SERVED = ["live_default"]


def client_of(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=300)


def spec_of(r) -> tuple[int, int]:
    """A response's ``usage.speculation`` as (drafted, accepted)."""
    s = r.usage.model_extra["speculation"]
    return s["drafted_tokens"], s["accepted_tokens"]


def schema_format(schema, name="s"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, ITEMS], ids=["person", "items"])
def test_outputs_validate_and_greedy_is_the_same_with_speculation(served, schema):
    client = client_of(served)
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    kw = dict(model=MODEL, messages=ASK, max_tokens=300, response_format=schema_format(schema))
    greedy, runs = {}, []
    for spec in ({"enabled": False}, {"k": 4}):
        r = client.chat.completions.create(
            **kw, temperature=0, logprobs=True, extra_body={"speculation": spec, **served.exact}
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        assert validator.is_valid(json.loads(c.message.content)), c.message.content
        greedy[spec.get("k", 0)] = [t.token for t in c.logprobs.content]
        runs.append(spec_of(r))
    assert greedy[4] == greedy[0]  # token for token
    assert runs[0] == (0, 0)
    assert_speculated(runs[1:], can_reject=True)
    sampled = client.chat.completions.create(
        **kw, temperature=1.0, seed=5, n=4, extra_body={"speculation": {"k": 3}}
    )
    for c in sampled.choices:
        assert c.finish_reason == "stop" and validator.is_valid(json.loads(c.message.content))
    assert_speculated([spec_of(sampled)], can_reject=True)  # sampled drafts, masked


def test_json_object_regex_choice_and_lark(served):
    client = client_of(served)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give Ada's name and age as a short JSON object."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
        # exact: in bf16 the greedy text may depend on the server's prefix cache (and then run
        # past max_tokens); the deterministic forward's does not
        extra_body={"speculation": {"k": 3}, **served.exact},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    runs = [spec_of(r)]
    comp = dict(model=MODEL, prompt="The date today is", temperature=1.0, seed=3, max_tokens=20)
    spec = {"speculation": {"k": 3}}
    r = client.completions.create(
        **comp, extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, **spec}
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text)
    runs.append(spec_of(r))
    choice = ["yes", "no", "maybe"]
    r = client.completions.create(
        **comp, extra_body={"structured_outputs": {"choice": choice}, **spec}
    )
    assert r.choices[0].text in choice
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    r = client.completions.create(
        **comp, extra_body={"structured_outputs": {"grammar": lark}, **spec}
    )
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", r.choices[0].text)
    runs.append(spec_of(r))
    assert_speculated(runs, can_reject=True)


@pytest.mark.parametrize(
    "body",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            }
        },
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "xml"}},
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    ],
)
def test_bad_constraints_are_refused(live, body):
    import httpx

    r = httpx.post(
        f"{live.base_url}/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(("response_format", "structured_outputs"))
