"""The EAGLE-3 drafter: a one-layer head over the target's own features (engine/eagle_head.py).

State per slot:
  * the head's KV cache (one layer): positions ``[0, real)`` hold K/V computed from the target's
    features ("real" positions); drafting writes further positions, dropped at commit;
  * ``pending``: the target features of positions ``[real, real + len(pending))`` that the head
    has not taken in yet, each waiting to be paired with the token after it.

Bookkeeping (N = the sequence's token count; the target has computed features for positions
``[0, N - 1)`` plus the verified ones):
  * ``observe`` (after every target forward: prefill chunks, verifies) appends the features of
    the positions that forward computed, ``[start, start + count)``, to ``pending``.
  * ``add`` (prompt prefilled) takes in positions ``[0, P - 1)`` of a prompt of P tokens.
  * ``propose`` first takes in every pending position p, paired with t_{p+1} (one ragged
    forward; its last output gives d_1), then drafts d_2..d_K by feeding its own output and
    the previous draft at the next position. d_K is never fed.
  * ``commit`` rolls the cache back to ``real`` and keeps only the pending features of
    positions < N - 1 (the accepted ones: a verify's rejected positions are dropped).
Invariant after ``commit``: ``real + len(pending) == N - 1``, so the next verify (which starts
at position N - 1) continues ``pending`` without a gap; ``observe`` checks it.
"""

from __future__ import annotations

import torch

from ..eagle_head import Eagle3Head
from ..grammar import DraftGrammar
from ..kv_cache import SlotKVCache
from ..layer import LayerShape, decoder_layer, rms_norm
from ..layer_weights import from_layer
from ..plan import RoundPlan, to_device
from ..sampling import logits_to_probs
from ..sequence import Sequence
from .base import DrafterBase, Proposal


