"""The EAGLE-3 head's training forward: training-time test (TTT) over ``steps`` draft steps.

For a batch of sequences with the target's features f ``[B, S, taps * H]`` and tokens t
``[B, S]``, step j = 0 .. steps-1 computes, at every index p at once, what drafting step j + 1
computes at inference when p is the last position the head took in from real features:

  * step 0: input (g_p = fc(f_p), t_{p+1}) at position p, attending causally over the step-0
    keys of positions <= p: the head's guess of t_{p+2};
  * step j >= 1: input (o^{j-1}_p, t_{p+1+j}) -- its own previous output, the true token (a draft
    is accepted only when it equals it) -- at position p + j, attending over the step-0 keys of
    positions <= p and the keys of steps 1..j at index p (the chain it drafted): its guess of
    t_{p+2+j}.

The step-0 output equals the inference path's (engine/drafters/eagle/drafter.py; a test checks it),
and the attention is the same softmax over [causal step-0 keys, the chain's own keys] that the
inference cache holds. Losses (EAGLE-3's): soft cross-entropy against the target's distribution
over the draft vocabulary at the predicted position, weighted 0.8^j for step j, counted where
the predicted token is an output token and the target's top token is in the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from engine.drafters.eagle.head import Eagle3Head
from engine.model.layer import rms_norm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class TTTForward:
    """The head's training forward for one batch; ``rotary`` is the head's rotary embedding."""

    def __init__(self, head: Eagle3Head, embed: torch.nn.Module, rotary: torch.nn.Module):
        self.head, self.embed, self.rotary = head, embed, rotary
        c = head.config
        self.nh, self.kvh, self.hd, self.eps = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.dim,
            c.rms_norm_eps,
        )

    def _cos_sin(self, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.rotary(x, pos)  # [B, S, hd]
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, hd]

    def __call__(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """feats ``[B, S, taps * H]``, tokens ``[B, S]``; returns the draft-vocabulary logits of
        each step ``[B, S, draft_vocab]`` (index p of step j guesses t_{p+2+j}; indices whose
        input token t_{p+1+j} is past the sequence carry garbage)."""
        head, m = self.head, self.head.midlayer
        B, S, _ = feats.shape
        dev = feats.device
        h = head.fc(feats)  # [B, S, H]: step 0's residual stream
        pos0 = torch.arange(S, device=dev).expand(B, S)
        causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()  # [S, S]
        keys0 = vals0 = None
        chain_k: list[torch.Tensor] = []  # steps >= 1: keys / values at each index [B, kvh, S, hd]
        chain_v: list[torch.Tensor] = []
        outs = []
        for j in range(steps):
            ids = F.pad(tokens[:, 1 + j :], (0, 1 + j))  # t_{p+1+j}, zero past the end
            x = torch.cat(
                [
                    rms_norm(self.embed(ids), m.input_layernorm.weight, self.eps),
                    rms_norm(h, m.hidden_norm.weight, self.eps),
                ],
                dim=-1,
            )  # [B, S, 2H]
            a = m.self_attn
            q = a.q_proj(x).view(B, S, self.nh, self.hd).transpose(1, 2)  # [B, nh, S, hd]
            k = a.k_proj(x).view(B, S, self.kvh, self.hd).transpose(1, 2)  # [B, kvh, S, hd]
            v = a.v_proj(x).view(B, S, self.kvh, self.hd).transpose(1, 2)
            cos, sin = self._cos_sin(h, pos0 + j)  # step j sits at position p + j
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if j == 0:
                keys0, vals0 = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            assert keys0 is not None and vals0 is not None
            o = self._attend(q, keys0, vals0, chain_k, chain_v, causal)  # [B, S, nh * hd]
            h = h + a.o_proj(o)
            y = rms_norm(h, m.post_attention_layernorm.weight, self.eps)
            mlp = m.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(y)) * mlp.up_proj(y))  # o^j [B, S, H]
            outs.append(rms_norm(h, head.norm.weight, self.eps))
        return outs

    def _attend(self, q, keys0, vals0, chain_k, chain_v, causal) -> torch.Tensor:
        """Softmax over [step-0 keys of positions <= p, the chain's keys at index p]."""
        B, nh, S, hd = q.shape
        g = nh // self.kvh
        qg = q.view(B, self.kvh, g, S, hd)  # heads grouped by their KV head
        scale = hd**-0.5
        s0 = torch.einsum("bkgsd,bktd->bkgst", qg, keys0).float() * scale  # [B, kvh, g, S, S]
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("bkgsd,bksd->bkgs", qg, kc).float() * scale for kc in chain_k]
        scores = torch.cat([s0] + [d.unsqueeze(-1) for d in diag], dim=-1)  # [..., S + j]
        w = scores.softmax(-1).to(q.dtype)
        out = torch.einsum("bkgst,bktd->bkgsd", w[..., :S], vals0)
        for i, vc in enumerate(chain_v):
            out = out + w[..., S + i].unsqueeze(-1) * vc.unsqueeze(2)
        return out.reshape(B, nh, S, hd).transpose(1, 2).reshape(B, S, nh * hd)


def step_predictions(
    lm_head: torch.nn.Module, outs: list[torch.Tensor], predict: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each draft step j of ``outs`` that has a counted position: ``(j, mask, logits)``.
    Index p of step j guesses t_{p+2+j}, what the target predicts at position p + 1 + j, so
    ``mask`` ``[B, S - 1 - j]`` is ``predict[:, 1 + j:]`` (index the target's tensors at
    ``[:, 1 + j:][mask]``) and ``logits`` ``[N, draft_vocab]`` (float32) are the head's at those
    indices: its LM head runs only where they count."""
    S = predict.shape[1]
    for j, out in enumerate(outs):
        shift = 1 + j
        mask = predict[:, shift:]  # [B, S - shift]
        if bool(mask.any()):
            yield j, mask, lm_head(out[:, : S - shift][mask]).float()


def ttt_loss(
    lm_head: torch.nn.Module,
    outs: list[torch.Tensor],
    target_logits: torch.Tensor,
    predict: torch.Tensor,
    decay: float = 0.8,
    hard: bool = False,
) -> tuple[torch.Tensor, list[float], list[float]]:
    """EAGLE-3's loss over the step outputs ``outs`` of :class:`TTTForward`. ``target_logits``
    ``[B, S, draft_vocab]``: the target's logits at each position over the draft vocabulary
    (position q predicts t_{q+1}); ``predict`` ``[B, S]`` bool: t_{q+1} is an output token worth
    learning (an assistant token, and the target's top token is in the draft vocabulary).
    ``hard``: cross-entropy against the target's top token instead of its distribution (the
    ablation of the soft labels). Returns (loss, per-step CE, per-step top-1 agreement with the
    target)."""
    total = outs[0].new_zeros((), dtype=torch.float32)
    ces, accs = [], []
    target_p = target_logits.float().softmax(-1)  # [B, S, Vd], shared by every step
    for j, mask, pred in step_predictions(lm_head, outs, predict):
        tgt = target_p[:, 1 + j :][mask]  # [N, Vd]
        if hard:
            ce = F.cross_entropy(pred, tgt.argmax(-1))
        else:
            ce = -(tgt * pred.log_softmax(-1)).sum(-1).mean()
        acc = (pred.argmax(-1) == tgt.argmax(-1)).float().mean()
        total = total + decay**j * ce
        ces.append(float(ce.detach()))
        accs.append(float(acc))
    return total, ces, accs
