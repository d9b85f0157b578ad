"""The speculative engine: one ``step()`` = admit + prefill new sequences, then one round.

A round, for every running sequence at once, reads top to bottom:
  1. plan     -- the one loop over the batch (:meth:`SpecEngine._plan`): each row's K (capped by
                 its remaining tokens and the context), its sampling params, and its random draws
                 from its own seeded generator. The drafter reuses this plan.
  2. propose  -- the drafter proposes up to K_i tokens per row (ragged).
  3. verify   -- one target forward over [last token, d_1..d_K_i] of every row.
  4. accept   -- :func:`rejection_sample` (terms: accepted, recovered, bonus; see rejection.py);
                 the one device->host sync of the round reads its result.
  5. commit   -- append the emitted tokens (cut at EOS / stop ids / max_tokens / context), commit
                 the target cache to ``len(tokens) - 1`` and let the drafter roll its cache back.
Invariant between rounds: the target cache of a running sequence holds every token but the last
one, which is fed as the first verify token of the next round.

K_i comes from the engine's controller (k_control.py): ``k_for`` in the plan loop, ``observe`` in
the commit loop, and ``end_round`` with the round's measured times, where the adaptive controller
picks the next round's K by expected goodput.

Drafter faults never cost a token: an exception in the drafter (``add``, ``propose``, ``commit``,
``remove``) or a malformed proposal turns that round into a plain round (K = 0) for its rows, and
those rows decode plainly (no drafting) for the rest of their life, so their output is still
exactly the target's. Each fault adds one to ``drafter_failures`` (a metric reads it).

The random draws of a row depend only on its own K in that round (never on the batch), so a
seeded request reproduces whatever else runs beside it, as long as its K sequence is the same.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .drafters.base import Drafter
from .k_control import AdaptiveK, FixedK, KController
from .model_runner import ModelRunner
from .rejection import rejection_sample
from .sampling import SamplingParams, logits_to_probs
from .sequence import RoundStats, Sequence, SpecParams, Status

log = logging.getLogger("specd.engine")


@dataclass
class RoundPlan:
    """What the plan phase decided for every row of one round (device tensors are [batch, ...])."""

    ks: list[int]  # K_i asked of the drafter
    temperature: torch.Tensor  # [batch] float, 1.0 for greedy rows
    top_k: torch.Tensor  # [batch] long, 0 = off
    top_p: torch.Tensor  # [batch] float
    greedy: torch.Tensor  # [batch] bool
    last: torch.Tensor  # [batch, 1] long: the last emitted token, first verify input
    draft_noise: torch.Tensor | None  # [batch, K, vocab] Exp(1), for sampling drafters
    uniforms: torch.Tensor  # [batch, K] acceptance draws
    noise: torch.Tensor  # [batch, vocab] Exp(1), for the recovered / bonus sample

    @property
    def num_zero(self) -> torch.Tensor:
        return torch.zeros_like(self.greedy, dtype=torch.long)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: RoundStats | None = None  # None for the token sampled from the prefill
    seq: Sequence | None = field(default=None, repr=False)
    # target log-probabilities (after temperature / top-k / top-p) of each new token, and the
    # top-n alternatives as (token id, logprob), when the request asked for logprobs
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    passes: int = 1  # target passes this output covers (more when a reader's buffer merged outputs)


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of what the engine holds (read by the worker for metrics and admission)."""

    running: int  # sequences holding a KV slot (prefilling or decoding)
    waiting: int  # sequences queued for a slot
    kv_used_tokens: int
    kv_free_slots: int
    kv_slots: int
    drafter_failures: int


