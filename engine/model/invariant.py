"""The batch-invariant forward of deterministic mode.

Invariant: a token's hidden states, K/V and logits are computed by the same arithmetic, in the
same order, whatever else the forward holds: how many rows, how many query tokens per row (a
1-token decode step, a K+1-token verify, a prefill chunk of any size), which slots. So greedy
output, and seeded output at K = 0, are the same with speculation on or off and at any batch
composition, in bf16 as in fp32 (:func:`check` proves it on the model's own weights at start-up).

Why the eager forward is not: a matmul's kernel, and with it the order in which a row's sums
are accumulated, depends on the number of rows (a 1-row GEMV against a blocked GEMM; the rows of
a partial micro-tile), and SDPA tiles its reductions by the query length. Here:

  * rows: a forward's tokens are flattened to ``[tokens, hidden]`` and padded to a multiple of
    ``TILE`` rows with idle tokens; every matmul (Q/K/V, O, gate/up, down, the LM head) runs on
    ``TILE``-row blocks, one call each, so every call has the same shape; norms, RoPE and
    activations act per row on those blocks' rows.
  * attention: each token attends on its own, in float32, over keys ``[0, L)`` of its slot with
    ``L`` its position + 1 rounded up to a multiple of ``SPAN`` (a function of the position
    alone) and the keys past its position masked (weight exactly 0): a ``[group, head_dim] @
    [head_dim, L]`` and a ``[group, L] @ [L, head_dim]`` product per token and KV head, batched
    over the tokens with the same ``L``.

The cost: a decode step of a few tokens runs ``TILE`` rows, each prefill chunk ``TILE``-row
blocks, and attention gathers each token's keys (``loadtest/bench/deterministic.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from engine.model.layer import linear, project_gate_up, project_qkv, rms_norm, rotate_half

if TYPE_CHECKING:
    from engine.model.stack import Stack

TILE = 8  # rows per matmul call (16 made a CPU decode step slower: docs/measurements.md)
SPAN = 64  # attention lengths are multiples of this


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``x`` ``[rows, ...]`` (rows a multiple of TILE) one TILE-row block a call."""
    return torch.cat([fn(x[i : i + TILE]) for i in range(0, x.shape[0], TILE)])


def tiled_n(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], x: torch.Tensor) -> list:
    """:func:`tiled` for an ``fn`` that returns several tensors."""
    parts = [fn(x[i : i + TILE]) for i in range(0, x.shape[0], TILE)]
    return [torch.cat(p) for p in zip(*parts)]


