"""specd's Prometheus metrics (``GET /metrics``), and how to read them.

Every series carries the labels ``model`` and ``drafter`` and nothing per request (bounded
cardinality). Counters are exposed with the ``_total`` suffix. Rates belong in PromQL; each metric's
help names its query, and the same queries ship as recording rules in
``deploy/prometheus/rules.yml`` (the dashboard, ``deploy/grafana/``, reads those), and the alerts
on them in ``deploy/prometheus/alerts.yml``.

Speculation (the terms are rejection.py's):
  specd_draft_tokens_total, specd_accepted_tokens_total
      acceptance rate = rate(specd_accepted_tokens_total[1m]) / rate(specd_draft_tokens_total[1m])
  specd_forced_tokens_total
      tokens a grammar forced, drafted for free (engine/drafters/forced.py) and kept
  specd_copied_draft_tokens_total, specd_copied_accepted_tokens_total
      the drafted / accepted tokens of rounds whose draft was copied from text (the n-gram or
      suffix drafter, alone or as the EAGLE-3 head's fallback): the copier's share of drafts =
      rate(specd_copied_draft_tokens_total[1m]) / rate(specd_draft_tokens_total[1m]), its
      acceptance = rate(..._copied_accepted_tokens_total) / rate(..._copied_draft_tokens_total)
  specd_tree_leaves_total, specd_tree_leaf_accepts_total
      a draft tree's leaves (the head's runners-up verified beside its chain,
      engine/round/draft_tree.py) and the rounds whose accepted path ended at one (its token is
      in the accepted counts): leaf yield = rate(..._leaf_accepts_total) / rate(..._leaves_total)
  specd_draft_tokens_by_position_total{position}, specd_accepted_tokens_by_position_total{position}
      acceptance at draft position j = rate(accepted{position="j"}) / rate(draft{position="j"})
  specd_target_passes_total           target forwards per sequence (prefill pass included)
      tokens per target pass =
          rate(specd_output_tokens_total[1m]) / rate(specd_target_passes_total[1m])
  specd_tokens_per_pass               histogram: tokens one sequence got from one target pass
  specd_draft_length                  histogram: K the controller chose, per sequence and round
  specd_round_phase_seconds{phase}    histogram: draft / verify / accept wall time of each round
  specd_drafter_failures_total        drafter exceptions (or malformed proposals); each made its
      requests fall back to plain decoding (output unchanged): increase(...[15m]) > 0 = alert
Serving:
  specd_output_tokens_total, specd_prompt_tokens_total
      output tok/s = rate(specd_output_tokens_total[1m])
  specd_requests_total{endpoint, status}          HTTP requests by final status (499: client left)
  specd_sequences_finished_total{finish_reason}   sequences (choices) by stop / length / abort /
                                                  error
  specd_inter_token_latency_seconds   histogram, per output token: a sequence that receives n
      tokens after a gap g since its previous tokens adds n observations of g / n, so quantiles
      are per token, not per round:
      p95 = histogram_quantile(0.95, sum by (le, model, drafter) (rate(..._bucket[1m])))
  specd_time_to_first_token_seconds   histogram, from the HTTP request to a sequence's first token
  specd_request_latency_seconds       histogram, from the HTTP request to a sequence's last token
  specd_queue_time_seconds            histogram, from the engine taking a sequence to its KV slot
  specd_running_sequences, specd_waiting_sequences, specd_kv_cache_usage_ratio   gauges (the
      last: positions the running sequences hold over the KV budget, kv_cache_tokens)
      also under vLLM's names, label model_name (the gateway's endpoint picker reads those):
      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1)
  specd_preemptions_total   sequences preempted (KV freed, recomputed later; vllm:num_preemptions)
vLLM's names, label model_name, carry the same values on the process (so vLLM's dashboards and
alerts work unchanged; a few counter increments a step): vllm:spec_decode_num_drafts_total,
..._num_draft_tokens_total, ..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total
{position: 0-based}, vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds, vllm:prompt_tokens_total,
vllm:generation_tokens_total, and the gauges and prefix-cache counters above.
Latency buckets reach from 1 ms (GPU decode steps) to seconds (CPU prefill, queueing).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


def _per(unit: int, *counts: int) -> tuple[float, ...]:
    """Bucket bounds in seconds, written as whole ``1/unit`` s (exact: int / int rounds once)."""
    return tuple(c / unit for c in counts)


ITL_BUCKETS = _per(
    1000, 1, 2, 4, 6, 8, 10, 15, 20, 30, 40, 50, 75, 100, 150, 200, 300, 500, 1000, 2000
)
REQUEST_BUCKETS = _per(
    1000, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 20000, 40000, 80000, 160000, 320000
)
PHASE_BUCKETS = _per(
    10000, 2, 5, 10, 20, 50, 100, 200, 350, 500, 750, 1000, 1500, 2500, 5000, 10000, 25000
)
# tokens one engine step computed, prompts and outputs together (vLLM's bounds)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's request_success reasons: an engine error ended the sequence early, as an abort does
VLLM_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "abort"}


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets, up to the context)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Twin:
    """specd's metric and the same value under vLLM's name, updated together (vLLM's
    dashboards and alerts then work on specd unchanged)."""

    def __init__(self, *children):
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class Metrics:
    """All of one server's metrics, in their own registry (so tests and several apps in one
    process do not collide). ``observe_step`` runs in the engine thread after every step;
    ``sequence_clock`` on the asyncio side for every sequence of a request."""

    def __init__(
        self,
        model: str,
        drafter: str,
        k_max: int = 8,
        registry: CollectorRegistry | None = None,
        *,
        served_name: str | None = None,
        max_model_len: int = 1 << 20,
        cache_info: dict[str, str] | None = None,
    ):
        """``model``: the config's name (label ``model``); ``served_name``: the first name
        clients ask for (``--served-model-name``), vLLM's ``model_name`` label, as vLLM labels
        it (the gateway matches it to the model a request names); default ``model``.
        ``max_model_len`` bounds the token-count buckets; ``cache_info``: the labels of
        ``vllm:cache_config_info``."""
        self.registry = r = registry or CollectorRegistry()
        # process_* (CPU seconds, resident memory, open fds, start time), as on vLLM's page
        ProcessCollector(registry=r)
        lab = {"model": model, "drafter": drafter}
        names = list(lab)
        self.k_max = k_max
        model_name = served_name or model

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=r)

        def hist(name, doc, buckets, extra=()):
            return Histogram(name, doc, names + list(extra), buckets=buckets, registry=r)

        self._drafted = counter(
            "specd_draft_tokens",
            "Drafted tokens. Acceptance rate: "
            "rate(specd_accepted_tokens_total[1m]) / rate(specd_draft_tokens_total[1m])",
        )
        self._accepted = counter("specd_accepted_tokens", "Drafted tokens the target accepted.")
        self._forced = counter(
            "specd_forced_tokens",
            "Tokens a grammar forced, verified as free drafts and kept (not in the drafted or "
            "accepted counts).",
        )
        self._copied_drafted = counter(
            "specd_copied_draft_tokens",
            "Drafted tokens copied from text (n-gram, suffix; counted in specd_draft_tokens_total)."
            " The copier's share: rate(specd_copied_draft_tokens_total[1m]) / "
            "rate(specd_draft_tokens_total[1m])",
        )
        self._copied_accepted = counter(
            "specd_copied_accepted_tokens",
            "Accepted tokens of copied drafts (counted in specd_accepted_tokens_total).",
        )
        self._leaves = counter(
            "specd_tree_leaves",
            "Draft-tree leaves verified beside the chains (the head's runners-up).",
        )
        self._leaf_accepts = counter(
            "specd_tree_leaf_accepts",
            "Rounds whose accepted path ended at a draft-tree leaf (its token is counted in "
            "specd_accepted_tokens_total).",
        )
        self._drafted_pos = counter(
            "specd_draft_tokens_by_position",
            "Drafted tokens by draft position (1 = first drafted token).",
            ["position"],
        )
        self._accepted_pos = counter(
            "specd_accepted_tokens_by_position",
            "Accepted tokens by draft position. Acceptance at position j: "
            "rate(accepted{position=j}) / rate(draft{position=j})",
            ["position"],
        )
        self._passes = counter(
            "specd_target_passes",
            "Target forward passes per sequence "
            "(prefill included). Tokens per pass: rate(specd_output_tokens_total[1m]) "
            "/ rate(specd_target_passes_total[1m])",
        )
        self._out = counter(
            "specd_output_tokens",
            "Output tokens. Output tok/s: rate(specd_output_tokens_total[1m])",
        )
        self._prompt = counter("specd_prompt_tokens", "Prompt tokens of every sequence.")

        def vllm_counter(name: str, doc: str, extra=()):
            return Counter(
                f"vllm:{name}", f"{doc} (vLLM's name)", ["model_name", *extra], registry=r
            )

        self._prefix = {  # EngineLoad running total -> its counters, specd's and vLLM's names
            "prefix_queries": (
                counter(
                    "specd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
                ),
                vllm_counter("prefix_cache_queries", "Prefix cache queries, in tokens").labels(
                    model_name
                ),
            ),
            "prefix_hits": (
                counter("specd_prefix_cache_hits", "Prompt tokens restored from the prefix cache."),
                vllm_counter("prefix_cache_hits", "Prefix cache hits, in tokens").labels(
                    model_name
                ),
            ),
            "preemptions": (
                counter("specd_preemptions", "Sequences preempted: KV freed, recomputed later."),
                vllm_counter("num_preemptions", "Cumulative number of preemptions").labels(
                    model_name
                ),
            ),
        }
        self._prefix_seen = {k: 0 for k in self._prefix}  # the engine's totals, as last read
        self._requests = counter(
            "specd_requests",
            "HTTP generation requests by endpoint and final status (499: the client disconnected).",
            ["endpoint", "status"],
        )
        self._finished = counter(
            "specd_sequences_finished",
            "Sequences (choices) by finish reason: stop, length, abort, error.",
            ["finish_reason"],
        )
        self._drafter_failures = counter(
            "specd_drafter_failures",
            "Drafter exceptions or malformed proposals; each made its "
            "requests fall back to plain decoding (output unchanged). "
            "increase(...[15m]) > 0: alert",
        )
        self._tpp = hist(
            "specd_tokens_per_pass",
            "Tokens one sequence got from one target pass.",
            tuple(range(1, k_max + 2)),
        )
        self._k = hist(
            "specd_draft_length",
            "Draft length K chosen per sequence and round.",
            tuple(range(k_max + 1)),
        )
        self._phase = hist(
            "specd_round_phase_seconds",
            "Wall time of each round's phases: draft, "
            "verify (target forward), accept (rejection rule and host sync).",
            PHASE_BUCKETS,
            ["phase"],
        )
        self._itl = hist(
            "specd_inter_token_latency_seconds",
            "Inter-token latency per output token: n tokens received after a gap g add "
            "n observations of g/n, so quantiles are per token, not per round. p95: "
            "histogram_quantile(0.95, sum by (le) "
            "(rate(specd_inter_token_latency_seconds_bucket[1m])))",
            ITL_BUCKETS,
        )
        self._ttft = hist(
            "specd_time_to_first_token_seconds",
            "From the HTTP request to a sequence's first output token.",
            REQUEST_BUCKETS,
        )
        self._e2e = hist(
            "specd_request_latency_seconds",
            "From the HTTP request to a sequence's last output token.",
            REQUEST_BUCKETS,
        )
        self._queue = hist(
            "specd_queue_time_seconds",
            "From the engine taking a sequence to its getting a KV cache slot.",
            REQUEST_BUCKETS,
        )
        self._running = Gauge(
            "specd_running_sequences", "Sequences holding a KV slot.", names, registry=r
        ).labels(**lab)
        self._waiting = Gauge(
            "specd_waiting_sequences", "Sequences waiting for a KV slot.", names, registry=r
        ).labels(**lab)
        self._kv = Gauge(
            "specd_kv_cache_usage_ratio",
            "Share of the KV budget the running sequences hold.",
            names,
            registry=r,
        ).labels(**lab)
        self._path = Gauge(
            "specd_forward_path",
            "1 for the path each component's forward takes now (target, draft, head: eager, "
            "compiled, cuda-graphs, +q4-<kernel>), 0 for a path it took before.",
            names + ["component", "path"],
            registry=r,
        )
        self._paths: dict[str, str] = {}  # component -> its path, as last set

        def vllm(name: str, doc: str):  # the same values under vLLM's names (the InferencePool)
            return Gauge(f"vllm:{name}", f"{doc} (vLLM's name)", ["model_name"], registry=r)

        self._gauges = {  # EngineLoad field -> its gauges
            "running": (self._running, vllm("num_requests_running", "Running").labels(model_name)),
            "waiting": (self._waiting, vllm("num_requests_waiting", "Waiting").labels(model_name)),
        }
        self._kv_gauges = (
            self._kv,
            vllm("kv_cache_usage_perc", "KV cache used, 0..1").labels(model_name),
        )

        def vllm_hist(name: str, doc: str, buckets):
            return Histogram(
                f"vllm:{name}", f"{doc} (vLLM's name)", ["model_name"], buckets=buckets, registry=r
            ).labels(model_name)

        # children with the model/drafter labels bound (the hot path does no label lookups),
        # twinned with vLLM's names where vLLM has the same measure
        self.drafted = _Twin(
            self._drafted.labels(**lab),
            vllm_counter("spec_decode_num_draft_tokens", "Draft tokens").labels(model_name),
        )
        self.accepted = _Twin(
            self._accepted.labels(**lab),
            vllm_counter("spec_decode_num_accepted_tokens", "Accepted tokens").labels(model_name),
        )
        self.drafts = vllm_counter(  # rounds of a sequence that drafted
            "spec_decode_num_drafts", "Sequence rounds that drafted"
        ).labels(model_name)
        self.forced = self._forced.labels(**lab)
        self.copied_drafted = self._copied_drafted.labels(**lab)
        self.copied_accepted = self._copied_accepted.labels(**lab)
        self.leaves = self._leaves.labels(**lab)
        self.leaf_accepts = self._leaf_accepts.labels(**lab)
        self.passes = self._passes.labels(**lab)
        self.output_tokens = _Twin(
            self._out.labels(**lab),
            vllm_counter("generation_tokens", "Generation tokens").labels(model_name),
        )
        self.prompt_tokens = _Twin(
            self._prompt.labels(**lab),
            vllm_counter("prompt_tokens", "Prompt tokens").labels(model_name),
        )
        self.tokens_per_pass, self.draft_length = self._tpp.labels(**lab), self._k.labels(**lab)
        self.itl = _Twin(
            self._itl.labels(**lab),
            vllm_hist("inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS),
        )
        self.ttft = _Twin(
            self._ttft.labels(**lab),
            vllm_hist("time_to_first_token_seconds", "Time to first token", REQUEST_BUCKETS),
        )
        self.e2e = _Twin(
            self._e2e.labels(**lab),
            vllm_hist("e2e_request_latency_seconds", "End-to-end latency", REQUEST_BUCKETS),
        )
        self.queue = _Twin(
            self._queue.labels(**lab),
            vllm_hist("request_queue_time_seconds", "Time queued", REQUEST_BUCKETS),
        )
        self.phase = {p: self._phase.labels(**lab, phase=p) for p in ("draft", "verify", "accept")}
        self.drafted_pos = [
            self._drafted_pos.labels(**lab, position=str(j)) for j in range(1, k_max + 1)
        ]
        accepted_pos = vllm_counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by position", ["position"]
        )
        self.accepted_pos = [  # vLLM counts positions from 0
            _Twin(
                self._accepted_pos.labels(**lab, position=str(j)),
                accepted_pos.labels(model_name, str(j - 1)),
            )
            for j in range(1, k_max + 1)
        ]
        # vLLM's per-request measures, observed when a sequence ends (SequenceClock.done)
        success = vllm_counter(
            "request_success", "Finished requests by finish reason", ["finished_reason"]
        )
        # every reason's series exists from the start (at 0), as on vLLM's page
        self.success = {
            why: success.labels(model_name, why) for why in sorted(set(VLLM_FINISH.values()))
        }
        counts = one_two_five(max_model_len)
        self.request_prompt_tokens = vllm_hist(
            "request_prompt_tokens", "Prompt tokens of a request", counts
        )
        self.request_generation_tokens = vllm_hist(
            "request_generation_tokens", "Generated tokens of a request", counts
        )
        self.request_max_generation_tokens = vllm_hist(  # n choices of one prompt: their longest
            "request_max_num_generation_tokens",
            "Generated tokens of a request's longest choice",
            counts,
        )
        # admitted (KV slot) -> first token -> last token; the queue before is request_queue_time
        self.prefill_time = vllm_hist(
            "request_prefill_time_seconds", "From a KV slot to the first token", REQUEST_BUCKETS
        )
        self.decode_time = vllm_hist(
            "request_decode_time_seconds", "From the first token to the last", REQUEST_BUCKETS
        )
        self.inference_time = vllm_hist(
            "request_inference_time_seconds", "From a KV slot to the last token", REQUEST_BUCKETS
        )
        self.iteration_tokens = vllm_hist(
            "iteration_tokens_total",
            "Tokens of one engine step (prompts + outputs)",
            ITERATION_BUCKETS,
        )
        # an info metric as vLLM writes it: a gauge at 1 whose labels are the KV cache's config
        # (vLLM's labels: no model_name, engine index 0)
        info = {**(cache_info or {}), "engine": "0"}
        Gauge(
            "vllm:cache_config_info", "KV cache configuration (vLLM's name)", list(info), registry=r
        ).labels(**info).set(1)
        # the inference gateway's endpoint picker reads this on every scrape and takes the series
        # with the newest value (a timestamp): no adapters running or waiting, none loadable
        self._lora = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters running and waiting; value: when last set (vLLM's name)",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        ).labels(max_lora="0", waiting_lora_adapters="", running_lora_adapters="")
        self._lora.set_to_current_time()
        self.drafter_failures = self._drafter_failures.labels(**lab)
        self._failures_seen = 0  # the engine's running count, as last read
        self._failures_lock = threading.Lock()  # read from the engine thread and from /metrics
        self._lab = lab

    # -- engine thread ----------------------------------------------------------------------------
    def observe_step(self, outputs, stats: dict) -> None:
        """Counts of one engine step: each output is one target pass of one sequence."""
        if outputs:  # vLLM's step tokens: a prompt counts whole in the step of its first token
            self.iteration_tokens.observe(
                sum(len(o.new_token_ids) for o in outputs)
                + sum(len(o.seq.prompt_ids) for o in outputs if o.stats is None and o.seq)
            )
        round_seen = False
        for out in outputs:
            n = len(out.new_token_ids)
            self.output_tokens.inc(n)
            self.passes.inc()
            self.tokens_per_pass.observe(n)
            st = out.stats
            if st is None:  # the token sampled from the prefill
                continue
            self.draft_length.observe(st.k)
            if st.drafted:
                self.drafts.inc()
            self.drafted.inc(st.drafted)
            self.accepted.inc(st.accepted)
            self.forced.inc(st.forced)
            if st.copied:
                self.copied_drafted.inc(st.drafted)
                self.copied_accepted.inc(st.accepted)
            self.leaves.inc(st.leaves)
            self.leaf_accepts.inc(st.leaf_hit)
            for j in range(min(st.drafted, len(self.drafted_pos))):
                self.drafted_pos[j].inc()
            for j in range(min(st.accepted, len(self.accepted_pos))):
                self.accepted_pos[j].inc()
            if not round_seen:  # phase times are the round's, shared by its rows
                round_seen = True
                self.phase["draft"].observe(st.draft_s)
                self.phase["verify"].observe(st.verify_s)
                self.phase["accept"].observe(st.accept_s)
        self.set_gauges(stats)

    def set_gauges(self, stats: dict) -> None:
        """From :meth:`EngineWorker.stats`."""
        self._lora.set_to_current_time()
        for field, gauges in self._gauges.items():
            for g in gauges:
                g.set(stats.get(field, 0))
        if stats.get("kv_budget_tokens"):  # positions held over the budget, as vLLM's blocks
            for g in self._kv_gauges:
                g.set(min(1.0, stats.get("kv_used_tokens", 0) / stats["kv_budget_tokens"]))
        with self._failures_lock:  # the counters follow the engine's running totals
            for field, (ours, vllms) in self._prefix.items():
                total = stats.get(field, 0)
                if total > self._prefix_seen[field]:
                    for c in (ours.labels(**self._lab), vllms):
                        c.inc(total - self._prefix_seen[field])
                    self._prefix_seen[field] = total
        failures = stats.get("drafter_failures")
        if failures is not None:  # the engine counts; the counter follows its increase
            with self._failures_lock:
                if failures > self._failures_seen:
                    self.drafter_failures.inc(failures - self._failures_seen)
                    self._failures_seen = failures

    def set_forward_paths(self, paths: dict[str, str]) -> None:
        """From :meth:`EngineWorker.forward_paths`, at a scrape: 1 for each component's path now,
        and 0 for the one it took before a change (a fallback stays visible)."""
        for component, path in paths.items():
            before = self._paths.get(component)
            if before != path:
                if before is not None:
                    self._path.labels(**self._lab, component=component, path=before).set(0)
                self._path.labels(**self._lab, component=component, path=path).set(1)
                self._paths[component] = path

    # -- asyncio side ---------------------------------------------------------------------------
    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(**self._lab, endpoint=endpoint, status=str(status)).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(**self._lab, finish_reason=reason).inc()

    def sequence_clock(self, started: float, prompt_tokens: int = 0) -> SequenceClock:
        return SequenceClock(self, started, prompt_tokens)


class SequenceClock:
    """Latencies and token counts of one sequence as the server sees its outputs arrive."""

    def __init__(self, metrics: Metrics, started: float, prompt_tokens: int = 0):
        self.m, self.started, self.prompt_tokens = metrics, started, prompt_tokens
        self.first: float | None = None
        self.last: float | None = None
        self.admitted: float | None = None  # when it got the KV slot its first token came from
        self.generated = 0  # output tokens received

    def tokens(self, n: int, seq=None) -> None:
        if n <= 0:
            return
        self.generated += n
        now = time.perf_counter()  # the engine's clock too (Sequence.arrival, .admitted)
        if self.last is None:
            self.first = now
            self.m.ttft.observe(now - self.started)
            if seq is not None and seq.admitted is not None:
                self.admitted = seq.admitted
                self.m.queue.observe(max(0.0, seq.admitted - seq.arrival))
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = now

    def done(self, reason: str) -> None:
        m = self.m
        if self.last is not None:
            m.e2e.observe(self.last - self.started)
            if self.first is not None:
                m.decode_time.observe(self.last - self.first)
            if self.admitted is not None and self.first is not None:
                m.prefill_time.observe(max(0.0, self.first - self.admitted))
                m.inference_time.observe(max(0.0, self.last - self.admitted))
        m.finished(reason)
        m.success[VLLM_FINISH.get(reason, "abort")].inc()
        m.request_prompt_tokens.observe(self.prompt_tokens)
        m.request_generation_tokens.observe(self.generated)
