"""Start-up calibration on tiny random models: the points it adds, its slot hygiene, and that
every forward it times goes through engine.kcontrol.timing."""

import pytest

import engine.kcontrol.timing
from engine.kcontrol.calibration import calibrate, shapes
from engine.kcontrol.controller import AdaptiveK
from engine.kcontrol.cost import RoundCost
from engine.model.runner import ModelRunner


class Recorder:
    """A CostModel that records the calibration points it is given."""

    def __init__(self):
        self.shape = lambda batch, q: (batch, q)
        self.points, self.steps = [], []

    def observe(self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False):
        pass

    def predict(self, batch, width, steps, catch_up=0, tree=False):
        return 1.0

    def add_calibration(self, batch, width, seconds):
        self.points.append((batch, width, seconds))

    def add_step_calibration(self, batch, seconds, catch_up=0):
        self.steps.append((batch, seconds, catch_up))


@pytest.fixture
def runners(models):
    target, draft = models
    return ModelRunner(target, num_slots=6, max_len=128), ModelRunner(
        draft, num_slots=6, max_len=128
    )


def assert_all_free(*rs):
    for r in rs:
        assert r.cache.num_free() == 6 and r.cache.used_tokens() == 0


def test_adds_points_at_the_calibration_shapes(runners):
    target, draft = runners
    cost = Recorder()
    calibrate(cost, target, draft, target.cache.free_slots())
    # no fast path: powers of two and every free slot, widths (0, 1, 3) and K_max = 7
    expected = [(b, w) for b in (1, 2, 4, 6) for w in (0, 1, 3, 7)]
    assert [(b, w) for b, w, _ in cost.points] == expected
    assert [(b, c) for b, _, c in cost.steps] == [(1, 0), (1, 7), (6, 0), (6, 42)]  # catch-ups
    assert all(s > 0 for *_, s in cost.points) and all(s > 0 for _, s, _ in cost.steps)
    assert_all_free(target, draft)


def test_every_timed_forward_goes_through_engine_timing(runners, monkeypatch):
    target, draft = runners
    synced, forwards = [], []
    real_sync = engine.kcontrol.timing.synchronize

    def sync(device):
        synced.append(device)
        real_sync(device)

    for r in (target, draft):
        real = r.forward

        def counting(*a, _real=real, **kw):
            forwards.append(kw.get("logits"))
            return _real(*a, **kw)

        monkeypatch.setattr(r, "forward", counting)
    monkeypatch.setattr(engine.kcontrol.timing, "synchronize", sync)
    calibrate(Recorder(), target, draft, [0, 1], repeats=2)
    timed_shapes = 2 * (4 + 2)  # batches {1, 2} x (4 target widths + 2 draft steps)
    assert len(synced) == 2 * 2 * timed_shapes  # before and after each of 2 timed repeats
    assert all(d == target.device for d in synced)
    # 1 context forward per runner, then 1 warm-up + 2 timed forwards per shape
    assert forwards.count("all") == 3 * timed_shapes and len(forwards) == 2 + 3 * timed_shapes
    assert_all_free(target, draft)


def test_slots_are_freed_when_a_forward_fails(runners, monkeypatch):
    target, draft = runners
    real = target.forward

    def failing(tokens, slots, counts=None, logits="last", invariant=False):
        if logits == "all":
            raise RuntimeError("boom")
        return real(tokens, slots, counts, logits, invariant)

    monkeypatch.setattr(target, "forward", failing)
    with pytest.raises(RuntimeError):
        calibrate(Recorder(), target, draft, target.cache.free_slots())
    assert_all_free(target, draft)


def test_uses_only_the_free_slots_it_is_given(runners):
    target, _ = runners
    held = target.cache.allocate(0)
    calibrate(Recorder(), target, None, target.cache.free_slots())
    assert target.cache.num_free() == 5 and sorted(target.cache.free_slots()) == [1, 2, 3, 4, 5]
    target.cache.free(held)
    calibrate(Recorder(), target, None, [])  # no free slot: nothing to do
    assert_all_free(target)


def test_adaptive_calibrates_once_it_has_a_free_slot(runners):
    target, draft = runners
    ctrl = AdaptiveK(4, cost=None)
    ctrl.calibrate(target, draft, [])
    assert not ctrl.calibrated
    ctrl.calibrate(target, draft, target.cache.free_slots())
    assert ctrl.calibrated and isinstance(ctrl.cost, RoundCost)
    # calibration points sit in the fit (times themselves vary with load: not compared)
    assert ctrl.cost.rest.b_fixed[0] > 0 and ctrl.cost.draft.b_fixed[0] > 0
    assert ctrl.cost.observed == 0
    assert_all_free(target, draft)