def forward(
    runner: Stack,
    ids: torch.Tensor,  # [batch, q] long
    slots: list[int],
    starts: list[int],
    counts: list[int],
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`ModelRunner.forward` computed batch-invariantly (same arguments and results;
    ``mode`` is its ``logits``, or ``"hidden"``: :meth:`ModelRunner.hidden`'s states): the
    logits or states, and the tapped inputs."""
    dev, (batch, q) = runner.device, ids.shape
    rows = [(b, j) for b in range(batch) for j in range(counts[b])]  # the real tokens
    n = len(rows)
    padded = -(-n // TILE) * TILE
    b_idx = torch.tensor([b for b, _ in rows], device=dev)
    j_idx = torch.tensor([j for _, j in rows], device=dev)
    pos = [starts[b] + j for b, j in rows] + [0] * (padded - n)  # idle tokens: position 0
    slot = [slots[b] for b, _ in rows] + [slots[0]] * (padded - n)
    tok = torch.zeros(padded, dtype=torch.long, device=dev)
    tok[:n] = ids[b_idx, j_idx]
    assert runner.embed is not None, "a language model's stack (tokens in)"
    h = runner.embed(tok)  # [tokens, hidden]
    pos_t, slot_t = torch.tensor(pos, device=dev), torch.tensor(slot, device=dev)
    cos, sin = runner.rotary(h[None], pos_t[None])  # [1, tokens, head_dim]
    cos, sin = cos[0, :, None], sin[0, :, None]  # [tokens, 1, head_dim]
    groups = _length_groups(pos, runner.cache.columns, dev)
    taps = []
    for i, w in enumerate(runner.weights):
        if i in runner.taps:
            taps.append(h)
        h = _layer(runner, i, w, h, cos, sin, pos_t, slot_t, n=n, groups=groups)
    h = tiled(runner.norm, h)
    tapped = _unflatten(torch.cat(taps, -1), b_idx, j_idx, batch, q) if taps else None
    if mode == "hidden":
        return _unflatten(h, b_idx, j_idx, batch, q), tapped  # [batch, q, hidden]
    if mode == "last":
        ends = torch.tensor(counts, device=dev).cumsum(0) - 1  # each row's last token
        last = torch.zeros(-(-batch // TILE) * TILE, h.shape[-1], dtype=h.dtype, device=dev)
        last[:batch] = h[ends]
        return tiled(runner.logits, last)[:batch], tapped  # [batch, vocab]
    return _unflatten(tiled(runner.logits, h), b_idx, j_idx, batch, q), tapped  # [batch, q, vocab]


def _layer(runner, i, w, h, cos, sin, pos_t, slot_t, *, n, groups) -> torch.Tensor:
    """One decoder layer over ``h`` ``[tokens, hidden]``; K/V of the ``n`` real tokens written."""
    sh = runner.shape
    nh, kvh, hd = sh.num_heads, sh.kv_heads, sh.head_dim
    x = tiled(lambda t: rms_norm(t, w.input_norm, sh.eps), h)
    qs, ks, vs = (t.view(t.shape[0], -1, hd) for t in tiled_n(lambda t: project_qkv(t, w, sh), x))
    # [tokens, heads or kv_heads, head_dim]
    if w.q_norm is not None and w.k_norm is not None:  # qwen3
        qs = tiled(lambda t: rms_norm(t, w.q_norm, sh.eps), qs)
        ks = tiled(lambda t: rms_norm(t, w.k_norm, sh.eps), ks)
    qs = qs * cos + rotate_half(qs) * sin
    ks = ks * cos + rotate_half(ks) * sin
    cache = runner.cache
    kc, vc = cache.k[i], cache.v[i]  # the layer's cache (slots, or a paged pool)
    cache.scatter(kc, slot_t[:n], pos_t[:n], ks[:n])
    cache.scatter(vc, slot_t[:n], pos_t[:n], vs[:n])
    o = torch.empty(h.shape[0], nh * hd, dtype=h.dtype, device=h.device)  # [tokens, heads*hd]
    for length, idx in groups:
        k = cache.span(kc, slot_t[idx], length).float()  # [g, kv_heads, L, head_dim]
        v = cache.span(vc, slot_t[idx], length).float()
        qg = qs[idx].float().view(len(idx), kvh, nh // kvh, hd)  # [g, kv_heads, group, hd]
        s = (qg @ k.transpose(-1, -2)) * hd**-0.5  # [g, kv_heads, group, L]
        past = torch.arange(length, device=h.device) > pos_t[idx][:, None]  # [g, L]
        s = s.masked_fill(past[:, None, None], float("-inf"))
        o[idx] = (torch.softmax(s, -1) @ v).view(len(idx), nh * hd).to(h.dtype)
    h = h + tiled(lambda t: linear(t, w.o), o)
    x = tiled(lambda t: rms_norm(t, w.post_norm, sh.eps), h)
    g, u = tiled_n(lambda t: project_gate_up(t, w), x)
    g = F.silu(g) if sh.act == "silu" else ACT2FN[sh.act](g)
    return h + tiled(lambda t: linear(t, w.down), g * u)


def _length_groups(pos: list[int], cap: int, dev) -> list[tuple[int, torch.Tensor]]:
    """Tokens grouped by attention length L = position + 1 rounded up to SPAN (at most the
    cache's columns ``cap``): ``[(L, token indices)]``."""
    by: dict[int, list[int]] = {}
    for t, p in enumerate(pos):
        by.setdefault(min(-(-(p + 1) // SPAN) * SPAN, cap), []).append(t)
    return [(length, torch.tensor(idx, device=dev)) for length, idx in sorted(by.items())]


def _unflatten(x, b_idx, j_idx, batch: int, q: int) -> torch.Tensor:
    """Flat real-token rows of ``x`` ``[tokens, d]`` back to ``[batch, q, d]`` (zeros past a
    row's count)."""
    out = x.new_zeros(batch, q, x.shape[-1])
    out[b_idx, j_idx] = x[: len(b_idx)]
    return out


def check(runner: Stack, probe: int | None = None) -> None:
    """Prove the invariant on this machine's kernels and the model's own weights: the logits of
    ``probe`` tokens (default TILE + 3: one chunk puts a token at every row of a block) fed as
    one chunk, one token a forward beside another row, and two a forward must be bit-identical;
    RuntimeError if not. Needs two free slots; leaves them empty."""
    probe = probe or TILE + 3
    cache = runner.cache
    free = cache.free_slots()[:2]
    if len(free) < 2:
        raise RuntimeError("the deterministic-mode check needs two free KV slots")
    a, b = (cache.allocate(s) for s in free)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, runner.vocab_size, (probe,), generator=g).tolist()
    try:
        one = runner.forward([toks], [a], logits="all", invariant=True)
        whole = one.logits[0]  # [probe, vocab]
        ways = []
        for step in (1, 2):
            pieces = []
            for i in range(0, probe, step):
                cache.commit(a, i)
                rows = [toks[i : i + step], toks[: step + 1]]
                out = runner.forward(rows, [a, b], logits="all", invariant=True).logits
                pieces.append(out[0, : len(toks[i : i + step])])
            ways.append(torch.cat(pieces))
    finally:
        cache.free(a)
        cache.free(b)
    for step, got in zip((1, 2), ways):
        if not torch.equal(got, whole):
            diff = (got.float() - whole.float()).abs().max().item()
            raise RuntimeError(
                f"deterministic mode: logits fed {step} token(s) a forward differ from one chunk "
                f"by up to {diff:.3g} on this machine; its kernels are not batch-invariant"
            )
