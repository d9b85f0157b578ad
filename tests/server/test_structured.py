"""Structured outputs on the real model (fp32): every output at T = 0 and T = 1 parses and
validates against its schema (nested objects, arrays, enums, anyOf, $ref, string formats);
greedy output with speculation equals it without, token for token; the other constraint kinds
(json_object, regex, choice, Lark) hold; bad schemas are refused with a 400."""

import json
import re

import jsonschema_rs
import openai
import pytest

from tests.conftest import MODEL

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


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=300)


def schema_format(schema, name="s"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, ITEMS], ids=["person", "items"])
def test_outputs_validate_and_greedy_is_the_same_with_speculation(client, schema):
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    kw = dict(model=MODEL, messages=ASK, max_tokens=300, response_format=schema_format(schema))
    greedy = {}
    for spec in ({"enabled": False}, {"k": 4}):
        r = client.chat.completions.create(
            **kw, temperature=0, logprobs=True, extra_body={"speculation": spec}
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        assert validator.is_valid(json.loads(c.message.content)), c.message.content
        greedy[spec.get("k", 0)] = [t.token for t in c.logprobs.content]
    assert greedy[4] == greedy[0]  # token for token
    sampled = client.chat.completions.create(**kw, temperature=1.0, seed=5, n=4)
    for c in sampled.choices:
        assert c.finish_reason == "stop" and validator.is_valid(json.loads(c.message.content))


def test_json_object_regex_choice_and_lark(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    comp = dict(model=MODEL, prompt="The date today is", temperature=1.0, seed=3, max_tokens=20)
    r = client.completions.create(
        **comp, extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}}
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text)
    choice = ["yes", "no", "maybe"]
    r = client.completions.create(**comp, extra_body={"structured_outputs": {"choice": choice}})
    assert r.choices[0].text in choice
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    r = client.completions.create(**comp, extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", r.choices[0].text)


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
