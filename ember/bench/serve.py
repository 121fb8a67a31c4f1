"""`ember bench serve`: one measured run against an OpenAI-compatible server.

The functions take the parsed command line (see ember/commands/bench.py for every flag)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ember.bench import datasets
from ember.bench.datasets import Conversation, LengthRange
from ember.bench.metrics import CostModel, compute_metrics, parse_goodput, parse_percentiles
from ember.bench.plot import plot_run
from ember.bench.report import format_result, write_json
from ember.bench.runner import RunSettings, run_benchmark, run_warmups
from ember.bench.tokenizer import load_bench_tokenizer
from ember.errors import EmberError
from ember.loader import Tokenizer


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=10.0, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EmberError(f"cannot list the served models at {url} ({exc}); pass --model") from None


def build_conversations(args: argparse.Namespace, tokenizer: Tokenizer, count: int,
                        seed: int) -> list[Conversation]:
    """`count` conversations of the chosen dataset (sessions, for multi-turn)."""
    name = args.dataset_name
    if name == "sharegpt":
        if not args.dataset_path:
            raise EmberError(f"--dataset-name sharegpt needs --dataset-path. {datasets.SHAREGPT_HELP}")
        return datasets.sharegpt_dataset(tokenizer, Path(args.dataset_path), count, seed,
                                         output_len=args.sharegpt_output_len)
    input_len = LengthRange.parse(args.input_len, "--input-len")
    output_len = LengthRange.parse(args.output_len, "--output-len")
    if name == "random":
        return datasets.random_dataset(tokenizer, count, input_len, output_len, seed)
    if name == "shared-prefix":
        return datasets.shared_prefix_dataset(tokenizer, count, args.num_groups, args.prefix_len,
                                              input_len, output_len, seed)
    if name == "multi-turn":
        return datasets.multi_turn_dataset(tokenizer, count, args.turns, input_len, output_len, seed)
    raise EmberError(f"unknown dataset {name!r}; choose one of {', '.join(datasets.DATASET_NAMES)}")


def run_settings(args: argparse.Namespace, model: str) -> RunSettings:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise EmberError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    ignore_eos = args.ignore_eos
    if ignore_eos is None:  # the synthetic datasets promise exact output lengths
        ignore_eos = args.dataset_name in ("random", "shared-prefix")
    try:
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as exc:
        raise EmberError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra_body, dict):
        raise EmberError("--extra-body must be a JSON object")
    return RunSettings(
        base_url=args.base_url, model=model, api=args.api, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        temperature=args.temperature, ignore_eos=ignore_eos, request_timeout=args.request_timeout,
        api_key=args.api_key, extra_body=extra_body, show_progress=not args.disable_progress,
    )


def cost_model(args: argparse.Namespace) -> CostModel | None:
    if args.cost_per_hour is None:
        return None
    if args.cost_per_hour < 0 or args.instances < 1:
        raise EmberError("--cost-per-hour must be >= 0 and --instances >= 1")
    return CostModel(args.cost_per_hour, args.instances)


class ServeBenchmark:
    """Everything a run needs that does not change between the points of a sweep."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = args.model or discover_model(args.base_url, args.api_key)
        self.tokenizer = load_bench_tokenizer(args.tokenizer or self.model)
        self.percentiles = parse_percentiles(args.percentiles)
        self.goodput = parse_goodput(args.goodput)
        self.cost = cost_model(args)
        if args.num_prompts < 1:
            raise EmberError(f"--num-prompts must be at least 1, got {args.num_prompts}")

    def run(self, settings: RunSettings, seed: int) -> dict[str, Any]:
        """Warm up, measure, and return the result dict (metrics plus the run's settings)."""
        args = self.args
        conversations = build_conversations(args, self.tokenizer, args.num_warmups + args.num_prompts, seed)
        warmups, measured = conversations[: args.num_warmups], conversations[args.num_warmups:]
        if warmups:
            failed = [r for r in asyncio.run(run_warmups(settings, warmups)) if not r.success]
            if failed:
                print(f"warning: {len(failed)} warmup request(s) failed, e.g. {failed[0].error_key}",
                      file=sys.stderr)
        outcome = asyncio.run(run_benchmark(settings, measured))
        result = compute_metrics(outcome.records, outcome.duration, outcome.start, self.percentiles,
                                 tokenizer=self.tokenizer, goodput_slos=self.goodput, cost=self.cost)
        return {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "base_url": settings.base_url,
            "model": settings.model,
            "api": settings.api,
            "dataset_name": args.dataset_name,
            "num_prompts": len(measured),
            "request_rate": settings.request_rate,
            "burstiness": settings.burstiness,
            "max_concurrency": settings.max_concurrency,
            "seed": seed,
            "ignore_eos": settings.ignore_eos,
            "temperature": settings.temperature,
            "interrupted": outcome.interrupted,
            "cancelled": outcome.cancelled,
            "skipped_turns": outcome.skipped_turns,
            **result,
        }


def json_safe(result: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: an unlimited request rate is written as the string "inf", as vLLM does."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in result.items()}


def run_serve(args: argparse.Namespace) -> int:
    bench = ServeBenchmark(args)
    result = bench.run(run_settings(args, bench.model), args.seed)
    print(format_result(result, bench.percentiles))
    if args.json:
        write_json(Path(args.json), json_safe(result))
    if args.plot:
        plot_run(result, Path(args.plot), title=f"{result['model']} @ {args.base_url}")
    return 130 if result["interrupted"] else 0
