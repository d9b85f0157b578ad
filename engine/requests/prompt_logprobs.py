"""The prompt's own log-probabilities (``SamplingParams.prompt_logprobs``), as OpenAI's
``echo`` + ``logprobs`` return them: for every prompt token after the first, its log-probability
under the model given the tokens before it, and the top alternatives. They come from the
prefill's logits at every position (the raw model: no temperature, penalties or top-k / top-p),
read to the host once per scored chunk; requests that do not ask cost nothing.
"""

from __future__ import annotations

import torch

from engine.records.sequence import PromptLogprob, Sequence
from engine.transfer import to_device


def add_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """Extend ``seq.prompt_logprobs`` with a prefill chunk's: ``logits`` [chunk, vocab] at prompt
    positions start .. start + chunk - 1 (position i predicts prompt token i + 1)."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first prompt token has no context to be scored on
    nxt = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]  # the tokens they predict
    if not nxt:
        return  # the chunk ends the prompt: its last position predicts the first output token
    top_n = seq.params.prompt_logprobs or 0
    lp = torch.log_softmax(logits[: len(nxt)].float(), dim=-1)  # [n, vocab]
    ids = to_device(nxt, torch.long, lp.device)
    chosen = lp.gather(-1, ids[:, None]).squeeze(-1)  # [n]
    rank = (lp > chosen[:, None]).sum(-1) + 1  # [n] (exact in float64 below: rank < 2^53)
    top = lp.topk(max(top_n, 1), dim=-1)  # [n, top]
    packed = torch.cat(
        [
            chosen[:, None].double(),
            rank[:, None].double(),
            top.values.double(),
            top.indices.double(),
        ],
        1,
    ).tolist()
    for row in packed:  # (one host read for the chunk)
        k = (len(row) - 2) // 2
        alts = [(int(i), v) for v, i in zip(row[2 : 2 + k], row[2 + k :])][:top_n]
        seq.prompt_logprobs.append(PromptLogprob(row[0], alts, int(row[1])))
