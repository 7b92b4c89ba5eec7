"""`/metrics` in the Prometheus text exposition format (version 0.0.4), without a client library.

Engine figures come from `AsyncEngine.metrics()` on every scrape; the server adds its own counters
(HTTP responses by endpoint and status, queue-full rejections, client disconnects) and latency sums.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

PREFIX = "dsv41_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# engine metric key -> (exposed name, type, help). Keys the engine adds later are still exposed
# (as counters when they end in `_total`, else gauges), so this table only adds names and help text.
ENGINE_METRICS = {
    "waiting": ("num_requests_waiting", "gauge", "Requests queued for admission."),
    "running": ("num_requests_running", "gauge", "Requests being prefilled or decoded."),
    "kv_blocks_used": ("kv_blocks_used", "gauge", "KV-cache blocks in use."),
    "kv_blocks_total": ("kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    "kv_usage": ("kv_cache_usage_ratio", "gauge", "Fraction of the KV-cache pool in use (0-1)."),
    "prefix_cache_queried_tokens": ("prefix_cache_queried_tokens_total", "counter",
                                    "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / queried tokens."),
    "prompt_tokens_total": ("prompt_tokens_total", "counter", "Prompt tokens admitted."),
    "generation_tokens_total": ("generation_tokens_total", "counter", "Tokens generated."),
    "generation_tokens_per_s": ("generation_tokens_per_second", "gauge", "Recent generation throughput."),
    "requests_finished_total": ("requests_finished_total", "counter", "Requests finished in the engine."),
    "preemptions_total": ("preemptions_total", "counter", "Requests preempted for lack of KV blocks."),
    "kv_resident_bytes_per_token": ("kv_resident_bytes_per_token", "gauge",
                                    "Global KV bytes stored per token of the running sequences (packed FP4)."),
    "kv_fixed_state_bytes": ("kv_fixed_state_bytes", "gauge",
                             "Per-sequence fixed state of the running sequences (FP8 window rings, partial groups)."),
    "prefix_cache_snapshot_hits": ("prefix_cache_snapshot_hits_total", "counter",
                                   "Admissions that restored a message-boundary snapshot."),
    "window_rebuilds": ("window_rebuilds_total", "counter",
                        "Admissions that rebuilt window rings by bounded replay over cached global KV."),
    "steps_total": ("engine_steps_total", "counter", "Engine steps run."),
}


def _num(v) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """Thread-safe counters kept by the HTTP layer."""

    def __init__(self):
        self._lock = threading.Lock()
        self.responses: dict[tuple[str, int], int] = defaultdict(int)
        self.rejected_queue_full = 0
        self.client_disconnects = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.latency_sum = 0.0
        self.latency_count = 0

    def response(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.responses[(endpoint, status)] += 1

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + value)

    def render(self, engine_metrics: dict) -> str:
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {PREFIX}{name} {help_}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            for labels, value in samples:
                lbl = "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"{PREFIX}{name}{lbl} {_num(value)}")

        for key, value in engine_metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, kind, help_ = ENGINE_METRICS.get(
                key, (key, "counter" if key.endswith("_total") else "gauge", f"Engine metric {key}."))
            metric(name, kind, help_, [({}, value)])
        with self._lock:
            metric("http_responses_total", "counter", "HTTP responses by endpoint and status code.",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.responses.items())])
            metric("requests_rejected_queue_full_total", "counter", "Requests refused because the queue was full.",
                   [({}, self.rejected_queue_full)])
            metric("client_disconnects_total", "counter", "Requests aborted because the client went away.",
                   [({}, self.client_disconnects)])
            metric("time_to_first_token_seconds", "summary", "Time from request arrival to the first token.",
                   [])
            lines.append(f"{PREFIX}time_to_first_token_seconds_sum {_num(self.ttft_sum)}")
            lines.append(f"{PREFIX}time_to_first_token_seconds_count {_num(self.ttft_count)}")
            metric("request_latency_seconds", "summary", "Time from request arrival to the last token.", [])
            lines.append(f"{PREFIX}request_latency_seconds_sum {_num(self.latency_sum)}")
            lines.append(f"{PREFIX}request_latency_seconds_count {_num(self.latency_count)}")
        return "\n".join(lines) + "\n"
