"""Turn per-request timings into the serving metrics, with `vllm bench serve`'s definitions and keys."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.bench.client import RequestResult
from ember.errors import EmberError
from ember.loader import Tokenizer

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    result: RequestResult
    prompt_len: int  # the dataset's count for the full prompt, used when the server sends no usage


@dataclass(frozen=True)
class CostModel:
    usd_per_hour: float  # price of one machine
    instances: int = 1


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise EmberError(f"--goodput takes NAME:MILLISECONDS with NAME in {', '.join(SLO_METRICS)}, "
                             f"got {spec!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise EmberError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise EmberError(f"--goodput {spec!r}: the limit must be positive")
    return slos


def parse_percentiles(text: str) -> list[float]:
    try:
        values = sorted({float(p) for p in str(text).split(",") if p.strip()} | {99.0})
    except ValueError:
        raise EmberError(f"--percentiles takes comma-separated numbers, got {text!r}") from None
    if any(not 0 < p < 100 for p in values):
        raise EmberError(f"--percentiles must lie strictly between 0 and 100, got {text!r}")
    return values


def percentile_key(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def _latency_stats(name: str, seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    values = np.asarray(seconds or [0.0]) * 1000.0
    stats = {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
    }
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(values, p))
    return stats


def _output_tokens(result: RequestResult, tokenizer: Tokenizer | None) -> int:
    if result.output_tokens is not None:
        return result.output_tokens
    if tokenizer is None:
        return len(result.chunk_times)
    return len(tokenizer.encode(result.generated_text, add_special_tokens=False))


def output_tokens_per_second(results: list[tuple[RequestResult, int]], start: float) -> list[float]:
    """Output tokens per 1-second bucket since `start`. A chunk carrying several tokens (usage says more
    tokens than chunks) spreads them evenly over its request's chunks."""
    buckets: Counter[int] = Counter()
    for result, tokens in results:
        weight = tokens / len(result.chunk_times)
        for t in result.chunk_times:
            buckets[int(t - start)] += weight
    if not buckets:
        return []
    return [buckets.get(i, 0.0) for i in range(max(buckets) + 1)]


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (send to end of response), exactly."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.end_time, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def compute_metrics(records: list[RequestRecord], duration: float, start: float, percentiles: list[float],
                    tokenizer: Tokenizer | None = None, goodput_slos: dict[str, float] | None = None,
                    cost: CostModel | None = None) -> dict[str, Any]:
    succeeded = [r.result for r in records if r.result.success]
    failed = [r.result for r in records if not r.result.success]
    input_lens = [r.result.prompt_tokens if r.result.prompt_tokens is not None else r.prompt_len
                  for r in records if r.result.success]
    output_lens = [_output_tokens(r, tokenizer) for r in succeeded]
    ttfts = [r.ttft for r in succeeded]
    e2els = [r.latency for r in succeeded]
    # TPOT excludes the first token; a one-token reply has none (vLLM leaves it out of the TPOT stats).
    tpots_by_request = [(r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
                        for r, n in zip(succeeded, output_lens, strict=True)]
    tpots = [t for t, n in zip(tpots_by_request, output_lens, strict=True) if n > 1]
    itls = [gap for r in succeeded for gap in r.itl]

    total_input, total_output = sum(input_lens), sum(output_lens)
    duration = max(duration, 1e-9)
    per_second = output_tokens_per_second(list(zip(succeeded, output_lens, strict=True)), start)

    slos = goodput_slos or {}
    good = sum(
        all(value * 1000.0 <= slos[name] for name, value in
            (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)) if name in slos)
        for ttft, tpot, e2el in zip(ttfts, tpots_by_request, e2els, strict=True)
    )

    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(succeeded),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(succeeded) / duration,
        "request_goodput": good / duration if slos else None,
        "goodput": good / duration if slos else None,
        "goodput_slos_ms": slos or None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "peak_output_throughput": max(per_second, default=0.0),
        "max_output_tokens_per_s": max(per_second, default=0.0),
        "peak_concurrency": peak_concurrency([r.result for r in records]),
        "max_concurrent_requests": peak_concurrency([r.result for r in records]),
        "cost_per_1m_output_tokens_usd": None,
        "cost_per_1m_total_tokens_usd": None,
        "errors": dict(Counter(r.error_key for r in failed).most_common()),
    }
    if cost is not None:
        usd_per_second = cost.usd_per_hour * cost.instances / 3600.0
        for key, throughput in (("cost_per_1m_output_tokens_usd", metrics["output_throughput"]),
                                ("cost_per_1m_total_tokens_usd", metrics["total_token_throughput"])):
            metrics[key] = usd_per_second / throughput * 1e6 if throughput > 0 else None
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_latency_stats(name, values, percentiles))
    metrics.update({
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": ttfts,
        "tpots": tpots,
        "itls": itls,
        "e2els": e2els,
        "output_throughput_per_second": per_second,
    })
    return metrics
