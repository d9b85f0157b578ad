"""The official openai client (sync and async) against a live specd on the real model.

Tests that take ``served`` run on the fp32 server and on the default config's (bf16, 4-bit,
compiled, EAGLE-3 head + n-gram: tests/server/conftest.py). Where speculation is the subject the
request forces it (``speculation.k``: the adaptive K may keep a request plain on a busy machine)
and the test checks from ``usage.speculation`` that it ran (``assert_speculated``); outputs
compared token for token send ``served.exact`` (deterministic mode on the bf16 server)."""

import asyncio

import openai
import pytest

from tests.conftest import MODEL
from tests.helpers import assert_speculated

pytestmark = pytest.mark.real_model
CHAT = [{"role": "user", "content": "List three primary colors, comma separated."}]
FORCED_K = {"speculation": {"k": 4}}  # speculation runs whatever this machine's speed
PLAIN = {"speculation": {"enabled": False}}


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)


def client_of(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)


def spec_of(r) -> tuple[int, int]:
    """A response's ``usage.speculation`` as (drafted, accepted)."""
    s = r.usage.model_extra["speculation"]
    return s["drafted_tokens"], s["accepted_tokens"]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)


def test_stream_chunks_carry_role_once_and_a_fingerprint(live):
    import json

    import httpx

    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.base_url}/chat/completions", json=body, timeout=120) as r:
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    chunks = [json.loads(x) for x in lines if x != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:])  # OpenAI leaves the key out, never null
    assert set(deltas[-1]) <= {"content"} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    fps = {c["system_fingerprint"] for c in chunks}
    assert len(fps) == 1 and fps.pop().startswith("fp_")


def test_chat_greedy_with_speculation_equals_plain_greedy(served, target_greedy):
    """Greedy output at a forced K is plain decoding's on the same server, token for token,
    with drafts accepted and rejected on the way; on the fp32 server it is also transformers'
    own greedy decoding (an independent reference)."""
    client = client_of(served)
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=40)
    plain = client.chat.completions.create(**kw, extra_body={**PLAIN, **served.exact})
    r = client.chat.completions.create(**kw, extra_body={**FORCED_K, **served.exact})
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason
    assert r.usage.completion_tokens == plain.usage.completion_tokens
    assert_speculated([spec_of(r)], can_reject=True)
    assert spec_of(plain) == (0, 0)
    assert r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    if served.name != "live":
        return
    tok = served.tokenizer
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    ref = target_greedy(list(ids), 40)
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    assert r.choices[0].finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")


def test_completion_stream_concatenates_to_non_stream(client):
    kw = dict(model=MODEL, prompt="def fibonacci(n):\n", temperature=0, max_tokens=48)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "text_completion" for c in chunks)


def test_chat_stream_with_usage(client):
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=30, extra_body=FORCED_K)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    spec = last.usage.model_extra["speculation"]
    assert spec["target_passes"] >= 1 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["drafted_tokens"] > 0  # speculation ran


def test_n_choices_under_forced_speculation_equal_the_single_greedy_choice(served):
    client = client_of(served)
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    kw["extra_body"] = {**FORCED_K, **served.exact}
    one = client.chat.completions.create(**kw)
    three = client.chat.completions.create(n=3, **kw)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    # usage counts every choice's output and the prompt once, as OpenAI does
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert_speculated([spec_of(one), spec_of(three)], can_reject=True)
    streamed = [""] * 3
    for chunk in client.chat.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [one.choices[0].message.content] * 3


def test_seed_reproduces_and_differs(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a short story."}],
        temperature=1.0,
        max_tokens=24,
    )
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b and a != c


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, seed=3, n=3, max_tokens=12
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1


def test_stop_string_is_honoured(served):
    """A stop string that speculative rounds run past: the text ends before it, streamed or
    not (rounds emit several tokens at once: the stop string can sit inside one)."""
    client = client_of(served)
    kw = dict(model=MODEL, prompt="def fibonacci(n):\n", temperature=0, max_tokens=48)
    kw["extra_body"] = {**FORCED_K, **served.exact}
    r = client.completions.create(**kw)
    full = r.choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.index(stop)
    runs = [spec_of(r)]
    for stream in (False, True):
        if stream:
            text = "".join(
                c.choices[0].text
                for c in client.completions.create(stream=True, stop=[stop], **kw)
                if c.choices
            )
        else:
            r = client.completions.create(stop=stop, **kw)
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
            runs.append(spec_of(r))
        assert text == full[:cut] and stop not in text
    assert_speculated(runs, can_reject=True)


