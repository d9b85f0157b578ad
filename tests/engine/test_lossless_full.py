"""Lossless over every real prompt (``pytest -m full``; hours on a CPU, left out of the default
selection and of CI): the 80 MT-Bench first turns and the 164 HumanEval completions.

For each prompt, transformers' own greedy ``generate()`` (target only, fp32) is the reference.
specd runs the same prompts with speculation at K = 4, ``BATCH`` at a time (the ragged batch path),
for each drafter; every output must equal its reference token for token, speculation must have
drafted, and the KV cache must be empty afterwards.
"""

import pytest

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.records.params import SamplingParams, SpecParams
from prompts.sets import encode, human_eval, mt_bench
from tests.helpers import greedy_reference

pytestmark = [pytest.mark.full, pytest.mark.real_model]

MAX_TOKENS, K, BATCH = 48, 4, 8
HEAD = "models/smollm2-135m-eagle3"
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
DRAFTERS = {
    "ngram": {"method": "ngram"},
    "self": {"method": "self"},
    "layers15": {"method": "layers", "num_layers": 15},
    "layers8": {"method": "layers", "num_layers": 8},
    # the shipped EAGLE-3 head, alone and with the default's per-row n-gram fallback
    "eagle3": {"method": "eagle3", "source": HEAD},
    "eagle3+ngram": {"method": "eagle3", "source": HEAD, "ngram_fallback": 3},
}
PROMPT_SETS = {"mtbench": mt_bench, "humaneval": human_eval}


@pytest.fixture(scope="module")
def prompt_set(real_fp32):
    """name -> (prompts, token ids, target-only greedy outputs), each set computed once."""
    model, tok = real_fp32
    done: dict = {}

    def get(name):
        if name not in done:
            prompts = PROMPT_SETS[name]()
            encoded = [encode(tok, p) for p in prompts]
            reference = [greedy_reference(model, tok, ids, MAX_TOKENS) for ids in encoded]
            done[name] = prompts, encoded, reference
        return done[name]

    return get


@pytest.mark.parametrize("prompts_name", list(PROMPT_SETS))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_speculative_greedy_equals_target_greedy(real_fp32, prompt_set, drafter, prompts_name):
    prompts, encoded, reference = prompt_set(prompts_name)
    cfg = EngineConfig.from_dict(
        {
            "model": {"dtype": "float32"},
            "max_running": BATCH,
            "max_prefill_per_step": BATCH,
            "drafter": DRAFTERS[drafter],
        }
    )
    engine = build_engine(cfg, real_fp32).engine
    mismatched, drafted = [], 0
    for start in range(0, len(encoded), BATCH):
        seqs = engine.generate(encoded[start : start + BATCH], GREEDY, SpecParams(k=K))
        for j, s in enumerate(seqs):
            drafted += s.drafted
            if s.output_ids != reference[start + j]:
                mismatched.append(prompts[start + j].id)
    assert not mismatched, f"{len(mismatched)} of {len(encoded)} prompts differ: {mismatched}"
    assert drafted > 0
    assert engine.target.cache.used_tokens() == 0
    drafter = getattr(engine.drafter, "eagle", engine.drafter)  # the n-gram fallback's head
    if getattr(drafter, "cache", None) is not None:  # a drafter's own cache: empty too
        assert drafter.cache.used_tokens() == 0