def test_times_the_lowest_free_slots(runners, monkeypatch):
    """The compiled path runs a forward over the row bucket of slots [0, max slot], so the
    calibration times the lowest free slots (free_slots lists them highest first): a batch of
    one is timed as one row, not as the cache's last slot's bucket."""
    target, _ = runners
    seen: list[list[int]] = []
    forward = target.forward

    def spy(rows, slots, *args, **kwargs):
        seen.append(list(slots))
        return forward(rows, slots, *args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    calibrate(Recorder(), target, None, target.cache.free_slots(), max_batch=4)
    assert target.cache.free_slots()[0] == 5  # highest first
    assert {s for slots in seen for s in slots} == {0, 1, 2, 3}
    assert [0] in seen and [0, 1, 2, 3] in seen
    assert_all_free(target)


class Bucketed:
    def __init__(self, rows, qs):
        self._b = (rows, qs)

    def buckets(self):
        return self._b


def test_shapes_are_the_fast_paths_buckets():
    """Calibration times one forward per verify shape the fast path runs: its row buckets up to
    the free slots, its q buckets up to K_max + 1 (a width is q - 1)."""
    runner = Bucketed([1, 2, 4, 8, 16], [1, 2, 4, 8])
    assert shapes(runner, 16, 7) == ([1, 2, 4, 8, 16], [0, 1, 3, 7])
    assert shapes(runner, 6, 3) == ([1, 2, 4], [0, 1, 3])
    assert shapes(runner, 0, 3) == ([], [0, 1, 3])
    # every bucket above the slots: the rows there are (padded to the bucket when run)
    assert shapes(Bucketed([48], [1, 8]), 16, 7) == ([16], [0, 7])


def test_context_is_copied_not_prefilled_per_slot(runners, monkeypatch):
    """One slot's context is computed and copied to the other slots: the context costs one
    prefill a runner, and every timed row attends over the same context."""
    target, draft = runners
    contexts, copies = [], []
    for r in (target, draft):
        real, real_copy = r.forward, r.cache.copy

        def counting(*a, _real=real, _r=r, **kw):
            if kw.get("logits") != "all":
                contexts.append(_r)
            return _real(*a, **kw)

        def copying(src, dst, length, _real=real_copy, _r=r):
            copies.append((_r, src, dst, length))
            return _real(src, dst, length)

        monkeypatch.setattr(r, "forward", counting)
        monkeypatch.setattr(r.cache, "copy", copying)
    calibrate(Recorder(), target, draft, target.cache.free_slots(), prefix=40)
    assert contexts == [target, draft]
    assert sorted((d, length) for r, _, d, length in copies if r is target) == [
        (s, 40) for s in range(1, 6)
    ]
    assert {src for _, src, _, _ in copies} == {0}
    assert_all_free(target, draft)


def test_the_engines_warm_up_calibrates_before_the_first_request(models, monkeypatch):
    """A server's engine (a fast path to warm up, the adaptive controller) calibrates in its
    warm-up, before it reports ready, with every slot free; its first request (K the
    controller's to decide) then waits for no calibration."""
    from engine.model.compiled import CompileConfig
    from engine.records.params import SamplingParams
    from tests import helpers

    compiled = CompileConfig(enabled=True, backend="eager", batch_buckets=[1, 2], q_buckets=[1, 4])
    engine = helpers.engine_for(models, "model", slots=2, compile=compiled)
    ctrl = engine.controller
    assert isinstance(ctrl, AdaptiveK) and not ctrl.calibrated and engine.needs_warm_up()
    seen = []
    real = ctrl.calibrate

    def counting(target, draft, free, *a, **kw):
        seen.append(list(free))
        return real(target, draft, free, *a, **kw)

    monkeypatch.setattr(ctrl, "calibrate", counting)
    engine.warm_up()
    assert [sorted(f) for f in seen] == [[0, 1]] and ctrl.calibrated
    assert engine.target.cache.num_free() == 2 and engine.target.cache.used_tokens() == 0
    out = engine.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(temperature=0, max_tokens=16))
    assert len(seen) == 1 and len(out[0].output_ids) == 16  # no second calibration
