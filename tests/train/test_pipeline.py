"""The one-command recipe (train/pipeline.py): the config's sections become each stage's options,
in order, as the stage's own command line would give them."""

from pathlib import Path

import yaml

from train.pipeline import _argv, stages

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "train" / "smollm2-eagle3.yaml"


def test_options_become_flags():
    assert _argv({"max_tokens": 256, "bf16": True, "native_q4": False, "init": None}) == [
        "--max-tokens",
        "256",
        "--bf16",
    ]


def test_shipped_recipe_runs_eval_then_train_then_fit():
    config = yaml.safe_load(CONFIG.read_text())
    got = stages(config)
    assert [name for name, _ in got] == ["distill eval", "distill train", "original train", "fit"]
    ev, tr, orig, fit = (ns for _, ns in got)
    assert orig.split == "train" and orig.out == config["distill"]["out"]
    assert (ev.split, tr.split) == ("eval", "train")
    assert ev.limit == config["distill"]["eval"]["limit"] and ev.minutes == 0
    assert tr.minutes == config["distill"]["train"]["minutes"]
    assert ev.max_tokens == tr.max_tokens == config["distill"]["max_tokens"]
    assert fit.data == config["distill"]["out"]  # fit reads what distill wrote
    assert fit.out == "models/smollm2-135m-eagle3" and fit.draft_vocab == 8192
    assert fit.train_files.split(",") == ["train.jsonl", "train-original.jsonl"]
    assert fit.eval_file == "eval.jsonl" and fit.vocab_from == "train.jsonl"


def test_a_split_can_be_skipped():
    got = stages({"distill": {"eval": {"skip": True}}, "fit": {"max_steps": 3}})
    assert [name for name, _ in got] == ["distill train", "fit"]
    assert got[1][1].max_steps == 3


def test_every_training_config_names_only_known_options():
    for path in sorted(CONFIG.parent.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        got = dict(stages(config))  # argparse exits on an unknown option
        assert "fit" in got and got["fit"].out, path.name
