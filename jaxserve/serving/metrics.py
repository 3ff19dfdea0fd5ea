"""Prometheus metrics of a jaxserve server (names in vLLM's style, `jaxserve:` prefix).

Two kinds, both in a `CollectorRegistry` owned by one server (never the global one,
so two servers in one process, e.g. in tests, do not mix their numbers):

* Per-request histograms and counters, observed once when a request finishes, from
  the timings the controller attaches to its final chunk (TTFT, TPOT, inter-token
  latency, end-to-end latency, queue time per phase, KV transfer time and bytes).
* Per-instance gauges and the backend's fault counters, read live from
  `controller.stats()` at every scrape by a custom collector: a value captured once
  would go stale the moment the server runs. `stats()` reads local counters only,
  and the HTTP server renders a scrape on a worker thread, never on the event loop.

Names and definitions follow vLLM's (`vllm:` -> `jaxserve:`); every metric is listed,
with its meaning and its vLLM counterpart, in docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.runtime.api import ControllerStats
from jaxserve.serving.admin import WorkloadGauges
from jaxserve.serving.wire import Timings

PREFIX = "jaxserve:"

# Seconds: from sub-millisecond (tiny models on a CPU) to minutes (long queues).
_LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(0, 13))  # 1 KiB .. 16 GiB


class ServingMetrics:
    """All metrics of one server; `observe_finished` is called once per finished request."""

    def __init__(
        self, stats: Callable[[], ControllerStats] | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS_S, labels: tuple[str, ...] = ()):
            return Histogram(PREFIX + name, doc, labelnames=labels, buckets=buckets, registry=r)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Time to first token: first token time minus the request's arrival at the server (before tokenization).",
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Time per output token after the first: (last - first) / (n - 1), one observation per request.",
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Time between consecutive output tokens, one observation per token gap."
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency: finish time minus arrival.")
        self.queue = hist(
            "request_queue_time_seconds",
            "Time a request waited before a phase started (prefill: from arrival; decode: from KV ready).",
            labels=("phase",),
        )
        self.prefill_time = hist("request_prefill_time_seconds", "Time a request spent in its prefill batch.")
        self.kv_transfer_time = hist(
            "kv_transfer_time_seconds", "Time moving one request's KV cache from prefill to decode."
        )
        self.kv_transfer_bytes = hist(
            "kv_transfer_bytes", "Bytes of KV cache moved per request.", buckets=_BYTES_BUCKETS
        )
        self.requests = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            PREFIX + "request_errors", "Requests refused or failed, by error kind.", ["kind"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens generated.", registry=r)
        if stats is not None:
            r.register(LiveStatsCollector(stats))

    def observe_finished(
        self, timings: Timings | None, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str
    ) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if timings is None:
            return
        for hist, value in (
            (self.ttft, timings.ttft_s),
            (self.tpot, timings.tpot_s),
            (self.e2e, timings.e2e_s),
            (self.prefill_time, timings.prefill_s),
            (self.kv_transfer_time, timings.kv_transfer_s),
        ):
            if value is not None:
                hist.observe(max(value, 0.0))
        if timings.prefill_queue_s is not None:
            self.queue.labels(phase="prefill").observe(max(timings.prefill_queue_s, 0.0))
        if timings.decode_queue_s is not None:
            self.queue.labels(phase="decode").observe(max(timings.decode_queue_s, 0.0))
        if timings.kv_transfer_bytes:
            self.kv_transfer_bytes.observe(timings.kv_transfer_bytes)
        for gap in timings.inter_token_latencies_s:
            self.itl.observe(max(gap, 0.0))

    def observe_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, gauges read now."""
        return generate_latest(self.registry)


