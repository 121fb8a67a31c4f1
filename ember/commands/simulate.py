"""`ember simulate fleet.yaml --model M --profile P.json --trace T`: one autoscaled model's policy
replayed over simulated replicas (ember.control.autoscaling.simulator)."""

from __future__ import annotations

import argparse

from ember.errors import EmberError

GENERATED_TRACES = ("steady", "bursty", "diurnal")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="Replay a trace through an autoscaled model's policy over simulated replicas",
        description="Replay arrivals through the autoscaling policy of one model of a fleet file over simulated "
        "replicas whose speed a profile gives; print SLO attainment, replica-seconds, cost and scale events.",
    )
    parser.add_argument("fleet", help="Fleet file with the model's autoscaling section")
    parser.add_argument("--model", required=True, help="The autoscaled model (its name under models:)")
    parser.add_argument(
        "--profile", required=True,
        help="JSON file: prefill_tokens_per_s, decode_step_s, decode_step_per_seq_s, max_batch, cold_start_s",
    )  # fmt: skip
    parser.add_argument(
        "--trace", default="bursty",
        help="steady | bursty (10x the rate for 60 s every 300 s) | diurnal (0.1x..1x over --duration-s) | a JSONL "
        "file of {time_s, prompt_tokens, output_tokens} (default: bursty)",
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=1.0, help="Requests/s of the generated traces (default 1)")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="Simulated seconds (default 3600)")
    parser.add_argument("--interval-s", type=float, default=2.0, help="Decision interval (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pydantic import ValidationError

    from ember.control.autoscaling import simulator
    from ember.gateway.config import load_config, validation_message

    config = load_config(args.fleet).models.get(args.model)
    if config is None or config.autoscaling is None:
        raise EmberError(f"{args.fleet}: models.{args.model} has no autoscaling section")
    try:
        profile = simulator.ReplicaProfile.model_validate_json(Path(args.profile).read_text(encoding="utf-8"))
    except OSError as exc:
        raise EmberError(f"cannot read {args.profile}: {exc.strerror or exc}") from None
    except ValidationError as exc:
        raise EmberError(validation_message(args.profile, exc)) from None
    if args.trace == "steady":
        arrivals = simulator.steady(args.rate, args.duration_s, args.seed)
    elif args.trace == "bursty":
        arrivals = simulator.bursty(args.rate, 10 * args.rate, 60, 240, args.duration_s, args.seed)
    elif args.trace == "diurnal":
        arrivals = simulator.diurnal(0.1 * args.rate, args.rate, args.duration_s, args.duration_s, args.seed)
    else:
        arrivals = simulator.load_trace(args.trace)
    report = simulator.FleetSimulator(config.autoscaling, profile, interval_s=args.interval_s).run(arrivals, args.duration_s)
    print(f"requests {report.requests}, served {report.served}, SLO attainment {report.slo_attainment:.1%}")
    print(f"replica-hours {report.replica_seconds / 3600:.2f}, cost {report.cost:.4f}, "
          f"cost per 1M output tokens {report.cost_per_million_tokens:.4f}")  # fmt: skip
    print(f"cold starts {report.cold_starts}, scale events {report.scale_events}, flaps {report.flaps}")
    for at, current, desired, reason in report.decisions:
        print(f"  t={at:8.1f}s  {current} -> {desired}  {reason}")
    return 0
