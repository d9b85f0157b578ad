"""Tiny EAGLE-3 heads and engines over tiny random Llamas, shared by the EAGLE-3 drafter's tests
(tests/engine/test_eagle*.py, test_hybrid.py) and the training tests."""

from __future__ import annotations

import random

import torch

from engine.drafters.eagle.drafter import EagleDrafter
from engine.drafters.eagle.head import Eagle3Head, HeadConfig, default_aux_layers
from engine.engine import SpecEngine
from engine.kcontrol.controller import FixedK
from engine.model.compiled import CompileConfig
from engine.records.params import SamplingParams, SpecParams
from tests import helpers

VOCAB, HIDDEN, LAYERS = 16, 64, 4


def random_head(
    seed: int, vocab: int = VOCAB, draft_vocab: int = 12, layers: int = LAYERS, hidden=HIDDEN
):
    """A random EAGLE-3 head for a tiny Llama, sharpened so its guesses vary."""
    cfg = HeadConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        aux_layers=default_aux_layers(layers) if layers > 8 else (0, 1, layers - 1),
        max_position_embeddings=512,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(cfg)
        with torch.no_grad():
            head.lm_head.weight.mul_(8.0)
        head.set_vocab(torch.randperm(vocab)[:draft_vocab].sort().values)
    return head


def echo_head(target, draft_vocab: int = 12) -> Eagle3Head:
    """A head that guesses the target's *current* token at each position (its layer muted, fc
    passing the last tap through the target's own final norm and LM head, limited to the draft
    vocabulary): right whenever the output repeats a token, so rounds accept some drafts and
    reject others."""
    head = random_head(0, vocab=target.config.vocab_size, draft_vocab=draft_vocab)
    h = target.config.hidden_size
    ids = head.draft_to_target
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h :] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
    return head


def eagle_engine(
    target,
    head,
    slots=4,
    k=None,
    max_len=256,
    accept=None,
    *,
    q4: bool = False,
    compile: CompileConfig | None = None,
) -> SpecEngine:
    """An engine drafting with ``head`` (K fixed at ``k``, else adaptive), its drafter built with
    its 4-bit matrices (``q4``) and its runner's fast path (``compile``: compiled or captured;
    None: eager) chosen (helpers.engine_for); the target's forwards run eagerly."""
    ctl = FixedK(k) if k is not None else None
    return helpers.engine_for(
        target, "eagle3", slots, max_len=max_len, controller=ctl, head=head, accept=accept,
        head_q4=q4, head_compile=compile,
    )  # fmt: skip


def assert_greedy_ragged_equals_plain(engine, target, seed: int) -> None:
    """Six ragged prompts decoded together through ``engine`` (K = 3) emit the plain engine's
    greedy output for each alone; the head drafted and never faulted."""
    g = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(6, seed=seed)
    plain = helpers.engine_for(target, None, slots=4)
    refs = [plain.generate([p], g)[0].output_ids for p in ps]
    outs = engine.generate(ps, g, SpecParams(k=3))
    assert [s.output_ids for s in outs] == refs
    helpers.assert_speculated(outs, can_reject=False)
    assert engine.drafter_failures == 0


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def draws(engine, prompt, n=4000, max_tokens=6, k=4, **sampling) -> list[list[int]]:
    """The outputs of ``n`` seeded sampled requests of ``prompt`` at K = ``k``; speculation ran."""
    params = [SamplingParams(max_tokens=max_tokens, seed=i, **sampling) for i in range(n)]
    seqs = engine.generate([prompt] * n, params, SpecParams(k=k))
    helpers.assert_speculated(seqs, min_drafted=n)
    return [s.output_ids for s in seqs]


def head_call(d: EagleDrafter, rows: int, q: int, ingest: bool, kv_len: int, seed: int):
    """The head's runner (its fast path, or eager inside ``d.head_runner.eager()``) on random
    inputs of this shape, rows in slots 0.. at positions ``kv_len - q ..`` (odd rows one query
    short); returns its outputs
    ``[rows, hidden]``, logits ``[rows, draft_vocab]`` at each row's last query and the K written
    (the cache and its lengths restored)."""
    g = torch.Generator().manual_seed(seed)
    width = d.head.fc.in_features if ingest else d.head.config.hidden_size
    x = torch.randn(rows, q, width, generator=g).to(d.dtype)
    ids = torch.randint(0, VOCAB, (rows, q), generator=g)
    x, ids = x.to(d.device), ids.to(d.device)
    c = d.cache
    k0, v0, lengths = c.k[0].clone(), c.v[0].clone(), list(c.lengths)
    for s in range(rows):
        c.lengths[s] = kv_len - q
    counts = [q - (r % 2 and q > 1) for r in range(rows)]  # ragged: odd rows one query short
    f = d.head_runner.forward(ids, list(range(rows)), counts, x=x)
    written = c.k[0][:rows, :, kv_len - q : kv_len].clone()
    c.k[0].copy_(k0)
    c.v[0].copy_(v0)
    c.lengths[:] = lengths
    return f.output, f.logits, written
