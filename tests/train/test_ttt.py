"""The training forward (train/ttt.py) computes what the inference drafter computes: step 0 at
index p is the head taking in position p from real features, step j is the j-th chained draft
step after it (fed the true tokens), attending over the same keys."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.builder import head_runner
from engine.drafters.eagle.drafter import EagleDrafter
from engine.model.runner import ModelRunner
from tests import helpers
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, random_head
from train.ttt import TTTForward, ttt_loss


def test_ttt_steps_equal_the_inference_chain():
    target = helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN)
    head = random_head(4)
    ids = [1, 5, 7, 2, 9, 11, 3, 3, 8, 4, 6, 10, 12, 1, 2]
    runner = ModelRunner(target, num_slots=1, max_len=64, taps=tuple(head.config.aux_layers))
    feats = runner.forward([ids], [0]).tapped  # [1, S, 3 hidden]
    steps = 3
    d = EagleDrafter(head, head_runner(head, target.model.embed_tokens, 1, 64), VOCAB)
    rotary = LlamaRotaryEmbedding(config=head.config.llama_config())
    fwd = TTTForward(head, target.model.embed_tokens, rotary)
    with torch.no_grad():
        outs = fwd(feats, torch.tensor([ids]), steps)  # each [1, S, hidden]
        train_logits = [head.lm_head(o) for o in outs]  # each [1, S, draft_vocab]
    P = 8  # the last real position the drafter takes in
    d.cache.allocate(0)
    d.pending[0], d.pending_n[0], d.real[0], d.skipped[0] = [feats[0, : P + 1]], P + 1, 0, 0

    class Row:
        slot = 0

        def token_array(self):
            return torch.tensor(ids).numpy()

    out, logits = d._ingest([Row()], [P + 1])  # type: ignore[list-item]
    for j in range(steps):
        if j > 0:  # the chain: own output and the true token t_{P+1+j} at position P + j
            tok = torch.tensor([ids[P + 1 + j]])
            assert d.cache.lengths[0] == P + j
            out, logits = d.chain_step(tok, out, [0])
            d.cache.commit(0, P + j + 1)
        inference = logits[0]  # [draft_vocab]
        torch.testing.assert_close(inference, train_logits[j][0, P].float(), atol=1e-4, rtol=1e-4)


def test_loss_is_the_entropy_at_the_target():
    """Soft CE equals the target's entropy (its minimum) when the head's logits are the
    target's (an identity LM head over outputs that are the target's logits), and top-1
    agreement is 1; masked positions do not count."""
    tl = torch.randn(2, 6, 5)
    predict = torch.ones(2, 6, dtype=torch.bool)
    predict[1, 4] = False
    outs = [torch.nn.functional.pad(tl[:, 1 + j :], (0, 0, 0, 1 + j)) for j in range(2)]
    _, ces, accs = ttt_loss(torch.nn.Identity(), outs, tl, predict)
    for j, ce in enumerate(ces):
        p = tl[:, 1 + j :].softmax(-1)[predict[:, 1 + j :]]
        entropy = float(-(p * p.log()).sum(-1).mean())
        assert abs(ce - entropy) < 1e-5
    assert accs == [1.0, 1.0]


def test_hard_loss_is_cross_entropy_at_the_target_top_token():
    """``hard=True`` (the soft labels' ablation): the loss at each step is the cross-entropy of
    the head's logits against the target's top token, over the counted positions only, and the
    total weights step j by 0.8^j."""
    torch.manual_seed(0)
    tl = torch.randn(2, 6, 5)
    head_out = [torch.randn(2, 6, 5) for _ in range(2)]
    predict = torch.ones(2, 6, dtype=torch.bool)
    predict[0, 3] = False
    total, ces, _ = ttt_loss(torch.nn.Identity(), head_out, tl, predict, hard=True)
    expected = []
    for j, out in enumerate(head_out):
        mask = predict[:, 1 + j :]
        pred, top = out[:, : 6 - 1 - j][mask], tl[:, 1 + j :][mask].argmax(-1)
        expected.append(float(-pred.log_softmax(-1).gather(1, top[:, None]).mean()))
    assert ces == [pytest.approx(e, abs=1e-5) for e in expected]
    assert float(total) == pytest.approx(expected[0] + 0.8 * expected[1], abs=1e-5)
    soft_total, _, _ = ttt_loss(torch.nn.Identity(), head_out, tl, predict)
    assert float(soft_total) != pytest.approx(float(total))  # the option changes the loss
