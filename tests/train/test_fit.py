"""The fit (train/fit.py): its schedule over epochs, its report, and a short run end to end."""

import argparse
import json

import pytest
import torch

from engine.drafters.eagle.head import load_head
from train import fit
from train.fit import epoch_order, simulated_tau


def test_epochs_visit_every_batch_once_in_a_fixed_order():
    assert epoch_order(10, 0, seed=3) == list(range(10))
    one, two = epoch_order(10, 1, seed=3), epoch_order(10, 2, seed=3)
    assert sorted(one) == sorted(two) == list(range(10))
    assert one != two and one != list(range(10))
    assert one == epoch_order(10, 1, seed=3)  # a resumed run continues the same order


def test_simulated_tau_chains_the_agreements():
    assert simulated_tau([0.5, 0.5], 3) == 1 + 0.5 + 0.25 + 0.125  # the last step repeats
    assert simulated_tau([1.0], 4) == 5.0 and simulated_tau([0.0, 1.0], 3) == 1.0


@pytest.mark.real_model
def test_a_short_fit_trains_evaluates_and_saves_a_loadable_head(tmp_path):
    """``python -m train fit`` end to end on a few rows: two steps warm-started from the shipped
    head (its draft vocabulary kept), the greedy held-out agreement per draft step in
    ``training.json``, and the saved folder loads as an EAGLE-3 head with the same vocabulary."""
    g = torch.Generator().manual_seed(0)
    for name, n in (("train.jsonl", 6), ("eval.jsonl", 2)):
        with open(tmp_path / name, "w") as f:
            for _ in range(n):
                ids = torch.randint(100, 20000, (48,), generator=g).tolist()
                f.write(json.dumps({"prompt_ids": ids[:16], "output_ids": ids[16:]}) + "\n")
    out, shipped = tmp_path / "head", "models/smollm2-135m-eagle3"
    ap = argparse.ArgumentParser()
    fit.add_arguments(ap)
    fit.run(ap.parse_args([
        f"--data={tmp_path}", f"--work={tmp_path / 'work'}", f"--out={out}", f"--init={shipped}",
        "--max-steps=2", "--eval-rows=2", "--tokens=256", "--max-len=64", "--warmup=1",
        f"--feature-cache={tmp_path / 'features'}",
    ]))  # fmt: skip
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 2 and report["eval_sequences"] == 2
    agreement = report["eval_top1_agreement_by_step"]
    assert len(agreement) == 4 and all(0.0 <= a <= 1.0 for a in agreement)
    assert sum(agreement) > 0  # positions were counted and some drafts agree
    head, base = load_head(str(out)), load_head(shipped)
    assert torch.equal(head.draft_to_target, base.draft_to_target)
    assert not torch.equal(head.fc.weight, base.fc.weight)  # the steps changed it
