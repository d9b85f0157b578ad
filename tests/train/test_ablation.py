"""The ablation arms (train/ablation.py) share the recipe and change one thing each."""

import argparse

from train import ablation


def _args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ablation.add_arguments(ap)
    return ap.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_each_arm_changes_one_option_against_the_recipe():
    args = _args(steps=7, work="/tmp/ab")
    base = vars(ablation.arm_args("base", args))
    assert base["loss"] == "soft" and base["ttt_steps"] == 4 and base["noise"] == 0.0
    assert base["max_steps"] == 7 and base["eval_steps"] == 4 and base["init"] is None
    assert base["vocab_of"] == "models/smollm2-135m-eagle3"
    for arm, change in ablation.ARMS.items():
        got = vars(ablation.arm_args(arm, args))
        differs = {k for k in got if got[k] != base[k]} - {"work", "out"}
        assert differs == set(change), arm
        assert got["out"] == f"/tmp/ab/{arm}/head"
