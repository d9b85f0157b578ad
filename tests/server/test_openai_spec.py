"""Every kind of response body and SSE chunk specd answers validates against the schemas of
OpenAI's official OpenAPI spec (vendored in openai_schemas.json with its commit): completions
and chat, plain and streamed, with logprobs, usage, tool calls and n > 1; the model list and a
model; errors.

Read as the spec means it: its OpenAPI 3.0 ``nullable: true`` allows null. Two places where the
legacy completions schema cannot describe what OpenAI itself sends are relaxed, and only there:
a streamed completions chunk before the last has ``finish_reason: null`` (the schema serves
streamed chunks too, with finish_reason required), and ``echo`` + ``logprobs`` give the first
prompt token a null logprob and null alternatives (nothing precedes it; lm-evaluation-harness
reads it so)."""

import json
from pathlib import Path

import httpx
import jsonschema_rs
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.real_model


def _nullable(node):
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema: the node, or null."""
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out


def _or_null(node: dict) -> dict:
    return {"anyOf": [node, {"type": "null"}]}


SPEC = _nullable(json.loads((Path(__file__).parent / "openai_schemas.json").read_text()))
_choice = SPEC["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]
_legacy_lp = _choice["items"]["properties"]["logprobs"]["anyOf"][0]["properties"]
for _key in ("token_logprobs", "top_logprobs"):  # echo: the first prompt token's are null
    _legacy_lp[_key]["items"] = _or_null(_legacy_lp[_key]["items"])
STREAMED = json.loads(json.dumps(SPEC))  # chunks before the last: finish_reason null
_stream_choice = STREAMED["components"]["schemas"]["CreateCompletionResponse"]["properties"]
_finish = _stream_choice["choices"]["items"]["properties"]
_finish["finish_reason"] = _or_null(_finish["finish_reason"])
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


def check(name: str, body: dict, spec: dict = SPEC) -> None:
    doc = {"components": spec["components"], "$ref": f"#/components/schemas/{name}"}
    errors = [
        f"{list(e.instance_path)}: {e.message[:120]}"
        for e in jsonschema_rs.validator_for(doc).iter_errors(body)
    ]
    assert not errors, (name, errors[:3], body)


def sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
CHATS = {
    "plain": {},
    "logprobs n=2": {"logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 1, "seed": 1},
    "tools": {"tools": [TOOL], "tool_choice": "required", "max_tokens": 60},
    "json": {"response_format": {"type": "json_object"}, "max_tokens": 30},
}
COMPLETIONS = {"plain": {}, "logprobs echo": {"logprobs": 2, "echo": True}, "n=2": {"n": 2}}


@pytest.mark.parametrize("extra", list(CHATS.values()), ids=list(CHATS))
def test_chat_bodies_and_chunks(live, extra):
    url = f"{live.base_url}/chat/completions"
    check("CreateChatCompletionResponse", httpx.post(url, json=CHAT | extra, timeout=300).json())
    body = CHAT | extra | {"stream": True, "stream_options": {"include_usage": True}}
    for chunk in sse(url, body):
        check("CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("extra", list(COMPLETIONS.values()), ids=list(COMPLETIONS))
def test_completion_bodies_and_chunks(live, extra):
    url = f"{live.base_url}/completions"
    check("CreateCompletionResponse", httpx.post(url, json=COMPLETION | extra, timeout=300).json())
    body = COMPLETION | extra | {"stream": True, "stream_options": {"include_usage": True}}
    for chunk in sse(url, body):
        check("CreateCompletionResponse", chunk, STREAMED)


def test_models_and_errors(live):
    check("ListModelsResponse", httpx.get(f"{live.base_url}/models").json())
    check("Model", httpx.get(f"{live.base_url}/models/{MODEL}").json())
    for r in (
        httpx.get(f"{live.base_url}/models/nope"),
        httpx.post(f"{live.base_url}/chat/completions", json=CHAT | {"temperature": 9}),
        httpx.post(f"{live.base_url}/chat/completions", json=CHAT | {"model": "nope"}),
    ):
        assert r.status_code in (400, 404)
        check("ErrorResponse", r.json())
