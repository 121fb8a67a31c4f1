"""`ember bench sweep`: one `bench serve` run per concurrency (or request rate), then the trade-off curve.

Each point gets fresh prompts (seed + point index) so a prefix cache cannot reuse an earlier point's work."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from ember.bench.plot import plot_sweep
from ember.bench.report import write_json
from ember.bench.serve import ServeBenchmark, json_safe, run_settings
from ember.errors import EmberError

# (header, result key, width, format spec)
_SUMMARY_COLUMNS = (
    ("point", "sweep_label", 10, ""),
    ("ok", "completed", 5, ""),
    ("fail", "failed", 5, ""),
    ("out tok/s", "output_throughput", 10, ".1f"),
    ("req/s", "request_throughput", 7, ".2f"),
    ("TTFT p50", "median_ttft_ms", 9, ".0f"),
    ("TTFT p99", "p99_ttft_ms", 9, ".0f"),
    ("TPOT p50", "median_tpot_ms", 9, ".1f"),
    ("TPOT p99", "p99_tpot_ms", 9, ".1f"),
)


def parse_points(text: str, what: str, cast: type) -> list:
    try:
        points = [cast(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise EmberError(f"{what} takes comma-separated numbers, got {text!r}") from None
    if not points or any(not p > 0 for p in points):
        raise EmberError(f"{what} needs positive values, got {text!r}")
    return points


def summary_table(results: list[dict[str, Any]]) -> str:
    header = " ".join(f"{name:>{width}}" for name, _, width, _ in _SUMMARY_COLUMNS)
    rows = [" ".join(f"{r[key]:>{width}{spec}}" for _, key, width, spec in _SUMMARY_COLUMNS) for r in results]
    return "\n".join([header, *rows])


def run_sweep(args: argparse.Namespace) -> int:
    if (args.concurrency is None) == (args.request_rates is None):
        raise EmberError("give exactly one of --concurrency C1,C2,... or --request-rates R1,R2,...")
    bench = ServeBenchmark(args)
    base = run_settings(args, bench.model)
    if args.concurrency is not None:
        points = [(f"c={c}", dataclasses.replace(base, max_concurrency=c, request_rate=math.inf))
                  for c in parse_points(args.concurrency, "--concurrency", int)]
    else:
        points = [(f"{r:g} rps", dataclasses.replace(base, request_rate=r))
                  for r in parse_points(args.request_rates, "--request-rates", float)]
    results: list[dict[str, Any]] = []
    for index, (label, settings) in enumerate(points):
        print(f"--- sweep point {index + 1}/{len(points)}: {label}", flush=True)
        result = bench.run(settings, args.seed + index)
        result["sweep_label"] = label
        results.append(result)
        print(summary_table([result]).splitlines()[1], flush=True)
        if result["interrupted"]:
            print("interrupted: the sweep stops here", flush=True)
            break
    print(summary_table(results))
    if args.json:
        write_json(Path(args.json), [json_safe(r) for r in results])
    if args.plot:
        plot_sweep(results, Path(args.plot), title=f"{bench.model} @ {args.base_url}")
    return 130 if results and results[-1]["interrupted"] else 0
