"""`ember bench {serve,sweep,offline}`: load generator against any OpenAI-compatible server, and the
offline engine benchmark."""

from __future__ import annotations

import argparse
import math

from ember.bench import API_PATHS
from ember.bench.datasets import DATASET_NAMES, SHAREGPT_HELP


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="server root, without /v1 (default: %(default)s); ember, vLLM, SGLang, "
                            "llama.cpp or the ember gateway")
    group.add_argument("--api", choices=tuple(API_PATHS), default="completions",
                       help="completions: /v1/completions with a text prompt; chat: /v1/chat/completions "
                            "(default: %(default)s)")
    group.add_argument("--model", default=None,
                       help="model name sent in each request (default: the first one /v1/models lists)")
    group.add_argument("--tokenizer", default=None,
                       help="alias, Hugging Face folder or .gguf whose tokenizer counts tokens "
                            "(default: the --model value)")
    group.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    group.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds to wait for the connection (at most 30) or for more of a response before "
                            "the request counts as failed with a timeout (default: %(default)s)")
    group.add_argument("--extra-body", default=None,
                       help='JSON object merged into every request body, e.g. \'{"top_k": 1}\'')


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                       help="random: exact token lengths; shared-prefix: groups sharing a long prefix; "
                            "sharegpt: a local ShareGPT JSON; multi-turn: sessions whose history grows "
                            "(default: %(default)s)")
    group.add_argument("--dataset-path", default=None, help=f"for sharegpt: {SHAREGPT_HELP}")
    group.add_argument("--num-prompts", type=int, default=100,
                       help="measured requests (multi-turn: sessions) (default: %(default)s)")
    group.add_argument("--input-len", default="256",
                       help="prompt tokens, N or LO:HI drawn uniformly; shared-prefix: tokens after the "
                            "prefix; multi-turn: tokens of each new user message (default: %(default)s)")
    group.add_argument("--output-len", default="128",
                       help="max_tokens, N or LO:HI drawn uniformly (default: %(default)s)")
    group.add_argument("--num-groups", type=int, default=4,
                       help="shared-prefix: number of distinct shared prefixes (default: %(default)s)")
    group.add_argument("--prefix-len", type=int, default=512,
                       help="shared-prefix: tokens of each shared prefix (default: %(default)s)")
    group.add_argument("--turns", type=int, default=4,
                       help="multi-turn: user turns per session (default: %(default)s)")
    group.add_argument("--sharegpt-output-len", type=int, default=None,
                       help="sharegpt: fixed max_tokens instead of each reference reply's length")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                       help="ask the server to generate exactly max_tokens (default: on for random and "
                            "shared-prefix, off for sharegpt and multi-turn)")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of prompts, lengths and arrival times; change it between runs against "
                            "the same server so its prefix cache sees fresh prompts (default: %(default)s)")
    group.add_argument("--num-warmups", type=int, default=0,
                       help="unmeasured requests (with their own prompts) sent first (default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second; inf sends all at once (default: %(default)s)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier "
                           "(default: %(default)s)")


def _add_measure_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("measurement")
    group.add_argument("--percentiles", default="50,90,99",
                       help="comma-separated latency percentiles to report; 99 always included "
                            "(default: %(default)s)")
    group.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                       help="SLOs for goodput (requests/s meeting all of them): ttft:MS tpot:MS e2el:MS")
    group.add_argument("--cost-per-hour", type=float, default=None,
                       help="price of one serving machine in USD/hour, for cost per 1M tokens")
    group.add_argument("--instances", type=int, default=1,
                       help="machines behind --base-url, multiplying --cost-per-hour (default: %(default)s)")
    group.add_argument("--json", default=None, help="write the result(s) to this JSON file")
    group.add_argument("--disable-progress", action="store_true", help="no live progress bar")


def _run_serve(args: argparse.Namespace) -> int:
    from ember.bench.serve import run_serve

    return run_serve(args)


def _run_sweep(args: argparse.Namespace) -> int:
    from ember.bench.sweep import run_sweep

    return run_sweep(args)


def _run_offline(args: argparse.Namespace) -> int:
    from ember.bench.offline import run_offline

    return run_offline(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark a server (serve, sweep) or the engine in-process (offline)",
        description="Measure TTFT, TPOT, ITL, throughput, goodput and cost per token.")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    serve = commands.add_parser(
        "serve", help="one streamed load run against an OpenAI-compatible server",
        description="Stream requests to an OpenAI-compatible server and report vLLM's serving metrics. "
                    "Ctrl-C stops the run and prints the partial result.")
    _add_target_args(serve)
    _add_workload_args(serve)
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="most requests in flight at once (default: unlimited)")
    _add_measure_args(serve)
    serve.add_argument("--plot", default=None,
                       help="PNG with the TTFT and TPOT distributions and output tok/s over time")
    serve.set_defaults(func=_run_serve)

    sweep = commands.add_parser(
        "sweep", help="one run per concurrency or request rate; the latency-throughput curve",
        description="Run `bench serve` once per point (fresh prompts each) and plot TTFT and TPOT "
                    "(p50, p99) against output throughput.")
    _add_target_args(sweep)
    _add_workload_args(sweep)
    sweep.add_argument("--concurrency", default=None, help="comma-separated max concurrencies, e.g. 1,2,4,8,16,32")
    sweep.add_argument("--request-rates", default=None, help="comma-separated request rates (req/s), e.g. 1,2,4")
    sweep.set_defaults(max_concurrency=None)
    _add_measure_args(sweep)
    sweep.add_argument("--plot", default=None, help="PNG of TTFT and TPOT p50/p99 against output tok/s")
    sweep.set_defaults(func=_run_sweep)

    offline = commands.add_parser(
        "offline", help="in-process engine throughput on a random workload, optionally against transformers",
        description="Generate a random-length workload (ignore_eos) with ember's offline LLM and report "
                    "output tokens/s, total tokens/s and requests/s; --baseline hf runs the same workload "
                    "through Hugging Face transformers one request at a time and in padded static batches.")
    from ember.engine.args import EngineArgs

    EngineArgs.add_cli_args(offline)
    workload = offline.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=int, default=64, help="requests (default: %(default)s)")
    workload.add_argument("--input-len", default="64:512",
                          help="prompt tokens, N or LO:HI drawn uniformly (default: %(default)s)")
    workload.add_argument("--output-len", default="64:256",
                          help="generated tokens, N or LO:HI drawn uniformly (default: %(default)s)")
    workload.add_argument("--baseline", choices=("hf",), default=None,
                          help="hf: also run transformers on the same weights, sequentially and in padded "
                               "static batches of --max-num-seqs, and print the ratios")
    workload.add_argument("--json", default=None, help="write the results to this JSON file")
    offline.set_defaults(func=_run_offline)