_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_requests_waiting", "num_waiting", "Requests queued at the instance, not yet running."),
    ("num_requests_running", "num_running", "Requests the instance is running (prefill batch or decode batch)."),
    ("kv_blocks_used", "num_kv_blocks_used", "Paged KV-cache blocks in use (decode and colocated instances)."),
    ("kv_blocks_free", "num_kv_blocks_free", "Paged KV-cache blocks free (decode and colocated instances)."),
    ("prefill_buffer_used", "num_prefill_buffer_used", "Finished prefills waiting for a decode instance to pull them."),
    ("prefill_buffer_capacity", "prefill_buffer_capacity", "Bound of the prefill instance's finished-prefill buffer."),
    ("instance_alive", "alive", "1 while the instance's worker runs, 0 once it died."),
    ("prefix_cache_blocks", "num_cached_blocks", "Prefix cache: named KV blocks held (pinned or evictable)."),
    ("prefix_cache_query_tokens", "num_prefix_query_tokens", "Prefix cache: prompt tokens looked up since start."),
    ("prefix_cache_hit_tokens", "num_prefix_hit_tokens", "Prefix cache: prompt tokens found cached since start."),
    ("prefix_cache_evictions", "num_prefix_evictions", "Prefix cache: blocks evicted (LRU) since start."),
)

_FAULT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kv_pull_failures", "num_failed_pulls", "KV pull attempts that failed (then retried, recomputed or failed)."),
    ("kv_pull_retries", "num_pull_retries", "KV pulls retried after a failed attempt."),
    ("kv_recomputed", "num_recomputed", "KV pulls answered by recomputing the prompt's KV instead."),
    ("kv_leases_expired", "num_expired_leases", "Prefilled KVs freed because nobody pulled them within the lease."),
    ("requests_rerouted", "num_rerouted_requests", "Requests re-run after the instance holding them died."),
    ("instance_restarts", "num_instance_restarts", "Times a dead instance was restarted and rejoined."),
)


class LiveStatsCollector(Collector):
    """Per-instance gauges and fault counters, read from `controller.stats()` at scrape time."""

    def __init__(self, stats: Callable[[], ControllerStats]) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        for name, _, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, labels=["instance", "role"])
        for name, _, doc in _FAULT_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, attr, doc in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["instance", "role"])
            for inst in stats.instances:
                family.add_metric([inst.name, inst.role], float(getattr(inst, attr)))
            yield family
        for name, attr, doc in _FAULT_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=float(getattr(stats.faults, attr)))


class WorkloadCollector(Collector):
    """The workload monitor's gauges (window rate, mean lengths, step-time corrections, replans), read per scrape."""

    def __init__(self, gauges: Callable[[], WorkloadGauges]) -> None:
        self._gauges = gauges

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._gauges()))

    @staticmethod
    def _families(g: WorkloadGauges | None) -> list[Metric]:
        def gauge(name: str, doc: str, value: float | None, labels: list[str] | None = None) -> GaugeMetricFamily:
            if labels is not None:
                return GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            return GaugeMetricFamily(PREFIX + name, doc, value=value if g is not None else None)

        rate = gauge(
            "workload_arrival_rate", "Arrivals per second over the monitor's window.", g.window_rate_rps if g else None
        )
        prompt = gauge(
            "workload_mean_prompt_tokens",
            "Mean prompt length over the monitor's window.",
            g.mean_prompt_tokens if g else None,
        )
        output = gauge(
            "workload_mean_output_tokens",
            "Mean output length over the monitor's window.",
            g.mean_output_tokens if g else None,
        )
        factor = gauge(
            "latency_correction_factor",
            "Observed / predicted step time over the window, per role (1: the latency model is right or no data).",
            None,
            ["role"],
        )
        last = gauge(
            "replan_last_timestamp_seconds",
            "Unix time of the last replan round or deployment switch (0: none yet).",
            (g.last_replan_at or 0.0) if g else None,
        )
        plan = gauge("deployment_plan_info", "The deployment being served (1, labelled by plan id and spec).", None,
                     ["plan_id", "plan"])  # fmt: skip
        if g is not None:
            for role, value in sorted(g.correction_factors.items()):
                factor.add_metric([role], value)
            plan.add_metric([g.plan_id, g.plan], 1.0)
        return [rate, prompt, output, factor, last, plan]
