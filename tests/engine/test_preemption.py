"""The KV budget and preemption (engine/requests/scheduler.py): when the running sequences outgrow
``kv_cache_tokens`` the latest admitted loses its KV and is recomputed later (its prompt and output
as a prompt, mostly from the prefix cache), and greedy output with speculation stays the target's
own, token for token (fp32 tiny models); no slot, drafter state or budget leaks after a storm of
preemptions and aborts; a prompt's logprobs are sent once; a freed slot's memory goes back to the
kernel."""

import ctypes
import mmap
import random
import sys

import pytest
import torch

from engine.kv.kv_cache import SlotKVCache
from engine.records.params import SamplingParams, SpecParams
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, echo_head
from tests.helpers import assert_speculated, engine_for, fed_prompt_tokens, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
MAX_LEN = 128


def prompts(n: int, vocab: int, length: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(1, min(vocab, 60), (length + 3 * i,), generator=g).tolist() for i in range(n)
    ]


@pytest.mark.parametrize(
    ("drafter", "cache"), [("ngram", 0), ("layers", 256), ("eagle3", 256), ("self", 0)]
)
def test_preempted_sequences_decode_as_plain_greedy(models, drafter, cache):
    """Four sequences of up to ~110 tokens in a budget of 128 positions: they take turns,
    preempted and recomputed, and each decodes as plain greedy decoding does."""
    # "layers": the target's first 2 layers; "self": the target in bf16 (a draft model that
    # agrees with it at times)
    kws = {"layers": {"num_layers": 2}, "self": {"draft_dtype": torch.bfloat16}}
    kw: dict = kws.get(drafter, {})
    if drafter == "eagle3":
        target = tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)
        models, kw = target, {"head": echo_head(target)}
    target = models[0] if isinstance(models, tuple) else models
    tight = engine_for(
        models, drafter, slots=4, max_len=MAX_LEN, prefix_cache=cache, kv_budget=MAX_LEN, **kw
    )
    plain = engine_for(target, None, slots=4, max_len=MAX_LEN)
    fed = fed_prompt_tokens(tight)
    ps = prompts(4, tight.vocab_size)
    got = tight.generate(ps, GREEDY, SpecParams(k=3))
    want = plain.generate(ps, GREEDY)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert_speculated(got)
    preempted = [s for s in got if s.preemptions]
    assert preempted and tight.load().preemptions == sum(s.preemptions for s in got)
    assert sum(fed) > sum(len(p) for p in ps)  # the preempted were fed again
    if cache:  # ... from the prefix cache where it kept their blocks
        assert any(s.cached_tokens for s in preempted)
    assert tight.scheduler.room() == MAX_LEN and tight.target.cache.num_free() == 4