def test_prompt_forms_and_echo(client, live):
    ids = live.tokenizer("The capital of France is")["input_ids"]
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], temperature=0, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1]
    s = client.completions.create(
        model=MODEL, prompt=["The capital of France is", "Hello"], temperature=0, max_tokens=5
    )
    assert s.choices[0].text == r.choices[0].text and len(s.choices) == 2
    t = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5
    )
    assert r.choices[0].text == t.choices[0].text
    e = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, echo=True
    )
    assert e.choices[0].text == "The capital of France is" + t.choices[0].text


def test_chat_logprobs(served):
    """Greedy at a forced K: every token's logprob is its position's top one (the verify's
    logits at that position, not a neighbour's), one entry per token, rounds of several."""
    r = client_of(served).chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        extra_body=FORCED_K,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert abs(t.logprob - max(x.logprob for x in t.top_logprobs)) < 1e-5  # greedy = argmax
        assert t.token == t.top_logprobs[0].token
    assert_speculated([spec_of(r)], can_reject=False)


def test_completion_logprobs_match_target_model(client, live):
    """fp32: the logprobs of every generated token, drafted and accepted ones included (a text
    that repeats: n-gram drafts), equal the target's own forward over the text."""
    import torch

    prompt = "red, green, blue, red, green, blue, red, green, blue, red,"
    r = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=2, extra_body=FORCED_K
    )
    lp = r.choices[0].logprobs
    ids = live.tokenizer(prompt)["input_ids"]
    out = live.tokenizer(prompt + r.choices[0].text)["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(live.model(torch.tensor([out])).logits[0].float(), -1)
    assert out[: len(ids)] == ids and len(out) == len(ids) + 8  # re-tokenizes to the same tokens
    for j, value in enumerate(lp.token_logprobs):
        assert abs(value - float(ref[len(ids) + j - 1, out[len(ids) + j]])) < 1e-3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    _, accepted = spec_of(r)
    assert accepted > 0  # tokens at verify positions past the first were scored too


def test_async_client_streams_concurrently(served):
    """Three streams at once at a forced K equal each one alone (greedy; batched rounds)."""

    async def main():
        c = openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=300)

        async def one(q):
            s = await c.chat.completions.create(
                model=MODEL,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                max_tokens=16,
                messages=[{"role": "user", "content": q}],
                extra_body={**FORCED_K, **served.exact},
            )
            text, usage = "", None
            async for ch in s:
                text += "".join(x.delta.content or "" for x in ch.choices)
                usage = spec_of(ch) if ch.usage is not None else usage
            return text, usage

        qs = ["What is 2+2?", "Name a fruit.", "Say hello."]
        together = await asyncio.gather(*(one(q) for q in qs))
        alone = [await one(q) for q in qs]
        return together, alone

    together, alone = asyncio.run(main())
    assert [t for t, _ in together] == [t for t, _ in alone] and all(t for t, _ in together)
    assert_speculated([u for _, u in together], can_reject=True)


