"""Every sampled round checked structurally (tests/audit.py), for every drafter and forward path:
each drafted token is the one its reported q and the row's draft noise select, and the p the
acceptance rule gets at every verified position is the processed target distribution computed
independently (the reference model's forward over the whole context, then temperature / top-k /
top-p in float64). No statistics: one wrong round fails the test. Each run also proves it checked
something (drafts, positions), and the audit is shown to fail on a verify at a temperature 10%
off and on a drafter that reports a q other than the one it sampled from."""

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from engine.round import speculator as round_module
from tests.audit import RoundAudit, hf_reference, runner_reference
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, echo_head, random_head
from tests.helpers import assert_speculated, engine_for, sharp_tiny, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

N = 48  # requests per run: every round of every one is checked
PROMPT = [3, 7, 3, 3, 7, 1, 3, 7]  # repeats: the n-gram copies find drafts


def tiny(seed, vocab=8):
    return sharp_tiny(seed, vocab)


@pytest.fixture(scope="module")
def models():
    return tiny(1), tiny(2)


@pytest.fixture(scope="module")
def eagle_target():
    return tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)


def params(n, temperature=0.8, top_k=5, top_p=0.9, max_tokens=8):
    """Seeded sampled requests, with every third one greedy (the audit checks its argmax)."""
    return [
        SamplingParams(
            temperature=0 if i % 3 == 2 else temperature,
            top_k=top_k,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=i,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def audited(engine, reference, prompt=PROMPT, k=4, atol=1e-4, **sampling):
    audit = RoundAudit(engine, reference, atol=atol)
    seqs = engine.generate([prompt] * N, params(N, **sampling), SpecParams(k=k))
    return audit, seqs


TINY_PATHS = {  # id: (drafter, engine_for keywords, a drafter that can be wrong)
    "model": ("model", {}, True),
    "self": ("self", {}, False),
    "layers": ("layers", {"num_layers": 1}, True),
    "bf16-self": ("self", {"draft_dtype": torch.bfloat16}, False),
    "ngram": ("ngram", {}, True),
    "suffix": ("suffix", {}, True),
}


@pytest.mark.parametrize("path", list(TINY_PATHS))
def test_every_round_is_what_it_should_be(models, path):
    drafter, kw, can_reject = TINY_PATHS[path]
    engine = engine_for(models, drafter, slots=N, max_len=32, **kw)
    audit, seqs = audited(engine, hf_reference(models[0]))
    audit.assert_clean()
    assert_speculated(seqs, can_reject=can_reject)


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3+ngram"])
@pytest.mark.parametrize("head", ["random", "echo"])
def test_every_eagle_round_is_what_it_should_be(eagle_target, drafter, head):
    """The EAGLE-3 head samples over its draft vocabulary (q zero outside it); beside it the
    n-gram copies report a one-hot q."""
    h = random_head(9) if head == "random" else echo_head(eagle_target)
    engine = engine_for(eagle_target, drafter, slots=N, max_len=32, head=h)
    prompt = [5, 9, 5, 9, 5, 9, 2, 5, 9]
    audit, seqs = audited(engine, hf_reference(eagle_target), prompt=prompt, top_k=0)
    audit.assert_clean()
    assert_speculated(seqs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "cuda-graphs"])
def test_every_compiled_round_is_what_it_should_be(models, mode):
    """The target's verifies and the draft model's steps on the fast path (inductor; captured
    graphs re-run on CPU): compiled-path calls counted before and after."""
    from engine.model.compiled import CompileConfig

    cfg = CompileConfig(enabled=True, mode=mode, batch_buckets=[N], q_buckets=[1, 8], kv_align=16)
    engine = engine_for(models, "model", slots=N, max_len=32, compile=cfg)
    engine.warm_up()
    before = [r.fast.calls for r in engine.runners()]
    audit, seqs = audited(engine, hf_reference(models[0]))
    assert all(r.fast.calls > b for r, b in zip(engine.runners(), before))
    audit.assert_clean()
    assert_speculated(seqs)


@pytest.mark.slow
@pytest.mark.real_model
def test_every_round_of_the_4bit_target_with_the_shipped_drafter(real_fp32):
    """The shipped drafter (the EAGLE-3 head, its matrices 4-bit, with the n-gram fallback) over
    the 4-bit target, as configs/default.yaml builds them (eager), in float32 so that the check
    can be tight (bfloat16 rounding alone parts a prefill's p from a verify's by up to ~0.1):
    the reference is the same 4-bit weights' eager forward over the whole context."""
    from engine.config import EngineConfig
    from engine.model.q4_matmul import Q4Weight
    from tests.conftest import REAL_SPEC
    from tests.helpers import float32_q4_engine

    cfg = EngineConfig.from_dict(
        {
            "model": {"source": REAL_SPEC, "dtype": "float32", "native_q4": True},
            "max_running": 8,
            "max_model_len": 256,
            "drafter": {
                "method": "eagle3",
                "source": "models/smollm2-135m-eagle3",
                "head_q4": True,
                "ngram_fallback": 3,
            },
        }
    )
    # build_engine keeps float32 dense (tests/engine/model/test_quant.py): its pieces, 4-bit
    engine = float32_q4_engine(cfg, real_fp32)
    assert isinstance(engine.target.weights[0].qkv, Q4Weight)
    tok = real_fp32[1]
    prompts = [
        tok(t, return_tensors=None)["input_ids"]
        for t in (
            "The days: Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday,",
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
        )
    ]
    audit = RoundAudit(engine, runner_reference(engine.target), atol=1e-4)
    # 2 requests in 8 slots: the reference prefills into a free one
    ps = [SamplingParams(temperature=0.8, top_k=20, max_tokens=7, seed=i) for i in range(2)]
    seqs = engine.generate(prompts, ps, SpecParams(k=3))
    print(f"4-bit: worst |p - reference| = {audit.worst():.3g}, {audit}")
    audit.assert_clean()
    assert_speculated(seqs)


# -- the audit fails on what it is there to see ---------------------------------------------------
def test_the_audit_sees_a_verify_at_the_wrong_temperature(models, monkeypatch):
    real = round_module.logits_to_probs

    def hotter(logits, temperature, *rest):
        return real(logits, temperature * 1.1, *rest)

    monkeypatch.setattr(round_module, "logits_to_probs", hotter)
    engine = engine_for(models, "model", slots=N, max_len=32)
    audit, _ = audited(engine, hf_reference(models[0]))
    assert audit.failures and all("reference" in f for f in audit.failures)


def test_the_audit_sees_a_drafter_that_misreports_q(models):
    engine = engine_for(models, "model", slots=N, max_len=32)
    propose = engine.drafter.propose

    def misreported(seqs, plan):  # the drafts sampled from q, q reported at a higher temperature
        prop = propose(seqs, plan)
        if prop.probs is not None:
            q = prop.probs**0.9
            prop.probs = q / q.sum(-1, keepdim=True)
        return prop

    engine.drafter.propose = misreported
    audit, _ = audited(engine, hf_reference(models[0]))
    assert audit.failures and all("select" in f for f in audit.failures)
