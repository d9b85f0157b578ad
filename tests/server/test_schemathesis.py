"""schemathesis against specd's own OpenAPI schema (/openapi.json): every operation, valid and
invalid inputs (positive and negative generation), both generation endpoints with stream false and
true: never a 5xx, every response conforms to the documented schema (status code, content type,
body), and every streamed event parses as the documented chunk (or an error event) up to [DONE].

The engine is a tiny random Llama with the real tokenizer's vocabulary (fast; the wire format
does not depend on the weights). Examples per operation, valid and invalid apart (so a schema
change cannot starve the valid ones): SPECD_SCHEMATHESIS_EXAMPLES each (default 15); a longer
run: SPECD_SCHEMATHESIS_EXAMPLES=500 pytest tests/server/test_schemathesis.py
"""

import json
import os

import pytest
import schemathesis

# imported at collection, while the process has one thread: imported lazily inside the schema
# fixture, pytest's assertion rewriting parsed schemathesis' modules while the live server's
# threads could compile code too, and CPython 3.11's AST state is not thread-safe (one suite run
# failed with "AST constructor recursion depth mismatch").
import schemathesis.specs.openapi.schemas
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from engine.sampling.grammar import GrammarCompiler
from engine.worker.worker import EngineWorker
from server import protocol as P
from server.app import create_app
from server.convert import EngineCapacity
from server.settings import ServerSettings
from tests import helpers
from tests.conftest import MODEL

pytestmark = pytest.mark.real_model  # the real tokenizer
EXAMPLES = int(os.environ.get("SPECD_SCHEMATHESIS_EXAMPLES", "15"))
SLOW = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def tiny_app(real_fp32):
    tok = real_fp32[1]
    m = helpers.tiny_llama(0, layers=1, vocab=len(tok), hidden=16, heads=2, kv_heads=1)
    engine = helpers.engine_for(m, "ngram", slots=4, max_len=192, eos=[tok.eos_token_id])
    engine.grammars = GrammarCompiler(tok, engine.vocab_size)  # structured outputs run too
    worker = EngineWorker(engine, max_queued=64)
    worker.start()
    capacity = EngineCapacity(engine.target.max_len, engine.vocab_size, "ngram", 8)
    yield create_app(worker, tok, MODEL, capacity, ServerSettings(max_choices=8))
    worker.shutdown()


@pytest.fixture(scope="module")
def api_schema(tiny_app):
    return schemathesis.openapi.from_asgi("/openapi.json", tiny_app)


CHUNK = {"/v1/completions": P.CompletionResponse, "/v1/chat/completions": P.ChatCompletionChunk}


def check_stream(path: str, response) -> None:
    """Every SSE event is a documented chunk or an error event; the last is [DONE]."""
    datas = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", response.text[-300:]
    for d in datas[:-1]:
        obj = json.loads(d)
        if "error" in obj:
            P.ErrorResponse.model_validate(obj)
        else:
            CHUNK[path].model_validate(obj)


STATUSES: dict = {}  # (method path, stream) -> {status: count}, to show what was exercised


UNSUPPORTED = (
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "best_of",
    "suffix",
    "tools",
    "tool_choice",
    "response_format",
    "speculation",
    "top_logprobs",
    "deterministic",
    # vLLM's fields (tests/server/test_vllm_fields.py): most values are refused or constrain
    "min_p", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "prompt_logprobs", "bad_words", "use_beam_search", "length_penalty", "add_special_tokens",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "prompt_embeds", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
    "reasoning_effort", "include_reasoning",
)  # fmt: skip


def small(case, stream: bool | None) -> None:
    """Pin ``stream``, keep generations short (a few tokens), and steer 3 of 4 bodies towards
    the engine (the served model name, message content present, no refused extensions), so that
    the fuzzing reaches generation and not only the refusals (those have their own tests)."""
    body = case.body
    if not isinstance(body, dict) or stream is None:
        return
    body["stream"] = stream
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None:
            body.pop(key, None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and 8 < v <= 192:
            body[key] = 1 + int(v) % 8
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if len(json.dumps(body, default=str)) % 4 == 0:
        return  # left as generated
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in UNSUPPORTED:
        body.pop(key, None)
    if isinstance(body.get("n"), int):
        body["n"] = 1 + body["n"] % 2
    for m in body.get("messages") or []:
        if isinstance(m, dict) and m.get("content") is None:
            m["content"] = "hi"


def operations(schema):
    return {(op.ok().method.upper(), op.ok().path): op.ok() for op in schema.get_all_operations()}


OPERATIONS = [
    ("POST", "/v1/completions", False),
    ("POST", "/v1/completions", True),
    ("POST", "/v1/chat/completions", False),
    ("POST", "/v1/chat/completions", True),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/{model}", None),
    ("GET", "/health", None),
    ("GET", "/ready", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", None),
    ("POST", "/detokenize", None),
    ("GET", "/version", None),
]


def test_schema_lists_every_operation(api_schema):
    assert set(operations(api_schema)) == {(m, p) for m, p, _ in OPERATIONS}


@pytest.mark.parametrize(
    "method,path,stream",
    OPERATIONS,
    ids=[f"{m} {p}{'' if s is None else ' stream' if s else ' json'}" for m, p, s in OPERATIONS],
)
def test_operation(api_schema, method, path, stream):
    op = operations(api_schema)[(method, path)]

    def check(case, positive: bool) -> None:
        if positive:  # (schema-invalid cases go as generated)
            small(case, stream)
        # no 5xx; status, content type and body as documented; schema-invalid input refused.
        # (Schema-valid input may still get a documented 400 / 404: unknown model, max_tokens past
        # the context, n above the cap... so "positive data accepted" is not checked.)
        response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
        seen = STATUSES.setdefault((f"{method} {path}", stream), {})
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code == 200 and stream:
            check_stream(path, response)

    # schema-valid and schema-invalid cases apart: each gets its examples, whatever the schema
    @given(case=op.as_strategy(GenerationMode.POSITIVE))
    @SLOW
    def run_positive(case):
        check(case, True)

    @given(case=op.as_strategy(GenerationMode.NEGATIVE))
    @SLOW
    def run_negative(case):
        check(case, False)

    run_positive()
    if method == "POST":  # (a GET has no input to break)
        run_negative()
    seen = STATUSES[(f"{method} {path}", stream)]
    print(f"{method} {path} stream={stream}: statuses {sorted(seen.items())}")
    if stream is not None:  # generation really ran, not only refusals
        assert seen.get(200, 0) > 0, seen
