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


@pytest.mark.real_model
def test_the_gpu_runs_inputs_packed_rows_and_the_starting_heads_agreement(tmp_path):
    """The inputs of a GPU fit (scripts/gpu_train.sh): packed training rows, a gzipped eval file,
    no feature cache (the features stay on the runner's device) and ``--eval-init``. With a zero
    learning rate the trained head is the starting one, so the agreement ``--eval-init`` records
    before training must equal the final evaluation's: both measure the same thing."""
    import gzip

    from engine.config import DEFAULT_TARGET
    from engine.model.loader import load_model
    from train.packed import save_rows

    _, tok = load_model(DEFAULT_TARGET, "bfloat16")
    text = (
        "The quick brown fox jumps over the lazy dog. It was the best of times, it was the "
        "worst of times. One, two, three, four, five, six, seven, eight, nine, ten, eleven. "
    )
    ids = tok(text * 4)["input_ids"]
    rows = [ids[i * 5 : i * 5 + 48] for i in range(8)]  # real text: some drafts agree
    save_rows(tmp_path / "train.npz", ((r, 16) for r in rows[:6]))
    with gzip.open(tmp_path / "eval.jsonl.gz", "wt") as f:
        for r in rows[6:]:
            f.write(json.dumps({"prompt_ids": r[:16], "output_ids": r[16:]}) + "\n")
    ap = argparse.ArgumentParser()
    fit.add_arguments(ap)

    def run(lr: str) -> dict:
        out = tmp_path / f"head-{lr}"
        fit.run(ap.parse_args([
            f"--data={tmp_path}", "--train-files=train.npz", "--eval-file=eval.jsonl.gz",
            f"--work={tmp_path / f'work-{lr}'}", f"--out={out}",
            "--init=models/smollm2-135m-eagle3", "--max-steps=2", "--eval-rows=2",
            "--tokens=256", "--max-len=64", "--warmup=1", f"--lr={lr}", "--feature-cache=",
            "--eval-init",
        ]))  # fmt: skip
        return json.loads((out / "training.json").read_text())

    still, moved = run("0"), run("0.01")
    assert still["train_sequences"] == 6 and still["eval_sequences"] == 2
    init = still["init_eval_top1_agreement_by_step"]
    assert len(init) == 4 and sum(init) > 0
    assert still["eval_top1_agreement_by_step"] == init  # an unchanged head measures the same
    # measured before training: the same whatever the steps then do to the head
    assert moved["init_eval_top1_agreement_by_step"] == init
    assert moved["eval_top1_agreement_by_step"] != init