def test_stop_string_usage_and_logprobs_do_not_depend_on_speculation(served):
    """The round that completes a stop string may have emitted tokens past it: they are not
    counted. Usage and logprobs end at the token that completes the stop string, as plain
    decoding (one token a step) ends them. (A repetitive prompt: n-gram drafts get accepted,
    so rounds emit several tokens.)"""
    client = client_of(served)
    prompt = "red green blue, " * 6
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, logprobs=0)
    full = client.completions.create(**kw, extra_body={**PLAIN, **served.exact})
    text, tokens = full.choices[0].text, full.choices[0].logprobs.tokens
    runs = []
    for at in (len(text) * f // 6 for f in (1, 2, 3, 4)):
        stop = text[at : at + 3]
        ends = [j for j in range(len(tokens)) if stop in "".join(tokens[: j + 1])]
        want = ends[0] + 1  # the token that completes the stop string, counted
        for spec in ({"enabled": False}, {"k": 6}):
            extra = {"speculation": spec, **served.exact}
            r = client.completions.create(**kw, stop=[stop], extra_body=extra)
            c = r.choices[0]
            assert c.text == text[: text.index(stop)] and c.finish_reason == "stop"
            assert r.usage.completion_tokens == len(c.logprobs.tokens) == want, (stop, spec)
            if "k" in spec:
                runs.append(spec_of(r))
    _, accepted = assert_speculated(runs, can_reject=False)
    assert accepted > 0  # rounds emitted several tokens: a stop string could fall inside one


def test_logit_bias_forces_and_bans_tokens(served):
    """The bias holds at every verified position of a round, not only the first: a banned
    token that the drafter proposes (n-gram copies it from the prompt) is rejected, a forced
    token is the only one accepted (the EAGLE-3 head drafts others)."""
    import torch

    client, tok = client_of(served), served.tokenizer
    kw = dict(model=MODEL, temperature=0, extra_body={**FORCED_K, **served.exact})
    runs = []
    if served.name == "live":  # fp32: the first token's top two from transformers' forward
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
        with torch.inference_mode():
            logits = served.model(torch.tensor([list(ids["input_ids"])])).logits[0, -1].float()
        best, second = logits.topk(2).indices.tolist()
        banned = client.chat.completions.create(
            **kw, messages=CHAT, max_tokens=1, logit_bias={str(best): -100}
        )
        assert banned.choices[0].message.content == tok.decode([second])
    forced = client.chat.completions.create(
        **kw, messages=CHAT, max_tokens=6, logit_bias={"28": 100}
    )
    assert forced.choices[0].message.content == tok.decode([28] * 6)
    runs.append(spec_of(forced))
    red = tok(" red", add_special_tokens=False)["input_ids"]
    assert len(red) == 1
    prompt = "red, green, blue, red, green, blue, red, green, blue, red,"
    unbiased = client.completions.create(**kw, prompt=prompt, max_tokens=12, logprobs=0)
    assert " red" in unbiased.choices[0].logprobs.tokens  # what the ban has to stop
    r = client.completions.create(
        **kw, prompt=prompt, max_tokens=12, logprobs=0, logit_bias={str(red[0]): -100}
    )
    assert " red" not in r.choices[0].logprobs.tokens, r.choices[0].logprobs.tokens
    runs.append(spec_of(r))
    assert_speculated(runs, can_reject=True)


def test_penalties_greedy_equal_with_and_without_speculation(served):
    """Greedy: the penalised output is the same token for token whatever K (the penalties at
    each verified position count the drafts before it)."""
    client = client_of(served)
    kw = dict(
        model=MODEL,
        prompt="red green blue, red green blue, red green blue,",
        temperature=0,
        max_tokens=32,
        presence_penalty=0.5,
        frequency_penalty=0.6,
        logprobs=0,
    )
    off = client.completions.create(**kw, extra_body={**PLAIN, **served.exact})
    on = client.completions.create(**kw, extra_body={"speculation": {"k": 5}, **served.exact})
    rep = client.completions.create(
        **kw, extra_body={"repetition_penalty": 1.3, **PLAIN, **served.exact}
    )
    base = client.completions.create(
        **{**kw, "presence_penalty": 0, "frequency_penalty": 0},
        extra_body={**PLAIN, **served.exact},
    )
    assert on.choices[0].logprobs.tokens == off.choices[0].logprobs.tokens
    assert_speculated([spec_of(on)], can_reject=True)
    assert off.choices[0].text != base.choices[0].text != rep.choices[0].text  # they act


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, live):
    """Loglikelihood scoring as lm-evaluation-harness does it: max_tokens 0, echo, logprobs."""
    import torch

    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    ids = live.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(live.model(torch.tensor([ids])).logits[0].float(), -1)
    assert c.text == prompt and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert lp.tokens == [live.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # with generation after it, streamed: the prompt's entries lead, then the generated ones
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0)
    full = client.completions.create(**kw)
    chunks = [x.choices[0] for x in client.completions.create(stream=True, **kw) if x.choices]
    assert "".join(x.text for x in chunks) == full.choices[0].text
    assert full.choices[0].text.startswith(prompt)
    streamed = [t for x in chunks if x.logprobs for t in x.logprobs.tokens]
    assert streamed == full.choices[0].logprobs.tokens
    assert len(streamed) == len(ids) + 4 == len(full.choices[0].logprobs.text_offset)


def test_ignore_eos_runs_to_max_tokens_past_the_end_of_sequence(client):
    hello = [{"role": "user", "content": "Say hello."}]
    ask = dict(model=MODEL, messages=hello, max_tokens=48, temperature=0)
    ends = client.chat.completions.create(**ask)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens < 48
    runs = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert runs.choices[0].finish_reason == "length" and runs.usage.completion_tokens == 48
    assert runs.choices[0].message.content.startswith(ends.choices[0].message.content)
