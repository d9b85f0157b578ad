"""loadtest/bench/drafters.py: which server configs one run compares."""

from pathlib import Path

from engine.config import EngineConfig
from loadtest.bench.drafters import configs, llama_runs

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
