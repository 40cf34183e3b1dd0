"""The server's Prometheus metrics, in a registry of its own (two servers in one process never mix figures).

Request counts are kept by the HTTP layer; tokens, queue depth, running sequences, KV-block usage, TTFT and the
latency between tokens come with each step's report from the engine process (``record``; prometheus-client's
metrics are thread-safe).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._kv_blocks = 0
        self._preemptions = 0  # the engine's count at the last report
        self.requests = Counter("quanta_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("quanta_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("quanta_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("quanta_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("quanta_sequences_finished", "sequences ended, by reason", ["reason"], registry=r)
        self.preemptions = Counter("quanta_preemptions", "sequences preempted (their KV recomputed later)",
                                   registry=r)
        self.queue_depth = Gauge("quanta_queue_depth", "sequences waiting for a batch slot", registry=r)
        self.running = Gauge("quanta_running_sequences", "sequences in the running batch", registry=r)
        self.live = Gauge("quanta_live_sequences", "sequences accepted and not yet ended", registry=r)
        self.kv_used = Gauge("quanta_kv_blocks_used", "KV-cache blocks held by sequences", registry=r)
        self.kv_total = Gauge("quanta_kv_blocks_total", "KV-cache blocks in the pool", registry=r)
        self.kv_usage = Gauge("quanta_kv_cache_usage_ratio", "fraction of the KV-cache blocks in use", registry=r)
        self.ttft = Histogram("quanta_time_to_first_token_seconds", "arrival to first token (queueing included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("quanta_time_per_output_token_seconds", "time between a sequence's tokens",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.step_sequences = Histogram("quanta_step_sequences", "sequences that gained a token in one engine step",
                                        buckets=BATCH_BUCKETS, registry=r)

    def set_pool(self, blocks: int) -> None:
        """The KV pool's size, once the engine has made it."""
        self._kv_blocks = blocks
        self.kv_total.set(blocks)

    def record(self, report: Any) -> None:
        """One engine step's figures (quanta.server.engine_core.StepReport)."""
        for gap in report.token_gaps:
            self.token_latency.observe(gap)
        if report.gained:
            self.generated_tokens.inc(report.tokens)
            self.step_sequences.observe(report.gained)
        for reason, stats in report.finished:
            self.finished.labels(reason).inc()
            if stats is not None:
                self.prompt_tokens.inc(stats.prompt_tokens)
                self.cached_tokens.inc(stats.cached_tokens)
                if stats.completion_tokens:
                    self.ttft.observe(stats.ttft_s)
        waiting, running, kv_used, preemptions = report.gauges
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_usage.set(kv_used / self._kv_blocks if self._kv_blocks else 0.0)
        if preemptions > self._preemptions:
            self.preemptions.inc(preemptions - self._preemptions)
            self._preemptions = preemptions

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
