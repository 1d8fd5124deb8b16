"""Prometheus metrics: the only module that imports prometheus_client.

Speculative-decoding counters follow the schema vLLM and llama.cpp share
(``spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` and
``spec_decode_num_accepted_tokens_per_pos_total{position}``) under the ``specserve:`` prefix,
with a ``drafter`` label. docs/metrics.md gives the PromQL.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import Engine, TokenEvent

disable_created_metrics()  # no *_created series: they only clutter dashboards

PREFIX = "specserve:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class _EngineCollector:
    """Values read from the engine at scrape time: queue depth, running, verify cost T(k), the
    prefix cache's size and token counters (vLLM's ``prefix_cache_queries``/``_hits``)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        g = GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests queued, not yet running.")
        g.add_metric([], self.engine.queue_depth())
        yield g
        g = GaugeMetricFamily(PREFIX + "num_requests_running", "Sequences the engine is stepping.")
        g.add_metric([], self.engine.running())
        yield g
        g = GaugeMetricFamily(PREFIX + "engine_ready", "1 once the model is loaded, calibrated and warm.")
        g.add_metric([], 1.0 if self.engine.ready else 0.0)
        yield g
        cost = self.engine.cost
        g = GaugeMetricFamily(PREFIX + "verify_cost_seconds",
                              "Current verify-pass cost T(k) for k rows (start-up measure, refreshed online).",
                              labels=["rows"])
        if cost is not None:
            for k, t in enumerate(cost.verify_cost, start=1):
                g.add_metric([str(k)], t)
        yield g
        g = GaugeMetricFamily(PREFIX + "verify_context_cost_seconds",
                              "Seconds a verify pass's first row (row=first) and each further row "
                              "(row=further) add per context token beyond the calibration context "
                              "(start-up fit; 0 where attention is cheap).", labels=["row"])
        if cost is not None:
            g.add_metric(["first"], cost.context_slope)
            g.add_metric(["further"], cost.context_row_slope)
        yield g
        info = self.engine.prefix_cache_info() or {"queries": 0, "hits": 0, "bytes": 0, "entries": 0, "max_bytes": 0}
        for name, key, doc in (("prefix_cache_queries", "queries", "Prompt tokens looked up in the prefix cache."),
                               ("prefix_cache_hits", "hits", "Prompt tokens whose KV came from the prefix cache.")):
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], info[key])
            yield c
        for name, key, doc in (("prefix_cache_bytes", "bytes", "Bytes held by the prefix cache."),
                               ("prefix_cache_max_bytes", "max_bytes", "The prefix cache's byte budget."),
                               ("prefix_cache_entries", "entries", "Cached prompt prefixes.")):
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], info[key])
            yield g


class Metrics:
    """Holds the registry and implements the engine's StatsSink."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc. (Linux /proc; absent elsewhere)
        self.requests = Counter(PREFIX + "requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter(PREFIX + "errors", "Error responses by OpenAI error type.",
                              ["type"], registry=r)
        self.finished = Counter(PREFIX + "request_success", "Finished generations by finish reason.",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished sequences (n choices: n times).", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated (emitted).", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end generation latency.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Submit to admission (waiting for a slot), per admitted generation.",
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Per generation of 2+ tokens: (last token - first token) / (tokens - 1).",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before running, by reason.",
                                ["reason"], registry=r)
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts",
                                  "Verify steps that carried at least one draft token.", ["drafter"], registry=r)
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                                        ["drafter"], registry=r)
        self.num_accepted = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.",
                                    ["drafter"], registry=r)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position (0-based).",
                                        ["drafter", "position"], registry=r)
        self.unused_proposals = Counter(PREFIX + "spec_decode_num_unused_proposals",
                                        "Drafter forwards paid for but not verified (cut to nothing by the "
                                        "scheduler, or another option won); counted when a request ends.",
                                        ["drafter"], registry=r)
        self.decisions = Counter(PREFIX + "scheduler_decisions",
                                 "Scheduler choices per verify step: prompt_lookup, dspark, grammar or plain.",
                                 ["outcome"], registry=r)
        self.expected_accepted = Counter(PREFIX + "spec_decode_expected_accepted_tokens",
                                         "Accepted draft tokens the scheduler predicted (calibration).",
                                         ["drafter"], registry=r)
        self.tokens_per_step = Histogram(PREFIX + "spec_decode_tokens_per_step",
                                         "Tokens committed per target verify step (drafter=none: plain decode).",
                                         ["drafter"], buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32), registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Decoding sequences per batched target pass "
                                    "(continuous batching; single-sequence steps are not counted).",
                                    buckets=(2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.batch_tokens = Counter(PREFIX + "batch_committed_tokens",
                                    "Tokens committed by batched target passes.", registry=r)
        # Series that exist from the start at 0 (as vLLM's do), so a query over them has data
        # before the first event: every scheduler outcome, and the unused proposals of each
        # drafter (which most servers never count). Not the per-drafter acceptance counters,
        # whose ratios would be 0/0 for a drafter that never ran.
        for outcome in ("prompt_lookup", "dspark", "grammar", "plain"):
            self.decisions.labels(outcome)
        for drafter in ("prompt_lookup", "dspark"):
            self.unused_proposals.labels(drafter)

    def attach(self, engine: Engine) -> None:
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- engine StatsSink --------------------------------------------------------------------

    def spec_step(self, drafter: str | None, num_draft: int, num_accepted: int,
                  expected_accepted: float, num_committed: int) -> None:
        label = drafter or "none"
        self.tokens_per_step.labels(label).observe(num_committed)
        self.decisions.labels(drafter or "plain").inc()
        if drafter is None or num_draft == 0:
            return
        self.expected_accepted.labels(drafter).inc(expected_accepted)
        self.num_drafts.labels(drafter).inc()
        self.num_draft_tokens.labels(drafter).inc(num_draft)
        self.num_accepted.labels(drafter).inc(num_accepted)
        for pos in range(num_accepted):
            self.accepted_per_pos.labels(drafter, str(pos)).inc()

    def batch_step(self, num_sequences: int, num_committed: int) -> None:
        self.batch_size.observe(num_sequences)
        self.batch_tokens.inc(num_committed)

    def request_finished(self, event: TokenEvent) -> None:
        reason = event.finish_reason.value if event.finish_reason is not None else "error"
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(event.prompt_tokens)
        for drafter, counts in (event.stats.by_drafter.items() if event.stats else ()):
            if counts.num_unused_proposals:
                self.unused_proposals.labels(drafter).inc(counts.num_unused_proposals)
        self.generation_tokens.inc(event.completion_tokens)
        if event.elapsed is not None:
            self.latency.observe(event.elapsed)
        if event.queue_time is not None:
            self.queue_time.observe(event.queue_time)
        if event.time_per_output_token is not None:
            self.tpot.observe(event.time_per_output_token)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()