class SpecEngine:
    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        eos_token_ids: list[int],
        max_prefill_per_step: int = 4,
        prefill_chunk_tokens: int = 512,
        controller: KController | None = None,
        k_max: int = 8,
    ):
        self.target, self.drafter = target, drafter
        self.k_max = k_max if drafter is not None else 0
        if controller is None:
            controller = AdaptiveK(k_max, drafter.steps) if drafter is not None else FixedK(0)
        self.controller = controller
        if getattr(controller, "cost", None) is not None:  # AdaptiveK prices padded verify shapes
            controller.cost.shape = target.padded_shape
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_prefill_per_step = max_prefill_per_step  # sequences prefilling at once
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)  # prompt tokens per step
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # holding a slot, prompt not fully in the cache
        self.running: list[Sequence] = []
        self.device = target.device
        self.vocab_size = target.vocab_size
        self.drafter_failures = 0  # drafter exceptions / bad proposals (each fell back to K = 0)
        # the round's acceptance rule; only loadtest/bench_synthetic.py swaps it (a synthetic
        # acceptance rate, not lossless), and the worker refuses to serve an engine where it did
        self.accept = rejection_sample

    # -- what the worker reads (engine/worker.py's Engine protocol) ---------------------------
    @property
    def lossless(self) -> bool:
        """True unless a benchmark swapped the acceptance rule (the worker refuses to serve it)."""
        return self.accept is rejection_sample

    @property
    def num_slots(self) -> int:
        """Sequences that can hold a KV slot at once."""
        return self.target.cache.num_slots

    def load(self) -> EngineLoad:
        cache = self.target.cache
        return EngineLoad(
            running=len(self.running) + len(self.prefilling),
            waiting=len(self.waiting),
            kv_used_tokens=cache.used_tokens(),
            kv_free_slots=cache.num_free(),
            kv_slots=cache.num_slots,
            drafter_failures=self.drafter_failures,
        )

    def held_ids(self) -> list[str]:
        """Request ids of the sequences holding a slot (prefilling or running)."""
        return [s.request_id for s in (*self.running, *self.prefilling)]

    def waiting_ids(self) -> list[str]:
        """Request ids of the sequences queued for a slot."""
        return [s.request_id for s in self.waiting]

    def runners(self) -> list[ModelRunner]:
        """The target's runner, then the draft model's when the drafter has one."""
        draft = getattr(self.drafter, "runner", None)
        return [self.target] + ([draft] if draft is not None else [])

    def needs_warm_up(self) -> bool:
        return any(r.fast is not None for r in self.runners())

    def warm_up(self) -> None:
        """Compile and run every shape of the fast forward path (engine/fast_forward.py) of the
        target and the draft model, if they have one. The worker calls it before it is ready."""
        from .fast_forward import warm_up

        for runner in self.runners():
            warm_up(runner)

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams | None = None,
    ) -> Sequence:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.target.max_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context "
                f"({self.target.max_len} tokens)"
            )
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError("prompt token id outside the vocabulary")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        seq = Sequence(
            request_id,
            list(prompt_ids),
            params,
            spec or SpecParams(),
            gen,
            arrival=time.perf_counter(),
        )
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                return True
        for group in (self.prefilling, self.running):
            for seq in group:
                if seq.request_id == request_id:
                    self._finish(seq, "abort")
                    group.remove(seq)
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        spec: SpecParams | list[SpecParams] | None = None,
        on_step=None,
    ) -> list[Sequence]:
        """Run ``prompts`` together to completion (tests, benchmarks, the CLI demo)."""
        n = len(prompts)
        params = params if isinstance(params, list) else [params] * n
        spec = spec if isinstance(spec, list) else [spec or SpecParams()] * n
        seqs = [
            self.add_request(f"gen-{i}", p, sp, s)
            for i, (p, sp, s) in enumerate(zip(prompts, params, spec))
        ]
        while self.has_work():
            outs = self.step()
            if on_step:
                on_step(outs)
        return seqs

    # -- one engine step --------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if (
            not self.controller.calibrated
            and self.target.cache.num_free()
            and any(s.spec.enabled and s.spec.k is None for s in self.waiting)
        ):
            # once, before the first request the controller decides for: time forwards on free slots
            self.controller.calibrate(
                self.target, getattr(self.drafter, "runner", None), self.target.cache.free_slots()
            )
        outputs = self._admit()
        if self.running:
            outputs += self._round(self.running)
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return outputs

    def _admit(self) -> list[StepOutput]:
        """Give waiting sequences a slot and prefill prompts, at most ``prefill_chunk_tokens``
        prompt tokens per step (chunked prefill: a long prompt never stalls the running streams
        for more than one chunk's forward). A sequence whose prompt is complete samples its first
        token from the last chunk's logits and joins the running batch."""
        cache = self.target.cache
        while (
            self.waiting and cache.num_free() and len(self.prefilling) < self.max_prefill_per_step
        ):
            seq = self.waiting.popleft()
            seq.slot = cache.allocate()
            seq.status = Status.RUNNING
            seq.admitted = time.perf_counter()
            self.prefilling.append(seq)
        budget = self.prefill_chunk_tokens
        new: list[Sequence] = []
        last_logits = []
        for s in list(self.prefilling):
            if budget <= 0:
                break
            start = cache.lengths[s.slot]
            chunk = s.prompt_ids[start : start + budget]
            logits = self.target.forward([chunk], [s.slot])  # [1, vocab]
            cache.commit(s.slot, start + len(chunk))
            budget -= len(chunk)
            if start + len(chunk) == len(s.prompt_ids):
                self.prefilling.remove(s)
                new.append(s)
                last_logits.append(logits)
        if not new:
            return []
        logits = torch.cat(last_logits)  # [new, vocab]
        if self.drafter is not None:
            self._drafter_call("add", new, new)
        plan = self._plan(new, with_k=False)
        probs = logits_to_probs(
            logits[:, None], plan.temperature, plan.top_k, plan.top_p
        )  # [new, 1, vocab]
        empty = torch.zeros(len(new), 0, dtype=torch.long, device=self.device)
        num_acc, next_tok = rejection_sample(
            probs, empty, plan.num_zero, None, plan.greedy, plan.uniforms, plan.noise
        )
        host = next_tok.tolist()
        lps = self._logprobs(new, probs, empty, num_acc, next_tok)
        outputs = []
        for b, (s, tok) in enumerate(zip(new, host)):
            s.target_passes += 1
            emitted = self._append(s, [tok])
            outputs.append(self._output(s, emitted, None, lps, b))
        self.running += new
        self.running = [s for s in self.running if s.status is Status.RUNNING]
        return outputs

    def _round(self, seqs: list[Sequence]) -> list[StepOutput]:
        t_start = time.perf_counter()
        # 1. plan: K, sampling params, last token and random draws of every row
        plan = self._plan(seqs, with_k=True)
        # 2. propose
        t0 = time.perf_counter()
        prop = None
        if self.drafter is not None and any(plan.ks):
            drafting = [s for s, k in zip(seqs, plan.ks) if k]
            prop = self._drafter_call("propose", drafting, seqs, plan)
            if prop is not None and not self._well_formed(prop, plan.ks):
                self._draft_fault("propose", drafting, ValueError("malformed proposal"))
                prop = None
        if prop is not None:
            drafts, num_draft, draft_probs = prop.tokens, prop.num, prop.probs
        else:
            drafts = torch.zeros(len(seqs), 0, dtype=torch.long, device=self.device)
            num_draft, draft_probs = [0] * len(seqs), None
        kmax = drafts.shape[1]
        t1 = time.perf_counter()
        # 3. verify: one target pass over [last token, d_1..d_K] per row
        verify_ids = torch.cat([plan.last, drafts], dim=1)  # [batch, K+1]
        logits = self.target.forward(
            verify_ids, [s.slot for s in seqs], counts=[n + 1 for n in num_draft], logits="all"
        )
        probs = logits_to_probs(
            logits, plan.temperature, plan.top_k, plan.top_p
        )  # [batch, K+1, vocab]
        tv = time.perf_counter()  # (on CUDA the verify kernels may still run: they end in 4's sync)
        # 4. accept
        num_t = torch.tensor(num_draft, device=self.device)
        num_acc, next_tok = self.accept(
            probs, drafts, num_t, draft_probs, plan.greedy, plan.uniforms[:, :kmax], plan.noise
        )
        # the one device->host sync of the round
        host = torch.cat([num_acc[:, None], next_tok[:, None], drafts], dim=1).tolist()
        lps = self._logprobs(seqs, probs, drafts, num_acc, next_tok)
        t2 = time.perf_counter()
        # 5. commit / rollback
        outputs = []
        for b, (s, k, nd, row) in enumerate(zip(seqs, plan.ks, num_draft, host)):
            a, tok, drafted = row[0], row[1], row[2 : 2 + row[0]]
            s.drafted += nd
            s.accepted += a
            s.target_passes += 1
            emitted = self._append(s, drafted + [tok])  # commits the target cache
            stats = RoundStats(k, nd, a, len(emitted), t1 - t0, tv - t1, kmax, t2 - tv)
            running = s.status is Status.RUNNING
            self.controller.observe(s, k, stats, self._k_cap(s) if running else None)
            outputs.append(self._output(s, emitted, stats, lps, b))
        if self.drafter is not None:
            live = [s for s in seqs if s.status is Status.RUNNING and s.spec.enabled]
            self._drafter_call("commit", live, live)
        t3 = time.perf_counter()
        steps = self.drafter.steps(kmax) if self.drafter is not None and kmax else 0
        self.controller.end_round(len(seqs), kmax, steps, (t3 - t_start) - (t1 - t0), t1 - t0)
        return outputs

    def _plan(self, seqs: list[Sequence], with_k: bool) -> RoundPlan:
        """The one loop over the batch: each row's K (capped by its remaining tokens and the
        context), its sampling params, and its random draws from its own generator in a fixed
        order: draft noise [K_i, vocab] (sampling drafters), uniforms [K_i], noise [vocab]."""
        B, V, dev = len(seqs), self.vocab_size, self.device
        ks = [self.controller.k_for(s, self._k_cap(s)) if with_k else 0 for s in seqs]
        kmax = max(ks + [0])
        sample_drafts = with_k and self.drafter is not None and self.drafter.samples
        draft_noise = (
            torch.ones(B, kmax, V, device=dev) if sample_drafts else None
        )  # [batch, K, vocab]
        uniforms = torch.zeros(B, kmax, device=dev)  # [batch, K]
        noise = torch.ones(B, V, device=dev)  # [batch, vocab]
        temp, top_k, top_p, greedy, last = [], [], [], [], []
        for b, (s, k) in enumerate(zip(seqs, ks)):
            p = s.params
            temp.append(p.temperature or 1.0)  # greedy rows: probs at temperature 1 (logprobs)
            top_k.append(p.top_k)
            top_p.append(p.top_p)
            greedy.append(p.greedy)
            last.append(s.output_ids[-1] if s.output_ids else 0)
            if p.greedy:
                continue
            g = s.generator
            if draft_noise is not None and k:
                draft_noise[b, :k].exponential_(generator=g)
            if k:
                uniforms[b, :k] = torch.rand(k, generator=g, device=dev)
            noise[b].exponential_(generator=g)
        return RoundPlan(
            ks=ks,
            temperature=torch.tensor(temp, device=dev),
            top_k=torch.tensor(top_k, device=dev),
            top_p=torch.tensor(top_p, device=dev),
            greedy=torch.tensor(greedy, device=dev),
            last=torch.tensor(last, device=dev)[:, None],
            draft_noise=draft_noise,
            uniforms=uniforms,
            noise=noise,
        )

    # -- drafter faults -------------------------------------------------------------------------
    def _drafter_call(self, method: str, rows: list[Sequence], *args):
        """``self.drafter.<method>(*args)``; an exception is a drafter fault for ``rows``."""
        try:
            return getattr(self.drafter, method)(*args)
        except Exception as e:  # noqa: BLE001 -- any drafter failure falls back to plain decoding
            self._draft_fault(method, rows, e)
            return None

    def _draft_fault(self, where: str, rows: list[Sequence], err: Exception) -> None:
        """Count the fault; ``rows`` decode plainly from now on (their output stays exact: the
        target alone decides every token of a K = 0 round)."""
        self.drafter_failures += 1
        log.error(
            "drafter %s failed in %s (%s: %s); %d request(s) fall back to plain decoding",
            getattr(self.drafter, "name", "?"),
            where,
            type(err).__name__,
            err,
            len(rows),
        )
        for s in rows:
            s.spec = SpecParams(enabled=False, k=0, k_max=0)

    @staticmethod
    def _well_formed(prop, ks: list[int]) -> bool:
        """Host-side shape checks of a proposal (no device sync)."""
        b = len(ks)
        t = prop.tokens
        return (
            t.dim() == 2
            and t.shape[0] == b
            and len(prop.num) == b
            and all(0 <= n <= k for n, k in zip(prop.num, ks))
            and t.shape[1] >= max(prop.num)
            and t.shape[1] <= max(ks)
            and (prop.probs is None or tuple(prop.probs.shape[:2]) == tuple(t.shape))
        )

    # -- helpers ----------------------------------------------------------------------------
    def _output(self, s: Sequence, emitted: list[int], stats: RoundStats | None, lps, b: int):
        out = StepOutput(
            s.request_id, emitted, s.status is Status.FINISHED, s.finish_reason, stats, s
        )
        if lps is not None and s.params.logprobs is not None:
            chosen, top_ids, top_lp = lps
            n = len(emitted)
            out.logprobs = chosen[b][:n]
            k = s.params.logprobs
            out.top_logprobs = [list(zip(top_ids[b][j][:k], top_lp[b][j][:k])) for j in range(n)]
        return out

    def _logprobs(self, seqs, probs, drafts, num_acc, next_tok):
        """Log-probs of the emitted tokens at every verified position (only when some row asked;
        read after the round's sync). Returns host lists (chosen [batch][K+1], top ids/values
        [batch][K+1][n]) or None."""
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if not want:
            return None
        B, k1, _ = probs.shape
        rows = torch.arange(B, device=self.device)
        ids = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.long, device=self.device)], 1)
        ids[rows, num_acc] = next_tok  # [batch, K+1]: the emitted token at each position
        logp = torch.log(probs).clamp_min(-9999.0)  # [batch, K+1, vocab]; -inf -> -9999 for JSON
        chosen = logp.gather(-1, ids[..., None]).squeeze(-1)  # [batch, K+1]
        top = logp.topk(max(max(want), 1), dim=-1)  # [batch, K+1, n]
        return chosen.tolist(), top.indices.tolist(), top.values.tolist()

    def _k_cap(self, s: Sequence) -> int:
        """The most a row may draft: its k_max, and never past max_tokens (a round emits at most
        K+1) or the context."""
        if self.drafter is None or not s.spec.enabled:
            return 0
        k_max = min(s.spec.k_max, self.k_max) if s.spec.k_max is not None else self.k_max
        return max(0, min(k_max, s.remaining - 1, self.target.max_len - s.num_tokens))

    def _append(self, s: Sequence, tokens: list[int]) -> list[int]:
        """Append ``tokens`` up to the first stop condition; finish the sequence if one hit."""
        stops = set(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            stops.update(self.eos_token_ids)
        limit = min(s.remaining, self.target.max_len - s.num_tokens)
        out, reason = [], None
        for t in tokens:
            out.append(t)
            if t in stops:
                reason = "stop"
                break
            if len(out) >= limit:
                reason = "length"
                break
        s.output_ids += out
        if reason is None and s.num_tokens >= self.target.max_len:
            reason = "length"
        if reason is not None:
            self._finish(s, reason)
        else:
            self.target.cache.commit(s.slot, s.num_tokens - 1)
        return out

    def _finish(self, s: Sequence, reason: str) -> None:
        s.status, s.finish_reason = Status.FINISHED, reason
        if s.slot >= 0:
            if self.drafter is not None:
                self._drafter_call("remove", [s], s)
            self.target.cache.free(s.slot)
            s.slot = -1
