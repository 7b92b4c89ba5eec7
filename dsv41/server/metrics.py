"""`/metrics` for Prometheus, through `prometheus_client`.

Each `ServerMetrics` owns its own `CollectorRegistry` (no process-global state, so two apps in one
process, as in the tests, keep separate counts). It holds:
- the HTTP layer's counters: responses by endpoint and status, queue-full rejections, client disconnects;
- the per-request histograms users graph for vLLM: time to first token, inter-token latency, end-to-end
  latency, queue time (arrival to first admission, measured by the engine), prompt and generation lengths;
- the engine's own figures (`AsyncEngine.metrics()`), read on every scrape by a collector: queue depths,
  KV-pool use, prefix-cache hits, token counters. Keys the engine adds later are still exposed (as
  counters when they end in `_total`, else gauges); the table below only adds names and help text.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dsv41_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# engine metric key -> (exposed name, type, help)
ENGINE_METRICS = {
    "waiting": ("num_requests_waiting", "gauge", "Requests queued for admission."),
    "running": ("num_requests_running", "gauge", "Requests being prefilled or decoded."),
    "kv_blocks_used": ("kv_blocks_used", "gauge", "KV-cache blocks in use."),
    "kv_blocks_total": ("kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    "kv_usage": ("kv_cache_usage_ratio", "gauge", "Fraction of the KV-cache pool in use (0-1)."),
    "prefix_cache_queried_tokens": (
        "prefix_cache_queried_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / queried tokens."),
    "prompt_tokens_total": (
        "prompt_tokens_total",
        "counter",
        "Prompt tokens admitted (prefilled here, or imported from a KV hand-off).",
    ),
    "handoff_imported_tokens_total": (
        "handoff_imported_tokens_total",
        "counter",
        "Prompt tokens imported computed from a prefill worker's KV hand-off.",
    ),
    "generation_tokens_total": ("generation_tokens_total", "counter", "Tokens generated."),
    "generation_tokens_per_s": ("generation_tokens_per_second", "gauge", "Recent generation throughput."),
    "requests_finished_total": ("requests_finished_total", "counter", "Requests finished in the engine."),
    "requests_failed_total": (
        "requests_failed_total",
        "counter",
        "Requests that failed alone (finish_reason error); the batch went on.",
    ),
    "failed_steps_total": (
        "failed_steps_total",
        "counter",
        "Engine steps whose forward pass raised (their requests were retried one by one).",
    ),
    "preemptions_total": ("preemptions_total", "counter", "Requests preempted for lack of KV blocks."),
    "kv_resident_bytes_per_token": (
        "kv_resident_bytes_per_token",
        "gauge",
        "Global KV bytes stored per token of the running sequences (packed FP4).",
    ),
    "kv_fixed_state_bytes": (
        "kv_fixed_state_bytes",
        "gauge",
        "Per-sequence fixed state of the running sequences (FP8 window rings, partial groups).",
    ),
    "prefix_cache_snapshot_hits": (
        "prefix_cache_snapshot_hits_total",
        "counter",
        "Admissions that restored a message-boundary snapshot.",
    ),
    "window_rebuilds": (
        "window_rebuilds_total",
        "counter",
        "Admissions that rebuilt window rings by bounded replay over cached global KV.",
    ),
    "steps_total": ("engine_steps_total", "counter", "Engine steps run."),
    "spec_decode_steps_total": (
        "spec_decode_steps_total",
        "counter",
        "DSpark verify passes (a request's step with a draft to verify).",
    ),
    "spec_decode_draft_tokens_total": ("spec_decode_draft_tokens_total", "counter", "Tokens drafted and verified."),
    "spec_decode_accepted_tokens_total": (
        "spec_decode_accepted_tokens_total",
        "counter",
        "Drafted tokens the target accepted.",
    ),
    "spec_decode_emitted_tokens_total": (
        "spec_decode_emitted_tokens_total",
        "counter",
        "Tokens emitted by verify passes (accepted drafts + one from the target).",
    ),
    "spec_decode_acceptance_rate": ("spec_decode_acceptance_rate", "gauge", "Accepted / drafted tokens."),
    "spec_decode_mean_emitted_per_step": (
        "spec_decode_mean_emitted_per_step",
        "gauge",
        "Tokens emitted per verify pass (plain decoding: 1).",
    ),
}

# buckets in the spirit of vLLM's: CPU-sized tails (a tiny model on 2 cores is slow), log-spaced
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_BUCKETS = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    20000,
    50000,
    100000,
    200000,
    500000,
    1000000,
)


class _EngineCollector:
    """Turns the engine's metrics dict into samples at scrape time."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def collect(self):
        for key, value in self.read().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, kind, help_ = ENGINE_METRICS.get(
                key, (key, "counter" if key.endswith("_total") else "gauge", f"Engine metric {key}.")
            )
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + name, help_, value=float(value))


class ServerMetrics:
    """The server's metrics; thread-safe (prometheus_client's metrics are)."""

    def __init__(self, engine_metrics: Callable[[], dict] | None = None, numerics: str | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        if numerics is not None:  # dsv41_numerics_info{mode="fast"} 1: which guarantees these figures come with
            Info(
                PREFIX + "numerics", "The engine's numerics mode (fast, deterministic or reference).", registry=r
            ).info({"mode": numerics})
        self.responses = Counter(
            PREFIX + "http_responses", "HTTP responses by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.rejected_queue_full = Counter(
            PREFIX + "requests_rejected_queue_full", "Requests refused because the queue was full.", registry=r
        )
        self.client_disconnects = Counter(
            PREFIX + "client_disconnects", "Requests aborted because the client went away.", registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive generated tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time a request waited in the engine's queue before it was admitted.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt length of finished requests.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generated length of finished requests.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        if engine_metrics is not None:
            r.register(_EngineCollector(engine_metrics))

    def response(self, endpoint: str, status: int) -> None:
        self.responses.labels(endpoint=endpoint, status=str(status)).inc()

    def finished(self, *, e2e_s: float, queue_time_s: float | None, prompt_tokens: int, generation_tokens: int) -> None:
        """One request ran to its end (not aborted, not failed)."""
        self.e2e.observe(e2e_s)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
