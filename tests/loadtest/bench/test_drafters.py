"""loadtest/bench/drafters.py: which server configs one run compares."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.builder import make_controller
from engine.config import EngineConfig
from engine.kcontrol.controller import FixedK
from loadtest.bench.drafters import COLUMNS, by_set, configs, llama_runs, tau_by_set

ROOT = Path(__file__).resolve().parents[3]


def test_an_eagle_config_runs_the_head_with_and_without_the_fallback_and_ngram():
    runs = configs(ROOT / "configs" / "cpu-eagle.yaml")
    assert list(runs) == ["eagle3", "eagle3+ngram", "ngram"]
    drafters = {name: EngineConfig.from_dict(c["engine"]).drafter for name, c in runs.items()}
    assert drafters["eagle3"].method == "eagle3" and drafters["eagle3"].ngram_fallback == 0
    assert drafters["eagle3+ngram"].method == "eagle3"
    assert drafters["eagle3+ngram"].ngram_fallback == 3
    assert drafters["eagle3+ngram"].source == drafters["eagle3"].source
    assert drafters["ngram"].method == "ngram"
    same = {k: v for k, v in runs["ngram"]["engine"].items() if k != "drafter"}
    assert same == {k: v for k, v in runs["eagle3"]["engine"].items() if k != "drafter"}


def test_an_ngram_config_runs_itself_and_ngram():
    assert list(configs(ROOT / "configs" / "cpu-compiled.yaml")) == ["ngram"]


def test_the_default_config_is_the_head_with_the_ngram_fallback():
    runs = configs(ROOT / "configs" / "default.yaml")
    assert list(runs) == ["eagle3", "eagle3+ngram", "ngram"]
    default = EngineConfig.from_yaml(ROOT / "configs" / "default.yaml").drafter
    assert default == EngineConfig.from_dict(runs["eagle3+ngram"]["engine"]).drafter


def test_llama_server_runs_plain_its_ngram_and_with_a_head_the_head():
    assert llama_runs(None) == {
        "llama": ([], "plain"),
        "llama-spec": (["--spec-default"], "ngram-mod"),
    }
    runs = llama_runs("/x/head.gguf")
    flags = ["-md", "/x/head.gguf", "--spec-type", "draft-eagle3"]
    assert runs["llama-eagle3"] == (flags, "eagle3")


def test_trees_add_the_head_servers_with_trees():
    """--tree-leaves L (--tree-topk B) adds each EAGLE-3 server with draft trees of up to L
    nodes past its chains (from EAGLE-2's expansion with top B), all else the same."""
    runs = configs(ROOT / "configs" / "default.yaml", trees=4, topk=4)
    assert list(runs) == ["eagle3", "eagle3+ngram", "eagle3+tree", "eagle3+ngram+tree", "ngram"]
    tree = EngineConfig.from_dict(runs["eagle3+ngram+tree"]["engine"]).drafter
    chain = EngineConfig.from_dict(runs["eagle3+ngram"]["engine"]).drafter
    assert (tree.tree_leaves, tree.tree_topk, tree.ngram_fallback) == (4, 4, 3)
    assert (chain.tree_leaves, chain.tree_topk) == (0, 0)


def test_a_fixed_tree_server_drafts_that_tree_every_round_in_a_bucket_that_holds_it():
    runs = configs(ROOT / "configs" / "default.yaml", fixed_tree="4+8x4")
    assert list(runs) == ["eagle3", "eagle3+ngram", "eagle3+4+8x4", "eagle3+ngram+4+8x4", "ngram"]
    for name, fallback in (("eagle3+4+8x4", 0), ("eagle3+ngram+4+8x4", 3)):
        cfg = EngineConfig.from_dict(runs[name]["engine"])
        d = cfg.drafter
        assert (d.controller, d.k, d.k_max, d.tree_leaves, d.tree_topk) == ("fixed", 4, 12, 8, 4)
        assert d.ngram_fallback == fallback and d.method == "eagle3"
        assert cfg.compile.q_buckets == [1, 2, 4, 8, 16]  # 12 drafts + the last token: 16
        ctrl = make_controller(d, SimpleNamespace(trees=True))
        assert isinstance(ctrl, FixedK) and (ctrl.k, ctrl.leaves) == (4, 8)
    for bad in ("4+8", "0+8x4", "4+0x4", "4+8x1"):  # no expansion, no chain, no tree, no top B
        with pytest.raises(ValueError, match="K\\+LxB"):
            configs(ROOT / "configs" / "default.yaml", fixed_tree=bad)
    with pytest.raises(ValueError, match="EAGLE-3"):
        configs(ROOT / "configs" / "cpu-compiled.yaml", fixed_tree="4+8x4")


def test_tokens_per_pass_by_set_sums_each_sets_categories_over_the_runs():
    def summary(**cats):
        return {"by_category": {c: {"output_tokens": t, "passes": p} for c, (t, p) in cats.items()}}

    rows = [
        {"by_set": by_set(summary(writing=(10, 5), coding=(20, 5), humaneval=(9, 3)))},
        {"by_set": by_set(summary(writing=(30, 10), **{"sharegpt-e": (8, 4)}))},
    ]
    assert COLUMNS == ("sharegpt-e", "mt-bench", "humaneval")
    assert tau_by_set(rows) == [2.0, 60 / 20, 3.0]
    assert tau_by_set([{"by_set": by_set(summary(humaneval=(9, 0)))}]) == [None, None, None]
