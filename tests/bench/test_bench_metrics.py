"""Metric arithmetic on given timings (exact), goodput, cost, percentiles, and arrival processes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ember.bench.arrivals import arrival_offsets
from ember.bench.client import RequestResult
from ember.bench.metrics import (
    CostModel,
    RequestRecord,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    peak_concurrency,
)
from ember.errors import EmberError


def timed(start: float, chunk_offsets: list[float], output_tokens: int | None = None,
          prompt_tokens: int | None = 10) -> RequestResult:
    """A successful result whose content chunks arrived `chunk_offsets` seconds after `start`."""
    chunk_times = [start + t for t in chunk_offsets]
    return RequestResult(
        start_time=start, success=True, status=200, ttft=chunk_offsets[0], latency=chunk_offsets[-1],
        itl=[b - a for a, b in zip(chunk_offsets, chunk_offsets[1:], strict=False)],
        chunk_times=chunk_times, generated_text="x" * len(chunk_offsets),
        output_tokens=len(chunk_offsets) if output_tokens is None else output_tokens,
        prompt_tokens=prompt_tokens, end_time=chunk_times[-1] + 0.001)


def failed(start: float, status: int | None, error: str) -> RequestResult:
    return RequestResult(start_time=start, status=status, error=error, end_time=start + 0.01)


def test_latency_metrics_follow_vllm_definitions():
    a = timed(100.0, [0.2, 0.25, 0.30, 0.35, 0.40])  # TTFT 200 ms, 4 gaps of 50 ms
    b = timed(100.0, [0.4, 0.5, 0.6])  # TTFT 400 ms, 2 gaps of 100 ms
    c = timed(100.5, [0.3])  # a one-token reply has no TPOT
    records = [RequestRecord(r, prompt_len=10) for r in (a, b, c)]
    records.append(RequestRecord(failed(100.0, 500, "boom"), prompt_len=10))
    m = compute_metrics(records, duration=2.0, start=100.0, percentiles=[50.0, 99.0])
    assert m["completed"] == 3 and m["failed"] == 1 and m["errors"] == {"500: boom": 1}
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(19.5)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == pytest.approx(300.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([200, 400, 300], 99))
    assert m["tpots"] == pytest.approx([0.05, 0.1])
    assert m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["itls"] == pytest.approx([0.05] * 4 + [0.1] * 2)
    assert m["mean_itl_ms"] == pytest.approx(400.0 / 6)
    assert m["median_itl_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx((400 + 600 + 300) / 3)
    assert m["p50_e2el_ms"] == pytest.approx(400.0)
    # Output tokens per 1-second bucket: a and b land in second 0, c in second 0 too (100.8).
    assert m["output_throughput_per_second"] == [9.0]
    assert m["peak_output_throughput"] == 9.0 == m["max_output_tokens_per_s"]
    assert m["peak_concurrency"] == 3  # a, b and the failure overlap; c starts after a and b end


def test_usage_tokens_spread_over_chunks_and_fallbacks():
    # Two chunks carrying 4 tokens in all (e.g. a server that batches tokens per chunk).
    r = timed(0.0, [0.5, 1.5], output_tokens=4, prompt_tokens=None)
    m = compute_metrics([RequestRecord(r, prompt_len=7)], duration=2.0, start=0.0, percentiles=[99.0])
    assert m["output_lens"] == [4] and m["input_lens"] == [7]  # dataset length when no usage
    assert m["output_throughput_per_second"] == [2.0, 2.0]
    assert m["tpots"] == pytest.approx([1.0 / 3])


def test_goodput_counts_requests_meeting_every_slo():
    fast = timed(0.0, [0.1, 0.12, 0.14])  # TTFT 100, TPOT 20, E2E 140 ms
    slow_start = timed(0.0, [0.6, 0.62])  # TTFT 600, TPOT 20
    slow_decode = timed(0.0, [0.1, 0.4])  # TPOT 300
    records = [RequestRecord(r, 1) for r in (fast, slow_start, slow_decode)]
    m = compute_metrics(records, 2.0, 0.0, [99.0], goodput_slos=parse_goodput(["ttft:500", "tpot:100"]))
    assert m["goodput"] == pytest.approx(0.5) == m["request_goodput"]
    m = compute_metrics(records, 2.0, 0.0, [99.0], goodput_slos=parse_goodput(["e2el:150"]))
    assert m["goodput"] == pytest.approx(0.5)  # fast (140) only; the others end at 620 and 400 ms
    m = compute_metrics(records, 2.0, 0.0, [99.0], goodput_slos=parse_goodput(["ttft:1000"]))
    assert m["goodput"] == pytest.approx(1.5)


def test_cost_per_million_tokens():
    r = timed(0.0, [0.1 * i for i in range(1, 101)], prompt_tokens=300)  # 100 output tokens
    m = compute_metrics([RequestRecord(r, 300)], 1.0, 0.0, [99.0], cost=CostModel(3.6, instances=2))
    # $7.20/hour buys 3600 s x 100 tok/s = 360,000 output tokens: $20 per million; total 400 tok/s: $5.
    assert m["cost_per_1m_output_tokens_usd"] == pytest.approx(20.0)
    assert m["cost_per_1m_total_tokens_usd"] == pytest.approx(5.0)
    nothing = compute_metrics([RequestRecord(failed(0.0, 500, "x"), 1)], 1.0, 0.0, [99.0],
                              cost=CostModel(1.0))
    assert nothing["cost_per_1m_output_tokens_usd"] is None


def test_peak_concurrency_is_exact():
    runs = [failed(0.0, 500, "x") for _ in range(3)]
    runs[0].end_time, runs[1].start_time, runs[1].end_time = 1.0, 0.5, 2.0
    runs[2].start_time, runs[2].end_time = 1.0, 3.0  # starts as runs[0] ends: not concurrent with it
    assert peak_concurrency(runs) == 2


def test_option_parsing_errors_are_clear():
    assert parse_percentiles("50,90") == [50.0, 90.0, 99.0]
    for bad in ("abc", "0,50", "100"):
        with pytest.raises(EmberError, match="--percentiles"):
            parse_percentiles(bad)
    for bad in (["ttft"], ["latency:5"], ["tpot:x"], ["e2el:-1"]):
        with pytest.raises(EmberError, match="--goodput"):
            parse_goodput(bad)


def test_arrivals():
    assert arrival_offsets(4, math.inf, 1.0, seed=0) == [0.0] * 4
    offsets = arrival_offsets(4000, 20.0, 1.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(offsets) == 4000
    assert gaps.mean() == pytest.approx(0.05, rel=0.05)
    assert gaps.std() == pytest.approx(0.05, rel=0.1)  # Poisson: exponential gaps, std == mean
    steady = np.diff(arrival_offsets(4000, 20.0, 16.0, seed=1))
    assert steady.mean() == pytest.approx(0.05, rel=0.05) and steady.std() < 0.02
    assert arrival_offsets(10, 5.0, 1.0, seed=3) == arrival_offsets(10, 5.0, 1.0, seed=3)
    with pytest.raises(EmberError, match="--request-rate"):
        arrival_offsets(3, 0.0, 1.0, seed=0)
    with pytest.raises(EmberError, match="--burstiness"):
        arrival_offsets(3, 1.0, 0.0, seed=0)
