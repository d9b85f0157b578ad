"""loadtest/bench/gpu_parts.py: the GPU benchmark's fast-path options per runner."""

from loadtest.bench.gpu_parts import compile_config, parse_args


def test_fuse_option_picks_the_runners_whose_graphs_fuse():
    for fuse, target, draft in ((0, False, False), (1, True, False), (2, True, True)):
        a = parse_args(["--fuse", str(fuse), "--layers-per-graph", "4"], "")
        t, d = (compile_config(a, [1, 8], 4, name) for name in ("target", "draft"))
        assert (t.fuse, d.fuse) == (target, draft)
        assert t.enabled and t.mode == "cuda-graphs" and t.layers_per_graph == 4
        assert t.batch_buckets == [1, 8] and t.q_buckets == [1, 2, 3, 4, 5]


def test_section_four_may_skip_the_draft_models_rows():
    assert parse_args([], "").model_s4 and parse_args([], "").eagle
    assert not parse_args(["--no-model-s4"], "").model_s4
