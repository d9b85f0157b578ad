"""loadtest/bench/gpu_prefill.py on CPU (tiny shapes): both ways of prefilling run, side by side."""

from loadtest.bench import gpu_prefill


def test_runs_both_ways_of_prefilling(tmp_path):
    args = "--device cpu --dtype float32 --target tiny --draft tiny --max-tokens 8 --batches 2"
    rows = gpu_prefill.main([*args.split(), "--json", str(tmp_path / "g.json")])
    assert [(r["batch"], r["mode"]) for r in rows] == [(2, "off"), (2, "adaptive")]
    assert all(r["grouped"] > 0 and r["one_each"] > 0 for r in rows)
