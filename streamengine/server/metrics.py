"""Prometheus metrics with vLLM's names under a `streamengine:` prefix.

Each app owns its own CollectorRegistry, so two servers (or two tests) in one process never
collide on metric names. Engine state (running/waiting requests, KV usage, prefix-cache and
preemption counters) is read from `engine.stats()` at scrape time; per-request latencies and
token counts are recorded by the server as it streams.

Per tenant, `streamengine:tenant_*` series carry a `tenant` label: the engine's per-tenant
figures (`stats()["tenants"]`: tokens, prefix-cache queries and hits, running and waiting
requests, blocks held and pinned, rate-limit refusals) and the time to first token recorded
here, with the time each request waited for admission. Tenant names come from the operator
(the tenants file), never from clients, so the number of series stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from streamengine.sample.outputs import RequestMetrics
from streamengine.tenancy.tenants import DEFAULT_TENANT

PREFIX = "streamengine:"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _EngineStatsCollector(Collector):
    """Reads the engine's own counters at scrape time, so they can never drift from it."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield _gauge("num_requests_running", "Requests in the running batch.", stats.get("num_running", 0))
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.get("num_waiting", 0))
        total = stats.get("num_total_blocks", 0) or 0
        free = stats.get("num_free_blocks", 0) or 0
        usage = (total - free) / total if total else 0.0
        yield _gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage)
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.get("prefix_cache_queries", 0))
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.get("prefix_cache_hits", 0))
        # CounterMetricFamily appends `_total`, giving vLLM's `num_preemptions_total`.
        yield _counter("num_preemptions", "Preemptions since start.", stats.get("num_preemptions", 0))
        yield from _spec_decode_families(stats)
        yield from _tenant_families(stats.get("tenants") or {})


def _spec_decode_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """Speculative decoding's counters under vLLM's names (`spec_decode_*_total`)."""
    for name, doc in (("spec_decode_num_drafts", "Verifications of at least one proposed token."),
                      ("spec_decode_num_draft_tokens", "Proposed tokens verified."),
                      ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")):
        yield _counter(name, doc, stats.get(name, 0))
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Proposed tokens accepted, by their position in the draft.", labels=["position"])
    for position, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or ()):
        per_pos.add_metric([str(position)], float(count))
    yield per_pos


# (series name, stats key, help, counter?) of the per-tenant figures of `engine.stats()`.
_TENANT_SERIES = (
    ("tenant_num_requests_running", "num_running", "Sequences of the tenant in the running batch.", False),
    ("tenant_num_requests_waiting", "num_waiting", "Sequences of the tenant waiting to be scheduled.", False),
    ("tenant_prompt_tokens", "prompt_tokens", "Prompt tokens computed for the tenant (cache hits excluded).", True),
    ("tenant_generation_tokens", "output_tokens", "Tokens generated for the tenant.", True),
    ("tenant_prefix_cache_queries", "prefix_cache_queries", "The tenant's prompt tokens looked up in the prefix cache.", True),
    ("tenant_prefix_cache_hits", "prefix_cache_hits", "The tenant's prompt tokens found in the prefix cache.", True),
    ("tenant_num_rejected", "num_rejected", "Requests refused for the tenant's tokens_per_minute.", True),
    ("tenant_kv_blocks", "num_blocks", "KV-cache blocks held by the tenant's running sequences.", False),
    ("tenant_pinned_blocks", "num_pinned_blocks", "KV-cache blocks pinned for the tenant.", False),
    ("tenant_virtual_time", "virtual_time", "The tenant's weighted service so far (fair scheduling's counter).", False),
)


def _tenant_families(tenants: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    for name, key, doc, is_counter in _TENANT_SERIES:
        kind = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = kind(PREFIX + name, doc, labels=["tenant"])
        for tenant, figures in sorted(tenants.items()):
            if key in figures:
                family.add_metric([tenant], float(figures[key]))
        yield family
    # An info series (always 1): the adapter a tenant's requests run under by default. Tenants
    # and their adapters come from the operator's config, so the series stay bounded.
    adapters = GaugeMetricFamily(PREFIX + "tenant_lora_info", "The LoRA adapter the tenant's config names.",
                                 labels=["tenant", "lora"])
    for tenant, figures in sorted(tenants.items()):
        if figures.get("lora") is not None:
            adapters.add_metric([tenant, str(figures["lora"])], 1.0)
    yield adapters


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=float(value))