def test_a_storm_of_preemptions_and_aborts_leaks_nothing(models):
    """Random arrivals, aborts and preemptions (EAGLE-3 head, prefix cache, sampled and greedy,
    prompt logprobs): in the end every slot is free, the drafter holds no state, the budget is
    whole, and every request that asked for its prompt's logprobs got them once (at most once if
    aborted), one per prompt token, each the model's own over the whole prompt, though prompts
    were preempted mid-prefill and their blocks were in the prefix cache."""
    target = tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)
    e = engine_for(
        target,
        "eagle3",
        slots=4,
        max_len=MAX_LEN,
        prefix_cache=128,
        kv_budget=160,
        head=echo_head(target),
        chunk=8,  # prompts prefill over several steps, so some are preempted in the middle
    )
    sched, real = e.scheduler, e.scheduler.preempt
    cut: list = []  # the scored prompts preempted with their prefill (and scores) half done

    def preempt(s):
        if s in sched.prefilling and s.prompt_logprobs:
            cut.append(s)
        real(s)

    sched.preempt = preempt
    rng = random.Random(3)
    scores: dict[str, list] = {}  # every prompt_logprobs a request was sent
    asked: dict[str, list[int]] = {}  # the prompts of the requests that asked for them
    seqs, live, aborted = {}, [], set()
    for i in range(40):
        if rng.random() < 0.7:
            rid = f"r{i}"
            p = SamplingParams(
                temperature=rng.choice([0.0, 0.9]),
                max_tokens=rng.randint(1, 60),
                prompt_logprobs=1 if rng.random() < 0.4 else None,
                seed=i,
            )
            # prompts drawn from a few: later ones start on earlier ones' cached blocks
            prompt = prompts(1 + i % 3, e.vocab_size, rng.randint(5, 50))[i % 3]
            seqs[rid] = e.add_request(rid, prompt, p, SpecParams(k=3))
            if p.prompt_logprobs is not None:
                asked[rid] = prompt
            live.append(rid)
            scores[rid] = []
        elif live:
            rid = live.pop(rng.randrange(len(live)))
            aborted.add(rid)
            e.abort(rid)
        for out in e.step():
            if out.prompt_logprobs is not None:
                scores[out.request_id].append(out.prompt_logprobs)
    while e.has_work():
        for out in e.step():
            if out.prompt_logprobs is not None:
                scores[out.request_id].append(out.prompt_logprobs)
    assert e.load().preemptions > 0 and e.load().prefix_hits > 0
    assert e.target.cache.num_free() == 4 and e.target.cache.used_tokens() == 0
    assert e.scheduler.room() == 160
    inner = e.drafter.inner if hasattr(e.drafter, "inner") else e.drafter
    assert not inner.pending and not inner.real and inner.cache.num_free() == 4
    assert all(len(sent) <= 1 for sent in scores.values())
    assert all(not scores[r] for r in scores if r not in asked)
    done = [r for r in asked if r not in aborted]
    assert done and all(len(scores[r]) == 1 for r in done)
    assert cut and any(s.output_ids and s.preemptions for s in map(seqs.get, asked))
    for rid, prompt in asked.items():
        for sent in scores[rid]:
            with torch.no_grad():
                ref = torch.log_softmax(target(torch.tensor([prompt])).logits[0].float(), -1)
            assert len(sent) == len(prompt) and sent[0] is None
            got = torch.tensor([lp.logprob for lp in sent[1:]])
            want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_the_latest_admitted_pays_under_memory_pressure(models):
    """When the running sequences outgrow the budget, the one admitted last is preempted (it has
    the least work to recompute), never an older one: at every preemption the victim is the
    holder admitted latest, and the first admitted, always the oldest holder, runs through
    without losing its KV. Negative control: preemptions happened with older holders beside the
    victim, so a scheduler that preempted the oldest (or any other) would fail here."""
    e = engine_for(models, "ngram", slots=4, max_len=MAX_LEN, kv_budget=MAX_LEN)
    sched, real = e.scheduler, e.scheduler.preempt
    seen: list[tuple[float, list[float]]] = []  # (victim's admission, every holder's)

    def preempt(s):
        holders = [h.admitted or 0.0 for h in (*sched.running, *sched.prefilling)]
        seen.append((s.admitted or 0.0, holders))
        real(s)

    sched.preempt = preempt
    ps = prompts(4, e.vocab_size)
    got = e.generate(ps, GREEDY, SpecParams(k=3))
    assert seen and e.load().preemptions == len(seen)
    assert all(victim == max(holders) for victim, holders in seen)
    assert any(min(holders) < victim for victim, holders in seen)  # an older one was there
    assert got[0].preemptions == 0 and sum(s.preemptions for s in got[1:]) == len(seen)


def test_a_budget_below_one_context_is_refused(models):
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine_for(models, "ngram", slots=2, max_len=MAX_LEN, kv_budget=MAX_LEN - 1)


def resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s memory resident now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux paging")
def test_a_freed_slot_gives_its_memory_back():
    """A slot's memory is resident once written and given back when the slot is freed (it reads
    zeros after); the other slot's stays."""
    cache = SlotKVCache(1, 2, 8, 128, 8192, torch.float32, "cpu")  # 32 MiB per slot, K and V
    a, b = cache.allocate(), cache.allocate()
    for t in cache.k + cache.v:
        t[a].fill_(1.0)
        t[b].fill_(2.0)
    slot_pages = cache.k[0][a].numel() * 4 // mmap.PAGESIZE
    assert all(resident_pages(t[a]) >= slot_pages for t in cache.k + cache.v)
    cache.free(a)
    assert all(resident_pages(t[a]) <= 2 for t in cache.k + cache.v)  # at most its end pages
    assert all(resident_pages(t[b]) >= slot_pages for t in cache.k + cache.v)
    assert cache.k[0][a].abs().sum() == 0 and cache.v[0][b].min() == 2.0


def test_a_budget_of_one_context_serves_a_prompt_of_nearly_that_length(models):
    """With the smallest budget allowed (one ``max_len``), a prompt leaving only a few positions
    of the context is admitted and finishes (its first verify may write past its prompt, but a
    sequence never holds more than the context)."""
    e = engine_for(models, "ngram", slots=2, max_len=MAX_LEN, kv_budget=MAX_LEN)
    prompt = prompts(1, e.vocab_size, MAX_LEN - 3)[0]
    s = e.add_request("long", prompt, GREEDY, SpecParams(k=3))
    for _ in range(50):
        if not e.has_work():
            break
        e.step()
    assert s.status.value == "finished" and s.output_ids and s.finish_reason == "length"
