"""Console table in `vllm bench serve`'s layout, and the JSON result file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ember.bench.metrics import percentile_key

_METRIC_HEADERS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_result(result: dict[str, Any], percentiles: list[float]) -> str:
    """The result table; `result` holds compute_metrics' keys plus the run's settings."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    if result.get("interrupted"):
        lines.append(f"{' (interrupted: partial result) ':-^50}")
    lines.append(_row("Successful requests:", result["completed"]))
    lines.append(_row("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    if not math.isinf(result.get("request_rate", math.inf)):
        lines.append(_row("Request rate configured (RPS):", float(result["request_rate"])))
    lines.append(_row("Benchmark duration (s):", float(result["duration"])))
    lines.append(_row("Total input tokens:", result["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", result["request_throughput"]))
    if result.get("goodput") is not None:
        lines.append(_row("Request goodput (req/s):", result["goodput"]))
    lines.append(_row("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_row("Peak output token throughput (tok/s):", float(result["peak_output_throughput"])))
    lines.append(_row("Peak concurrent requests:", float(result["peak_concurrency"])))
    lines.append(_row("Total Token throughput (tok/s):", result["total_token_throughput"]))
    if result.get("cost_per_1m_output_tokens_usd") is not None:
        lines.append(_row("Cost per 1M output tokens (USD):", result["cost_per_1m_output_tokens_usd"]))
        lines.append(_row("Cost per 1M total tokens (USD):", result["cost_per_1m_total_tokens_usd"]))
    for key, name, header in _METRIC_HEADERS:
        lines.append(f"{header:-^50}")
        lines.append(_row(f"Mean {name} (ms):", result[f"mean_{key}_ms"]))
        lines.append(_row(f"Median {name} (ms):", result[f"median_{key}_ms"]))
        for p in percentiles:
            label = percentile_key(p).upper()
            lines.append(_row(f"{label} {name} (ms):", result[f"{percentile_key(p)}_{key}_ms"]))
    if result.get("errors"):
        lines.append(f"{'Errors':-^50}")
        for message, count in result["errors"].items():
            lines.append(f"{count:>6} x {message}")
    lines.append("=" * 50)
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
