"""vLLM's extra request fields on the live fp32 server (n-gram drafter): every field vLLM's
OpenAI server accepts is declared, and each is honoured -- its effect shown, with the control
that shows the output would have been otherwise -- or refused with a 400 naming it while a
request beside it is served unharmed. A field neither vLLM nor OpenAI knows is still ignored.
Comparisons of speculation with plain decoding prove speculation ran (``usage.speculation``)."""

import asyncio
import itertools
import json
import re

import httpx
import pytest
import torch

from server import protocol as P
from tests.conftest import MODEL
from tests.helpers import assert_speculated
from tests.server.helpers import assert_error

pytestmark = pytest.mark.real_model

PLAIN = {"speculation": {"enabled": False}}
HELLO = [{"role": "user", "content": "Say hello."}]
PROMPT = "red green blue, red green blue, red green blue, red green"

# the fields of vLLM's ChatCompletionRequest / CompletionRequest beyond OpenAI's own
# (vLLM's OpenAI protocol module, entrypoints/openai)
VLLM_COMMON = [
    "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "use_beam_search", "add_special_tokens", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "structured_outputs",
]  # fmt: skip
VLLM_CHAT = VLLM_COMMON + [
    "best_of", "echo", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
    "reasoning_effort", "include_reasoning", "parallel_tool_calls", "tools", "tool_choice",
]  # fmt: skip
VLLM_COMPLETION = VLLM_COMMON + ["best_of", "echo", "suffix", "prompt_embeds"]


def test_every_vllm_field_is_declared():
    """Declared fields are honoured or refused by server/convert.py; an undeclared one would be
    ignored, as a field neither vLLM nor OpenAI knows is."""
    chat = set(P.ChatCompletionRequest.model_fields)
    completion = set(P.CompletionRequest.model_fields)
    assert not [f for f in VLLM_CHAT if f not in chat]
    assert not [f for f in VLLM_COMPLETION if f not in completion]
    assert "continuous_usage_stats" in P.StreamOptions.model_fields


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.base_url, timeout=300) as c:
        yield c


def chat(http, **body):
    r = http.post("/chat/completions", json={"model": MODEL, "messages": HELLO, **body})
    assert r.status_code == 200, r.text
    return r.json()


