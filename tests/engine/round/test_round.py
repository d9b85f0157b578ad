"""The round keeps its promise of one device->host sync (engine/round/speculator.py,
engine/round/output.py).

On CPU a sync cannot be observed directly, so every Python-level way to read a tensor on the
host (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``numpy``, ``cpu``) is counted while
a round runs; on CUDA, ``torch.cuda.set_sync_debug_mode`` checks the same thing for real.
"""

import contextlib

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from tests.helpers import cuda_syncs, engine_for

READS = ["tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"]


@contextlib.contextmanager
def count_host_reads():
    counts = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(orig):
        def f(self, *a, **k):
            counts["n"] += 1
            return orig(self, *a, **k)

        return f

    for name, orig in saved.items():
        setattr(torch.Tensor, name, wrap(orig))
    try:
        yield counts
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)


PARAMS = [
    SamplingParams(temperature=0, max_tokens=40),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, logprobs=3),
    SamplingParams(temperature=1.0, top_k=5, max_tokens=40, seed=7),
    SamplingParams(temperature=0.7, max_tokens=40),
]
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 30)), [7] * 5, [4, 5, 6, 4, 5]]


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_one_host_read_per_round(models, drafter):
    e = engine_for(models, drafter)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        e.add_request(f"r{i}", p, sp, SpecParams(k=3))
    e.step()  # admission, prefill and the first tokens (their own single read), then a round
    rounds = 0
    while e.has_work() and rounds < 10:
        assert not e.prefilling and not e.waiting
        with count_host_reads() as reads:
            outs = e.step()
        assert reads["n"] == 1, f"round {rounds}: {reads['n']} host reads"
        assert outs
        rounds += 1
    assert rounds == 10
    assert sum(s.drafted for s in e.running) > 0  # the rounds really speculated


def test_first_tokens_read_the_host_once(models):
    e = engine_for(models, "model")
    e.add_request("a", [1, 2, 3], SamplingParams(temperature=0.9, max_tokens=4, logprobs=2))
    e.add_request("b", [4, 5], SamplingParams(temperature=0, max_tokens=4))
    sched = e.scheduler
    chunks = sched.schedule_prefill()
    logits = []
    for c in chunks:
        logits.append(e.target.forward([c.tokens], [c.seq.slot]).logits)
        sched.prefilled(c)
    with count_host_reads() as reads:
        outs = e.speculator.first_tokens([c.seq for c in chunks], torch.cat(logits))
    assert reads["n"] == 1 and len(outs) == 2
    assert outs[0].logprobs is not None and len(outs[0].top_logprobs[0]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("drafter", ["model", "ngram", None])
def test_one_sync_per_round_on_cuda(models, drafter):  # pragma: no cover - runs where a GPU is
    """On the GPU, ``torch.cuda.set_sync_debug_mode`` sees every synchronizing call (host reads
    and pageable host->device copies alike): a round makes exactly one."""
    target, draft = (m.to("cuda") for m in models)
    e = engine_for((target, draft), drafter)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        e.add_request(f"r{i}", p, sp, SpecParams(k=3))
    e.step()
    for _ in range(5):
        syncs = cuda_syncs(e.step)
        assert len(syncs) == 1, syncs


def test_phase_clock_on_cpu_is_the_wall_clock():
    import time

    from engine.kcontrol.timing import PhaseClock

    clock = PhaseClock("cpu")
    clock.mark()
    time.sleep(0.02)
    clock.mark()
    assert 0.015 < clock.seconds(0, 1) < 1.0 and not clock.events


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_phase_clock_on_cuda_counts_queued_device_work():  # pragma: no cover - GPU only
    """A phase that only queues ~50 ms of kernels is priced at their run, not their launch."""
    from engine.kcontrol.timing import PhaseClock

    x = torch.randn(4096, 4096, device="cuda")
    clock = PhaseClock("cuda")
    clock.mark()
    for _ in range(20):
        x = x @ x / 64
    clock.mark()
    x.sum().item()  # the round's sync
    wall_launch = clock.walls[1] - clock.walls[0]
    assert clock.seconds(0, 1) >= wall_launch and clock.seconds(0, 1) > 1e-3
