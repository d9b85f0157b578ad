"""vLLM's utility routes (server/tokenize.py) on the live fp32 server: /tokenize gives the ids
the generation routes run (a chat's count is the chat completion's prompt_tokens), /detokenize
inverts it, /version answers; bad ids and unknown models get OpenAI-shaped errors."""

import httpx
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "Name three colors."}]


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_as_the_tokenizer_does(live):
    text = "def add(a, b):\n    return a + b"
    got = post(live, "/tokenize", {"model": MODEL, "prompt": text})
    assert got.status_code == 200, got.text
    want = live.tokenizer(text)["input_ids"]
    body = got.json()
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == live.engine.target.max_len
    bare = post(live, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == live.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_chat_tokenizes_to_what_a_chat_completion_runs(live):
    body = post(live, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    done = httpx.post(
        f"{live.base_url}/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 1, "temperature": 0},
        timeout=120,
    ).json()
    assert body["count"] == done["usage"]["prompt_tokens"] == len(body["tokens"])
    opened = live.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    assert body["tokens"] == list(opened["input_ids"])
    closed = post(live, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert closed["count"] < body["count"] and body["tokens"][: closed["count"]] == closed["tokens"]


def test_detokenize_inverts_tokenize(live):
    text = "The quick brown fox jumps over the lazy dog."
    ids = post(live, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    got = post(live, "/detokenize", {"model": MODEL, "tokens": ids})
    assert got.status_code == 200 and got.json() == {"prompt": text}


@pytest.mark.parametrize("tokens", [[-1], [10**9], [5, 2**70]])
def test_ids_outside_the_vocabulary_are_a_400(live, tokens):
    got = post(live, "/detokenize", {"tokens": tokens})
    assert got.status_code == 400
    err = got.json()["error"]
    assert err["param"] == "tokens" and err["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_and_a_bad_body_a_400(live):
    got = post(live, "/tokenize", {"model": "nope", "prompt": "hi"})
    assert got.status_code == 404 and got.json()["error"]["param"] == "model"
    got = post(live, "/tokenize", {"model": MODEL})  # neither prompt nor messages
    assert got.status_code == 400 and "error" in got.json()
    got = post(live, "/detokenize", {"model": "nope", "tokens": [1]})
    assert got.status_code == 404


def test_version(live):
    from server.app import create_app  # noqa: F401 -- the app's version is the one served

    got = httpx.get(f"{live.url}/version", timeout=10)
    assert got.status_code == 200 and isinstance(got.json()["version"], str)
    assert got.json()["version"] == httpx.get(f"{live.url}/openapi.json").json()["info"]["version"]
