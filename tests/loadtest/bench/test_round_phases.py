"""The round-phase bench reads each phase off a profile by the function's file and name: every
phase it names is a function a round really runs (a renamed one would drop out of the table
silently), and a phase's time is within its round's."""

import cProfile

from engine.records.params import SamplingParams, SpecParams
from loadtest.bench.round_phases import PHASES, phase_seconds
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, eagle_engine, random_head
from tests.helpers import engine_for, tiny_llama


def test_every_phase_is_found_in_a_profiled_round():
    target, draft = tiny_llama(0), tiny_llama(1)
    eagle_target = tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    found: dict[str, float] = {}
    for engine in (
        engine_for((target, draft), "model", slots=2, max_len=64),
        eagle_engine(eagle_target, random_head(3), slots=2, k=2, max_len=64),
    ):
        profile = cProfile.Profile()
        profile.enable()
        engine.generate([[1, 2, 3, 4]], params, SpecParams(k=2))
        profile.disable()
        phases = phase_seconds(profile)
        assert all(phases[p] <= phases["round"] for p in phases if p.startswith("round."))
        found |= phases
    assert set(found) == set(PHASES), set(PHASES) - set(found)
