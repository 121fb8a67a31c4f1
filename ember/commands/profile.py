"""`ember profile --model M -o profile.json`: measure one replica's speed on this machine for
`ember simulate --profile` (ember.control.autoscaling.profiler)."""

from __future__ import annotations

import argparse

from ember.engine.args import KV_CACHE_DTYPE_CHOICES
from ember.errors import EmberError


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="Measure a model's TTFT by prompt length and decode step by batch size; write a simulator profile",
        description="Measure on this machine (offline, LLM API) TTFT against prompt length and the decode step "
        "against batch size, fit the simulator's replica model to them and write it as JSON.",
    )
    parser.add_argument("--model", required=True, help="Model directory or registry name")
    parser.add_argument("-o", "--output", default="profile.json", help="The profile file (default profile.json)")
    parser.add_argument("--prompt-lengths", type=_sizes, default=[64, 256, 1024], help="default 64,256,1024")
    parser.add_argument("--batch-sizes", type=_sizes, default=[1, 4, 16], help="default 1,4,16 (the largest is "
                        "the profile's max_batch)")  # fmt: skip
    parser.add_argument("--decode-tokens", type=int, default=16, help="Tokens per decode measurement (default 16)")
    parser.add_argument("--cost-per-replica-hour", type=float, default=None, help="This hardware's price")
    parser.add_argument("--dtype", default="auto", help="weights dtype, as ember serve --dtype (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output the profile measures (default: the model's, capped)")
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="GiB")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="as ember serve --kv-cache-dtype: profile the replicas' own (default: %(default)s)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads, as ember serve --num-threads "
                        "(default: one per core); profile with the replicas' own count")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ember.control.autoscaling.profiler import profile_model

    if args.decode_tokens < 2:
        raise EmberError("--decode-tokens must be at least 2 (a step time needs two tokens)")
    engine_args = {
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "num_threads": args.num_threads,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    profile = profile_model(
        args.model, args.prompt_lengths, args.batch_sizes, args.decode_tokens, args.cost_per_replica_hour,
        dtype=args.dtype, **{key: value for key, value in engine_args.items() if value is not None},
    )  # fmt: skip
    Path(args.output).write_text(profile.model_dump_json(indent=2) + "\n", encoding="utf-8")
    print(f"prefill {profile.prefill_tokens_per_s:.0f} tokens/s, decode step {profile.decode_step_s * 1000:.2f} ms "
          f"+ {profile.decode_step_per_seq_s * 1000:.3f} ms per further sequence, cold start {profile.cold_start_s:.1f} s")
    print(f"wrote {args.output}")
    return 0