def complete(http, **body):
    r = http.post("/completions", json={"model": MODEL, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def spec_of(r) -> tuple[int, int]:
    s = r["usage"]["speculation"]
    return s["drafted_tokens"], s["accepted_tokens"]


def token_ids(choice) -> list[int]:
    """A completion choice's token ids (return_tokens_as_token_ids with logprobs)."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


REFUSED = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("logits_processors", ["my.Processor"]),
    ("priority", 1),
    ("cache_salt", "salt"),
    ("return_token_ids", True),
    ("kv_transfer_params", {"x": 1}),
    ("vllm_xargs", {"x": 1}),
    ("guided_whitespace_pattern", " "),
    ("guided_decoding_backend", "xgrammar"),
    ("best_of", 3),
]
CHAT_REFUSED = [
    ("chat_template", "{{ messages }}"),
    ("mm_processor_kwargs", {"x": 1}),
    ("structural_tag", "{}"),
    ("include_reasoning", False),
]


def test_refused_fields_answer_400_naming_them_and_a_request_beside_them_is_served(live):
    """Each field specd cannot honour: 400, ``param`` the field, OpenAI's error shape; a greedy
    request sent beside all of them answers what it answers alone."""
    cases = [("/completions", {"prompt": PROMPT}, f, v) for f, v in REFUSED]
    cases += [("/completions", {"prompt": PROMPT}, "prompt_embeds", "AAAA")]
    cases += [("/chat/completions", {"messages": HELLO}, f, v) for f, v in REFUSED + CHAT_REFUSED]
    cases += [
        (
            "/chat/completions",
            {"messages": HELLO, "stream": True},
            "stream_options.continuous_usage_stats",
            None,
        )
    ]
    good = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=live.base_url, timeout=300) as c:
            alone = await c.post("/completions", json=good)

            async def refused(path, base, field, value):
                body = {"model": MODEL, "max_tokens": 4, **base}
                if field.startswith("stream_options"):
                    body["stream_options"] = {"continuous_usage_stats": True}
                else:
                    body[field] = value
                return field, await c.post(path, json=body)

            beside, *answers = await asyncio.gather(
                c.post("/completions", json=good), *(refused(*x) for x in cases)
            )
            return alone, beside, answers

    alone, beside, answers = asyncio.run(main())
    for field, r in answers:
        assert_error(r, 400, field)
    assert beside.status_code == 200
    assert beside.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]


def test_unknown_fields_are_ignored(http):
    r = chat(http, max_tokens=2, not_a_field_anyone_knows=123)
    assert r["choices"][0]["message"]["content"] is not None


def test_min_tokens_runs_past_where_the_answer_stopped(http):
    """Greedy: the answer ends at its EOS after L tokens; with min_tokens L + 8 the EOS may not
    end it before, so the output runs on, the same answer first (the EOS was the only change),
    and speculation gives the same tokens as plain decoding."""
    ask = dict(max_tokens=64, temperature=0)
    ends = chat(http, **ask, **PLAIN)
    n = ends["usage"]["completion_tokens"]
    assert ends["choices"][0]["finish_reason"] == "stop" and n < 40  # it would have stopped
    on = chat(http, **ask, min_tokens=n + 8, speculation={"k": 4})
    off = chat(http, **ask, min_tokens=n + 8, **PLAIN)
    assert on["usage"]["completion_tokens"] >= n + 8
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    assert on["choices"][0]["message"]["content"].startswith(
        ends["choices"][0]["message"]["content"]
    )
    assert_speculated([spec_of(on)], can_reject=False)
    # a stop string inside the first min_tokens tokens does not end it either
    first_word = ends["choices"][0]["message"]["content"].split()[0]
    stopped = chat(http, **ask, stop=[first_word], **PLAIN)
    assert stopped["usage"]["completion_tokens"] <= 2
    held = chat(http, **ask, stop=[first_word], min_tokens=n + 8, **PLAIN)
    assert held["usage"]["completion_tokens"] >= n + 8
    # min_tokens above max_tokens is refused, naming it
    r = http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 4, "min_tokens": 5},
    )
    assert_error(r, 400, "min_tokens")


def test_stop_token_ids_end_the_output_at_that_id(http):
    ask = dict(max_tokens=24, temperature=0, logprobs=0, return_tokens_as_token_ids=True)
    free = complete(http, **ask, **PLAIN)["choices"][0]
    ids = token_ids(free)
    stop = ids[5]
    cut = ids.index(stop)  # its first occurrence
    on = complete(http, **ask, stop_token_ids=[stop], speculation={"k": 4})
    got = on["choices"][0]
    assert token_ids(got) == ids[: cut + 1] and got["finish_reason"] == "stop"
    assert_speculated([spec_of(on)], can_reject=False)
    # the stop token's own text is left out (vLLM's rule) unless include_stop_str_in_output
    free_text = free["text"]
    with_stop = complete(http, **ask, stop_token_ids=[stop], include_stop_str_in_output=True)
    kept = with_stop["choices"][0]["text"]
    assert free_text.startswith(kept) and kept.startswith(got["text"])
    assert len(kept) > len(got["text"])
    # an id outside the vocabulary is refused, naming the field
    r = http.post(
        "/completions", json={"model": MODEL, "prompt": PROMPT, "stop_token_ids": [10**9]}
    )
    assert_error(r, 400, "stop_token_ids")


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(http):
    free = complete(http, max_tokens=24, temperature=0)["choices"][0]["text"]
    stop = " blue"
    assert stop in free
    without = complete(http, max_tokens=24, temperature=0, stop=[stop])["choices"][0]
    within = complete(
        http, max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True
    )["choices"][0]
    assert without["text"] == free[: free.index(stop)]
    assert within["text"] == free[: free.index(stop)] + stop and within["text"].endswith(stop)
    assert within["finish_reason"] == without["finish_reason"] == "stop"


def test_skip_special_tokens_false_shows_the_end_of_sequence(http):
    """With ignore_eos the model writes its EOS and goes on: its text shows only when
    skip_special_tokens is false."""
    ask = dict(max_tokens=48, temperature=0, ignore_eos=True)
    eos = "<|im_end|>"
    shown = chat(http, **ask, skip_special_tokens=False)["choices"][0]["message"]["content"]
    hidden = chat(http, **ask)["choices"][0]["message"]["content"]
    assert eos in shown and eos not in hidden
    assert re.sub(r"<\|im_(start|end)\|>", "", shown) == hidden


def test_guided_fields_constrain_the_output(http):
    """Sampled at T = 1 with speculation forced: every output is what the field asks."""
    kw = dict(temperature=1.0, max_tokens=40, n=3, seed=7, speculation={"k": 3})
    choices = ["yes", "no", "maybe"]
    runs = []
    r = chat(http, **kw, guided_choice=choices)
    runs.append(spec_of(r))
    assert all(c["message"]["content"] in choices for c in r["choices"])
    r = chat(http, **kw, guided_regex=r"[0-9]{3}-[a-z]{2}")
    runs.append(spec_of(r))
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c["message"]["content"]) for c in r["choices"])
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    r = chat(http, **kw, guided_json=json.dumps(schema))
    runs.append(spec_of(r))
    for c in r["choices"]:
        if c["finish_reason"] == "stop":
            got = json.loads(c["message"]["content"])
            assert set(got) == {"n", "ok"} and isinstance(got["ok"], bool)
    r = complete(http, **kw, guided_grammar='start: "a" ("b" | "c")+ "d"')
    runs.append(spec_of(r))
    assert all(re.fullmatch(r"a[bc]+d?", c["text"]) for c in r["choices"])  # (length-cut: no d yet)
    assert_speculated(runs, can_reject=False)
    # two constraints, or one that cannot compile: 400 naming the field
    r = http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": HELLO, "guided_choice": ["a"], "guided_regex": "b"},
    )
    assert_error(r, 400)
    r = http.post(
        "/chat/completions", json={"model": MODEL, "messages": HELLO, "guided_json": "{not json"}
    )
    assert_error(r, 400, "guided_json")


def test_min_p_never_samples_a_token_below_the_threshold(http, live):
    """Sampled at T = 1: every emitted token had at least min_p x the most probable token's
    probability under the model (its own forward here); without min_p, the same requests emit
    tokens below it (the check is not vacuous)."""
    ids = live.tokenizer(PROMPT)["input_ids"]
    kw = dict(
        prompt=ids, temperature=1.0, max_tokens=24, n=6, seed=3, logprobs=0,
        return_tokens_as_token_ids=True,
    )  # fmt: skip

    def below(r, min_p) -> int:
        n = 0
        for c in r["choices"]:
            out = token_ids(c)
            with torch.inference_mode():
                logits = live.model(torch.tensor([ids + out])).logits[0].float()
            probs = torch.softmax(logits[len(ids) - 1 : -1], -1)
            for i, t in enumerate(out):
                n += bool(probs[i, t] < min_p * probs[i].max() * (1 - 1e-4))
        return n

    on = complete(http, **kw, min_p=0.3, speculation={"k": 4})
    assert below(on, 0.3) == 0
    assert_speculated([spec_of(on)], can_reject=False)
    assert below(complete(http, **kw), 0.3) > 0


def test_top_k_1_samples_the_greedy_answer(http):
    greedy = complete(http, max_tokens=16, temperature=0)["choices"][0]["text"]
    r = complete(http, max_tokens=16, temperature=1.0, top_k=1, n=2, seed=1)
    assert all(c["text"] == greedy for c in r["choices"])


def test_allowed_token_ids_restrict_the_output(http, live):
    allowed = live.tokenizer(" red green blue,")["input_ids"]
    r = complete(
        http, max_tokens=12, temperature=1.0, seed=2, logprobs=0,
        return_tokens_as_token_ids=True, allowed_token_ids=allowed,
    )  # fmt: skip
    assert set(token_ids(r["choices"][0])) <= set(allowed)
    assert r["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_bad_words_never_come_and_speculation_changes_nothing(http, live):
    """Greedy, the prompt repeating "red green blue": the free answer goes on with " blue";
    with bad_words ["blue"] neither " blue" nor "blue" is written, the same with speculation
    (the n-gram drafter proposes the banned copy: rejected) as without; a multi-token word is
    banned only after its start: the answer then differs from the free one from the word's
    last token on. Empty words are refused, naming the field."""
    ask = dict(max_tokens=24, temperature=0, logprobs=0, return_tokens_as_token_ids=True)
    free = complete(http, **ask, **PLAIN)["choices"][0]
    assert " blue" in free["text"]
    on = complete(http, **ask, bad_words=["blue"], speculation={"k": 4})
    off = complete(http, **ask, bad_words=["blue"], **PLAIN)
    assert token_ids(on["choices"][0]) == token_ids(off["choices"][0])
    banned = {live.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("blue", " blue")}
    assert not banned & set(token_ids(on["choices"][0]))
    assert "blue" not in on["choices"][0]["text"]
    assert_speculated([spec_of(on)])
    # a two-token word: " green blue" ("green" is free, "blue" after it is not)
    two = " green blue"
    ids = live.tokenizer.encode(two, add_special_tokens=False)
    assert len(ids) == 2
    out = token_ids(complete(http, **ask, bad_words=[two], speculation={"k": 4})["choices"][0])
    free_ids = token_ids(free)
    assert ids[0] in out and list(itertools.pairwise(out)).count(tuple(ids)) == 0
    first = next(i for i in range(len(free_ids) - 1) if free_ids[i : i + 2] == ids)
    assert out[: first + 1] == free_ids[: first + 1] and out[first + 1] != ids[1]
    for words in ([""], ["   "]):
        r = http.post("/completions", json={"model": MODEL, "prompt": PROMPT, "bad_words": words})
        assert_error(r, 400, "bad_words")


def test_prompt_logprobs_score_the_prompt_as_the_model_does(http, live, real_fp32):
    """vLLM's prompt_logprobs: per prompt token (null for the first) the token's own logprob
    and rank and the top N, as the model's own forward over the prompt gives them, on every
    choice of n; the answer is the one asked without them, speculating (prefill scores, the
    rounds are untouched); with echo + logprobs each keeps its own top N; chat has them once,
    on the response; a stream, -1 or more than max_logprobs: 400 naming the field."""
    model, _ = real_fp32
    tok = live.tokenizer
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    ask = dict(max_tokens=12, temperature=0, n=2, speculation={"k": 4})
    r = complete(http, **ask, prompt_logprobs=3)
    plain = complete(http, **ask)
    assert [c["text"] for c in r["choices"]] == [c["text"] for c in plain["choices"]]
    assert_speculated([spec_of(r)])
    assert "prompt_logprobs" not in plain["choices"][0]
    for c in r["choices"]:
        got = c["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for i, t in enumerate(ids[1:], 1):
            want = ref[i - 1]
            row = {int(k): v for k, v in got[i].items()}
            top = want.topk(3).indices.tolist()
            assert next(iter(row)) == t and set(row) == {t, *top}
            assert row[t]["logprob"] == pytest.approx(want[t].item(), abs=1e-4)
            # 1 + the tokens more probable (those within rounding of it either way)
            above = [int((want > want[t] + e).sum()) for e in (1e-4, -1e-4)]
            assert 1 + above[0] <= row[t]["rank"] <= 1 + above[1]
            assert row[t]["decoded_token"] == tok.decode([t])
            for rank, k in enumerate(top, 1):
                assert row[k]["logprob"] == pytest.approx(want[k].item(), abs=1e-4)
                assert row[k]["rank"] == (row[t]["rank"] if k == t else rank)
    # echo + logprobs 1 beside prompt_logprobs 3: the legacy list keeps 1 alternative a token
    both = complete(http, max_tokens=2, temperature=0, echo=True, logprobs=1, prompt_logprobs=3)
    c = both["choices"][0]
    assert c["logprobs"]["top_logprobs"][0] is None
    assert all(len(x) == 1 for x in c["logprobs"]["top_logprobs"][1:])
    assert all(len(x) >= 3 for x in c["prompt_logprobs"][1:])
    # chat: once, on the response, for the conversation's tokens
    conv = tok.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=True)
    r = chat(http, max_tokens=4, temperature=0, n=2, prompt_logprobs=0)
    assert len(r["prompt_logprobs"]) == len(conv["input_ids"]) and r["prompt_logprobs"][0] is None
    assert all(len(x) == 1 for x in r["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in r["choices"][0]
    assert "prompt_logprobs" not in chat(http, max_tokens=2)
    for extra in ({"stream": True}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        body = {"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 1, **extra}
        assert_error(http.post("/completions", json=body), 400, "prompt_logprobs")


def test_stop_reason_names_what_ended_each_choice(http, live):
    """vLLM's stop_reason: the stop string, or the stop token id, that ended a choice; null
    where the model's EOS or max_tokens ended it -- in completions and chat, streamed and not,
    for each of n choices."""
    ask = dict(max_tokens=24, temperature=0)
    # a stop string (two listed: the one that matched)
    c = complete(http, **ask, stop=["purple", " blue"], n=2)["choices"]
    assert [(x["finish_reason"], x["stop_reason"]) for x in c] == [("stop", " blue")] * 2
    # a stop token id (an int); max_tokens: null
    blue = live.tokenizer.encode(" blue", add_special_tokens=False)[0]
    c = complete(http, **ask, stop_token_ids=[blue], speculation={"k": 4})["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", blue)
    c = complete(http, max_tokens=3, temperature=0)["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)
    # chat: the answer ends at the EOS: null; with ignore_eos the EOS as a stop id: its id
    eos = live.tokenizer.eos_token_id
    c = chat(http, max_tokens=64, temperature=0)["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", None)
    c = chat(http, max_tokens=64, temperature=0, ignore_eos=True, stop_token_ids=[eos])
    assert (c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) == ("stop", eos)
    # streamed chat, n = 2, a stop string: each choice's last chunk carries it, the others null
    r = http.post(
        "/chat/completions",
        json={
            "model": MODEL, "messages": HELLO, "stream": True, "n": 2, "max_tokens": 64,
            "temperature": 0, "stop": ["!"],
        },
    )  # fmt: skip
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    ends = {}
    for ch in chunks:
        for x in ch["choices"]:
            if x["finish_reason"]:
                ends[x["index"]] = (x["finish_reason"], x["stop_reason"])
            else:
                assert x["stop_reason"] is None
    assert ends == {0: ("stop", "!"), 1: ("stop", "!")}
    # streamed completion: a stop token id
    r = http.post(
        "/completions",
        json={"model": MODEL, "prompt": PROMPT, "stream": True, **ask, "stop_token_ids": [blue]},
    )
    last = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")][-1]
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == (
        "stop",
        blue,
    )


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, live):
    ids = live.tokenizer(PROMPT)["input_ids"]
    r = complete(http, max_tokens=4, temperature=0, truncate_prompt_tokens=5)
    assert r["usage"]["prompt_tokens"] == 5
    same = complete(http, prompt=ids[-5:], max_tokens=4, temperature=0)
    assert r["choices"][0]["text"] == same["choices"][0]["text"]


def test_add_special_tokens_false_leaves_the_bos_out(http, live):
    with_bos = complete(http, max_tokens=1, temperature=0)["usage"]["prompt_tokens"]
    plain = complete(http, max_tokens=1, add_special_tokens=False)["usage"]["prompt_tokens"]
    tok = live.tokenizer
    assert with_bos - plain == len(tok(PROMPT)["input_ids"]) - len(
        tok(PROMPT, add_special_tokens=False)["input_ids"]
    )


def test_chat_template_fields_reach_the_template(http, live):
    """add_generation_prompt false: the prompt is the template's without the assistant's
    opening (as /tokenize counts it); continue_final_message with echo: the answer continues
    the last assistant message, which leads it."""
    counted = httpx.post(
        f"{live.url}/tokenize",
        json={"model": MODEL, "messages": HELLO, "add_generation_prompt": False},
    )
    r = chat(http, max_tokens=2, add_generation_prompt=False)
    assert r["usage"]["prompt_tokens"] == counted.json()["count"]
    opened = chat(http, max_tokens=2)["usage"]["prompt_tokens"]
    assert opened > r["usage"]["prompt_tokens"]
    partial = "The capital of France is"
    msgs = [{"role": "user", "content": "Which city is the capital of France?"}]
    msgs.append({"role": "assistant", "content": partial})
    body = dict(
        messages=msgs, max_tokens=8, temperature=0, echo=True, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    r = chat(http, **body)
    text = r["choices"][0]["message"]["content"]
    assert text.startswith(partial) and len(text) > len(partial)
    streamed = http.post("/chat/completions", json={"model": MODEL, "stream": True, **body}).text
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in streamed.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(deltas) == text
    both = http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": msgs, "continue_final_message": True},
    )
    assert_error(both, 400, "continue_final_message")


def test_chat_template_kwargs_are_rendered(live):
    """chat_template_kwargs reach the template as variables (a template that reads one); the
    renderer's own parameters may not be set through them."""
    import copy

    from server.convert import chat_prompt
    from server.errors import APIError

    tok = copy.copy(live.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if greeting is defined %}[{{ greeting }}]{% endif %}"
    )
    req = P.ChatCompletionRequest(
        model=MODEL, messages=HELLO, chat_template_kwargs={"greeting": "Ahoy"}
    )
    assert "[Ahoy]" in tok.decode(chat_prompt(req, tok))
    assert "Ahoy" not in tok.decode(
        chat_prompt(P.ChatCompletionRequest(model=MODEL, messages=HELLO), tok)
    )
    req = P.ChatCompletionRequest(
        model=MODEL, messages=HELLO, chat_template_kwargs={"tokenize": False}
    )
    with pytest.raises(APIError) as e:
        chat_prompt(req, tok)
    assert e.value.param == "chat_template_kwargs"
