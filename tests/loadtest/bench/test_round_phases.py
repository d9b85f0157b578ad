"""The round-phase bench's timer: a wrapped method still returns (and raises) as before, and
its calls add their time to the label."""

import collections
import time

import pytest

from loadtest.bench.round_phases import timer


def test_timer_adds_each_calls_time_and_keeps_results_and_errors():
    class Phase:
        def run(self, seconds: float, fail: bool = False) -> str:
            time.sleep(seconds)
            if fail:
                raise ValueError("boom")
            return "done"

    totals: collections.defaultdict[str, float] = collections.defaultdict(float)
    p = Phase()
    timer(totals, p, "run", "phase.run")
    assert p.run(0.01) == "done"
    with pytest.raises(ValueError, match="boom"):
        p.run(0.02, fail=True)
    assert 0.03 <= totals["phase.run"] < 1.0
    assert Phase().run(0) == "done" and list(totals) == ["phase.run"]  # the class is untouched