class EagleDrafter(DrafterBase):
    name = "eagle3"
    samples = True

    def __init__(
        self, head: Eagle3Head, embed: torch.nn.Module, num_slots: int, max_len: int, vocab: int
    ):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        c = head.config
        self.head, self.vocab_size = head.eval(), vocab
        self.embed = head.embed_tokens if head.embed_tokens is not None else embed
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.taps = c.aux_layers
        self.cache = SlotKVCache(
            1, num_slots, c.num_key_value_heads, c.dim, max_len, p.dtype, p.device
        )
        self.weights = from_layer(head.midlayer)
        self.shape = LayerShape(
            c.num_attention_heads, c.num_key_value_heads, c.dim, c.rms_norm_eps, c.hidden_act
        )
        self.rotary = LlamaRotaryEmbedding(config=c.llama_config()).to(p.device)
        self.draft_ids = head.draft_to_target  # [draft_vocab] target id of each draft id
        self.pending: dict[int, list[torch.Tensor]] = {}  # slot -> [n, taps * hidden] pieces
        self.pending_n: dict[int, int] = {}
        self.real: dict[int, int] = {}  # slot -> cache positions computed from real features

    # -- life cycle ---------------------------------------------------------------------------
    def observe(
        self, seqs: list[Sequence], hidden: torch.Tensor, starts: list[int], counts: list[int]
    ) -> None:
        """``hidden`` ``[batch, q, taps * hidden]``: the target's features of positions
        ``[starts[b], starts[b] + counts[b])`` of row b."""
        for b, (s, start, n) in enumerate(zip(seqs, starts, counts)):
            if not s.spec.enabled:
                continue
            if start == 0:  # a new prompt in this slot
                self.pending[s.slot], self.pending_n[s.slot] = [], 0
                self.real[s.slot] = 0
            elif self.real[s.slot] + self.pending_n[s.slot] != start:
                raise ValueError("EAGLE features out of step with the sequence")
            self.pending[s.slot].append(hidden[b, :n])
            self.pending_n[s.slot] += n

    def add(self, seqs: list[Sequence]) -> None:
        rows = [s for s in seqs if s.spec.enabled]
        for s in rows:
            self.cache.allocate(s.slot)
            if self.pending_n.get(s.slot) != len(s.prompt_ids):
                raise ValueError("EAGLE head: the prompt's features are missing")
        take = [len(s.prompt_ids) - 1 for s in rows]
        if any(take):
            self._ingest([s for s, n in zip(rows, take) if n], [n for n in take if n])

    def fork(self, src: Sequence, dst: Sequence) -> None:
        if dst.spec.enabled and src.slot in self.pending:  # the prompt's features, shared
            self.pending[dst.slot] = list(self.pending[src.slot])
            self.pending_n[dst.slot] = self.pending_n[src.slot]
            self.real[dst.slot] = self.real[src.slot]

    def remove(self, seq: Sequence) -> None:
        self.cache.free(seq.slot)
        for d in (self.pending, self.pending_n, self.real):
            d.pop(seq.slot, None)

    def commit(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            slot, real = s.slot, self.real[s.slot]
            self.cache.rollback(slot, real)  # drop the drafted chain's K/V
            keep = s.num_tokens - 1 - real
            if keep < self.pending_n[slot]:
                self.pending[slot] = [torch.cat(self.pending[slot])[:keep]]
                self.pending_n[slot] = keep

    # -- drafting -----------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        ks, noise, dev = plan.ks, plan.draft_noise, self.device
        kmax = max(ks)
        tokens = torch.zeros(len(seqs), kmax, dtype=torch.long, device=dev)  # [batch, K]
        probs = torch.zeros(len(seqs), kmax, self.vocab_size, device=dev)  # [batch, K, vocab]
        rows = [b for b, k in enumerate(ks) if k > 0]
        if not rows:
            return Proposal(tokens, list(ks), probs)
        idx = to_device(rows, torch.long, dev)
        temp, top_k, top_p, greedy = (
            plan.temperature[idx],
            plan.top_k[idx],
            plan.top_p[idx],
            plan.greedy[idx],
        )
        # take in every pending position; the last one's output drafts d_1
        out = self._ingest([seqs[b] for b in rows], [self.pending_n[seqs[b].slot] for b in rows])
        tok = tokens[:0, 0]
        guide = DraftGrammar(seqs)
        for j in range(kmax):
            active = [i for i, b in enumerate(rows) if ks[b] > j]
            if len(active) < len(rows):  # rows whose K is reached leave the draft batch
                rows = [rows[i] for i in active]
                a = to_device(active, torch.long, dev)
                temp, top_k, top_p, greedy = temp[a], top_k[a], top_p[a], greedy[a]
                out, tok = out[a], tok[a]
            slots = [seqs[b].slot for b in rows]
            if j > 0:  # feed (own output, previous draft) at the next position
                starts = [self.cache.lengths[s] for s in slots]
                out = self._layer(tok[:, None], out[:, None], slots, starts, [1] * len(rows))
                out = out[:, 0]  # [rows, hidden]
                for s, st in zip(slots, starts):
                    self.cache.commit(s, st + 1)
            logits = guide.mask(self._logits(out), rows)  # grammar rows: what it allows next
            q = logits_to_probs(logits[:, None], temp, top_k, top_p, plan.filter_rows)
            q = q[:, 0]  # [rows, vocab], zero outside the draft vocabulary
            row_t = to_device(rows, torch.long, dev)
            if noise is not None:
                sampled = (q / noise[row_t, j]).argmax(-1)
                tok = torch.where(greedy, q.argmax(-1), sampled)
            else:
                tok = q.argmax(-1)
            tokens[row_t, j] = tok
            probs[row_t, j] = q
            if guide:
                guide.took(tok.tolist(), rows)
        guide.close()
        return Proposal(tokens, list(ks), probs)

    # -- the head -----------------------------------------------------------------------------
    @torch.inference_mode()
    def _ingest(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
        """Take in the first ``counts[b]`` pending positions p of row b, each paired with token
        t_{p+1}; returns the head's output at each row's last one ``[rows, hidden]``."""
        slots = [s.slot for s in seqs]
        starts = [self.cache.lengths[s] for s in slots]
        q = max(counts)
        feats = torch.zeros(
            len(seqs), q, self.head.fc.in_features, dtype=self.dtype, device=self.device
        )  # [rows, q, taps * hidden]
        ids = []
        for b, (s, st, n) in enumerate(zip(seqs, starts, counts)):
            pend = torch.cat(self.pending[s.slot])
            feats[b, :n] = pend[:n]
            self.pending[s.slot], self.pending_n[s.slot] = [pend[n:]], len(pend) - n
            nxt = s.token_array()[st + 1 : st + 1 + n].tolist()
            ids.append(nxt + [0] * (q - n))
        ids_t = torch.tensor(ids, device=self.device)  # [rows, q]
        out = self._layer(ids_t, self.head.fc(feats), slots, starts, counts)  # [rows, q, hidden]
        for slot, st, n in zip(slots, starts, counts):
            self.cache.commit(slot, st + n)
            self.real[slot] = st + n
        last = torch.tensor([n - 1 for n in counts], device=self.device)
        return out[torch.arange(len(seqs), device=self.device), last]

    @torch.inference_mode()
    def _layer(
        self,
        ids: torch.Tensor,
        g: torch.Tensor,
        slots: list[int],
        starts: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """The head's layer over tokens ``ids`` ``[rows, q]`` and fused features ``g``
        ``[rows, q, hidden]`` at positions ``starts[b]..``; returns its output before the final
        norm ``[rows, q, hidden]``; K/V written to the head's cache."""
        w, eps, dev = self.weights, self.shape.eps, self.device
        hidden_norm = self.head.midlayer.hidden_norm.weight
        x = torch.cat(
            [rms_norm(self.embed(ids), w.input_norm, eps), rms_norm(g, hidden_norm, eps)], dim=-1
        )  # [rows, q, 2 hidden]
        pos, write_pos = self.cache.positions(starts, counts, ids.shape[1])  # [rows, q]
        pos, write_pos = pos.to(dev), write_pos.to(dev)
        cos, sin = self.rotary(g, pos)
        kv_len = max(st + n for st, n in zip(starts, counts))
        kv_idx = torch.arange(kv_len, device=dev)
        mask = (kv_idx[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [rows, 1, q, kv_len]
        slot_t = torch.tensor(slots, device=dev)
        c = self.cache
        return decoder_layer(
            g, w, cos.unsqueeze(1), sin.unsqueeze(1), mask, c.k[0], c.v[0], slot_t, write_pos,
            None, self.shape, x,
        )  # fmt: skip

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the target vocabulary ``[rows, vocab]`` (-inf outside the draft
        vocabulary) of head outputs ``[rows, hidden]``."""
        c = self.head.config
        draft = self.head.lm_head(rms_norm(out, self.head.norm.weight, c.rms_norm_eps)).float()
        full = draft.new_full((out.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_ids] = draft
        return full
