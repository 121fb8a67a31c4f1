"""Prometheus metrics: vLLM's metric names under `ember:`, and the same families under `vllm:`.

llm-d's router and the Gateway API inference extension read `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`, ...; dashboards built for vLLM read the
histograms. Every family is kept once (under `ember:`) and exposed under both prefixes at scrape
time, so an observation costs one histogram update, not two. Engine gauges and counters are read
from `engine.stats()` at scrape time; the request path only observes per-request histograms."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# vLLM's buckets, so dashboards' quantile panels line up.
TTFT_BUCKETS = [
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
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
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
]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TOKEN_COUNT_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
N_BUCKETS = [1, 2, 5, 10, 20]

PREFIXES = ("ember:", "vllm:")
# Older names some consumers still read, exposed as aliases of a current family.
ALIASES = {
    "kv_cache_usage_perc": ("gpu_cache_usage_perc",),
    "inter_token_latency_seconds": ("time_per_output_token_seconds",),
}

prometheus_client.disable_created_metrics()  # as vLLM: `_created` series only add noise here


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], Any], kernel_paths: Mapping[str, str],
                 cache_config: Mapping[str, str] | None = None) -> None:
        self.model_name = model_name
        self._engine_stats = engine_stats
        self._kernel_paths = dict(kernel_paths)
        self._cache_config = dict(cache_config or {})
        self._families = CollectorRegistry(auto_describe=False)  # the `ember:` originals
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(f"ember:{name}", doc, labels, buckets=buckets, registry=self._families).labels(
                model_name
            )

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = LoopHistogram(ITL_BUCKETS)  # observed once per streamed token: kept lock-free
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finish.", LATENCY_BUCKETS
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.max_tokens = histogram(
            "request_params_max_tokens", "max_tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.params_n = histogram("request_params_n", "n per request.", N_BUCKETS)
        self._success = Counter(
            "ember:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self._families,
        )
        self._rejected = Counter(
            "ember:request_rejected",
            "Requests refused by admission or drain, by reason.",
            ["model_name", "reason"],
            registry=self._families,
        )

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PrefixedCollector(self))

    def observe_finished(
        self,
        metrics: Any,
        finish_reason: str,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        max_tokens: int,
        n: int,
    ) -> None:
        """Record one finished engine request from its RequestMetrics (time.monotonic() seconds)."""
        arrival = metrics.arrival_time
        scheduled = metrics.first_scheduled_time or arrival
        first_token = metrics.first_token_time
        finished = metrics.finished_time or time.monotonic()
        self.e2e.observe(finished - arrival)
        self.queue_time.observe(scheduled - arrival)
        self.inference_time.observe(finished - scheduled)
        if first_token:
            self.ttft.observe(first_token - arrival)
            self.prefill_time.observe(first_token - scheduled)
            last_token = metrics.last_token_time or first_token
            self.decode_time.observe(last_token - first_token)
            if num_generation_tokens > 1:
                self.tpot.observe((last_token - first_token) / (num_generation_tokens - 1))
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_generation_tokens)
        self.max_tokens.observe(max_tokens)
        self.params_n.observe(n)
        self._success.labels(self.model_name, finish_reason).inc()

    def count_aborted(self) -> None:
        """An engine request aborted because its client went away: vLLM's finished_reason="abort"."""
        self._success.labels(self.model_name, "abort").inc()

    def count_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

    def loop_families(self) -> Iterator[Metric]:
        yield self.itl.family(
            "ember:inter_token_latency_seconds", "Time between two streamed tokens.", self.model_name
        )

    def engine_families(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        model = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(f"ember:{name}", doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(f"ember:{name}", doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield gauge("num_requests_running", "Requests in the engine's running batch.", stats.num_running)
        yield gauge(
            "num_requests_waiting", "Requests waiting for the engine to schedule them.", stats.num_waiting
        )
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", stats.kv_cache_usage)
        yield counter("num_preemptions", "Preemptions since start.", stats.num_preempted_total)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield counter(
            "prompt_tokens", "Prompt tokens processed (prefilled or cached).", stats.prompt_tokens_total
        )
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        spec = stats.spec_decode
        if spec is not None:
            yield counter("spec_decode_num_drafts", "Decodes that verified draft tokens.", spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
            yield counter(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens
            )
            per_position = CounterMetricFamily(
                "ember:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft.",
                labels=["model_name", "position"],
            )
            for position, accepted in enumerate(spec.accepted_per_position):
                per_position.add_metric([self.model_name, str(position)], accepted)
            yield per_position
        lora = GaugeMetricFamily(
            "ember:lora_requests_info",
            "LoRA adapters in use (none: Ember serves no LoRA).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        paths = GaugeMetricFamily(
            "ember:kernel_path_info",
            "The code each part of a step runs on (native_<ISA> kernels or torch), as logged at start.",
            labels=["model_name", "part", "path"],
        )
        for part, path in self._kernel_paths.items():
            paths.add_metric([self.model_name, part, path], 1)
        yield paths
        if self._cache_config:
            # vLLM's family: its labels are the cache's settings (block_size, cache_dtype, num_gpu_blocks, ...).
            cache = GaugeMetricFamily("ember:cache_config_info", "The KV cache's settings, as labels.",
                                      labels=list(self._cache_config))
            cache.add_metric(list(self._cache_config.values()), 1)
            yield cache


class LoopHistogram:
    """A histogram observed and collected only on the event loop thread: no lock, one bisect per
    observation (prometheus_client's Histogram takes a mutex per bucket update)."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def family(self, name: str, documentation: str, model_name: str) -> HistogramMetricFamily:
        buckets, cumulative = [], 0
        for bound, count in zip([*self._bounds, math.inf], self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([model_name], buckets, sum_value=self._sum)
        return family


class _PrefixedCollector(Collector):
    """Yields every `ember:` family a second time renamed to `vllm:` (plus the legacy aliases)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        families = [*metrics.engine_families(), *metrics.loop_families(), *metrics._families.collect()]
        for family in families:
            base = family.name.removeprefix("ember:")
            for prefix in PREFIXES:
                for name in (base, *ALIASES.get(base, ())):
                    yield (
                        family
                        if prefix + name == family.name
                        else _renamed(family, family.name, prefix + name)
                    )


def _renamed(family: Metric, old: str, new: str) -> Metric:
    copy = Metric(new, family.documentation, family.type, family.unit)
    copy.samples = [sample._replace(name=new + sample.name[len(old) :]) for sample in family.samples]
    return copy