def _histogram(registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
    return Histogram(PREFIX + name, doc, labelnames=labels, buckets=buckets, registry=registry)


class ServerMetrics:
    """The metrics of one app. `render()` gives the Prometheus text exposition."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(stats))
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=reg)
        self.ttft = _histogram(reg, "time_to_first_token_seconds", "Time from request arrival to its first token.", _TTFT_BUCKETS)
        self.itl = _histogram(reg, "inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS)
        self.e2e = _histogram(reg, "e2e_request_latency_seconds", "Time from request arrival to its end.", _E2E_BUCKETS)
        # A finished request's time, split at its stages (the engine's clock: RequestMetrics).
        self.queue_time = _histogram(
            reg, "request_queue_time_seconds", "Time a request waited before its first step.", _PHASE_BUCKETS)
        self.prefill_time = _histogram(
            reg, "request_prefill_time_seconds", "Time from a request's first step to its first token.", _PHASE_BUCKETS)
        self.decode_time = _histogram(
            reg, "request_decode_time_seconds", "Time from a request's first token to its end.", _PHASE_BUCKETS)
        self.tenant_ttft = _histogram(
            reg, "tenant_time_to_first_token_seconds", "Time from request arrival to its first token, per tenant.",
            _TTFT_BUCKETS, "tenant")
        self.tenant_queue_time = _histogram(
            reg, "tenant_request_queue_time_seconds", "Time a request waited before its first step, per tenant.",
            _PHASE_BUCKETS, "tenant")

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def recorder(self, tenant: str = DEFAULT_TENANT) -> RequestRecorder:
        return RequestRecorder(self, tenant)


class RequestRecorder:
    """Latency bookkeeping for one request of `tenant`; created when the request arrives."""

    __slots__ = ("_arrival", "_last_token_time", "_metrics", "_prompt_counted", "_tenant_queue", "_tenant_ttft")

    def __init__(self, metrics: ServerMetrics, tenant: str = DEFAULT_TENANT) -> None:
        self._metrics = metrics
        self._tenant_ttft = metrics.tenant_ttft.labels(tenant)
        self._tenant_queue = metrics.tenant_queue_time.labels(tenant)
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None
        self._prompt_counted = False

    def on_step(self, prompt_tokens: int, new_tokens: int, longest_delta: int, finished: bool,
                stages: RequestMetrics | None = None) -> None:
        """`new_tokens` counts all samples of the step; `longest_delta` is the most any one
        sample gained (more than 1 when the engine coalesced steps for a slow consumer);
        `stages`, the engine's stage times, are recorded when the request finishes."""
        now = time.monotonic()
        m = self._metrics
        if not self._prompt_counted:
            m.prompt_tokens.inc(prompt_tokens)
            self._prompt_counted = True
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if self._last_token_time is None:
                m.ttft.observe(now - self._arrival)
                self._tenant_ttft.observe(now - self._arrival)
            else:
                # A coalesced step carries several tokens per sample: spread its gap over them.
                steps = max(longest_delta, 1)
                gap = (now - self._last_token_time) / steps
                for _ in range(steps):
                    m.itl.observe(gap)
            self._last_token_time = now
        if finished:
            m.e2e.observe(now - self._arrival)
            if stages is not None:
                self._observe_stages(stages)

    def _observe_stages(self, stages: RequestMetrics) -> None:
        m = self._metrics
        for histogram, seconds in ((m.queue_time, stages.queue_time), (m.prefill_time, stages.prefill_time),
                                   (m.decode_time, stages.decode_time), (self._tenant_queue, stages.queue_time)):
            if seconds is not None:
                histogram.observe(seconds)
