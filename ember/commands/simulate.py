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
    parser.add_argument("--seed", type=int, default=0, help="random seed of the arrival generator (default: %(default)s)")
    scale = parser.add_argument_group(
        "at scale", "--at-scale: the fluid simulator (thousands of replicas, the fleet file's regions, days); "
        "--rate is then the peak of the whole fleet, and diurnal has a 24 h period"
    )  # fmt: skip
    scale.add_argument("--at-scale", action="store_true", help="Aggregate replica groups per region (fleet_scale.py)")
    scale.add_argument(
        "--policy", choices=("ember", "static", "knative", "all"), default="ember",
        help="ember (the autoscaling section), static (each region's Ember peak, all day), knative (a KPA-style "
        "concurrency target), all (the three, compared)",
    )  # fmt: skip
    scale.add_argument("--hardware", action="append", default=[], metavar="PROFILE",
                       help="Further profiles (with cost_per_replica_hour) to compare under Ember's policy")
    scale.add_argument("--plot", metavar="PNG", help="Timeline: load, replicas, p90 TTFT (needs matplotlib)")
    scale.add_argument("--initial-replicas", type=int, default=None, help="Per region at t=0 (default min)")
    scale.add_argument("--slo-target", type=float, default=0.99, help="Attainment a hardware must reach (0.99)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pydantic import ValidationError

    from ember.control.autoscaling import simulator
    from ember.control.autoscaling.replica_profile import ReplicaProfile
    from ember.gateway.config import load_config, validation_message

    config = load_config(args.fleet).models.get(args.model)
    if config is None or config.autoscaling is None:
        raise EmberError(f"{args.fleet}: models.{args.model} has no autoscaling section")
    def read_profile(path: str) -> ReplicaProfile:
        try:
            return ReplicaProfile.model_validate_json(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise EmberError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValidationError as exc:
            raise EmberError(validation_message(path, exc)) from None

    profile = read_profile(args.profile)
    if args.at_scale:
        return _run_at_scale(args, load_config(args.fleet), config.autoscaling, profile, [read_profile(p) for p in args.hardware])
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


def _run_at_scale(args: argparse.Namespace, fleet, autoscaling, profile, hardware: list) -> int:  # noqa: ANN001
    from ember.control.autoscaling import fleet_scale

    names = sorted(fleet.regions) or ["default"]
    regions = [fleet_scale.Region(name, 1 / len(names)) for name in names]
    if args.trace == "diurnal":
        rate_at = fleet_scale.diurnal_rate(0.1 * args.rate, args.rate)
    elif args.trace == "bursty":
        rate_at = fleet_scale.bursty_rate(0.1 * args.rate, args.rate)
    elif args.trace == "steady":
        rate_at = lambda t: args.rate  # noqa: E731
    else:
        raise EmberError("--at-scale takes the generated traces only: steady, bursty or diurnal")

    def simulate(policy: str, replica_profile, static: int = 0) -> fleet_scale.ScaleReport:  # noqa: ANN001
        simulated = fleet_scale.ScaleSimulator(
            autoscaling, replica_profile, regions, fleet, interval_s=args.interval_s
        )
        policies = fleet_scale.policies_for(policy, autoscaling, replica_profile, len(regions), args.interval_s, static)
        return simulated.run(rate_at, args.duration_s, policies, args.seed, static or args.initial_replicas)

    reports = {"ember": simulate("ember", profile)}
    if args.policy in ("knative", "all"):
        reports["knative"] = simulate("knative", profile)
    if args.policy in ("static", "all"):
        reports["static"] = simulate("static", profile, -(-reports["ember"].peak_replicas // len(regions)))
    if args.policy not in ("ember", "all"):
        del reports["ember"]
    print(f"{len(regions)} region(s): {', '.join(names)}; {args.duration_s / 3600:g} h of {args.trace}, peak {args.rate:g} req/s")
    for name, report in reports.items():
        print(f"{name}: SLO attainment {report.slo_attainment:.2%}, replica-hours {report.replica_hours:.1f}, "
              f"cost {report.cost:.2f}, cost per 1M output tokens {report.cost_per_million_tokens:.4f}, peak "
              f"{report.peak_replicas} replicas, cold starts {report.cold_starts}, scale events {report.scale_events}, "
              f"flaps {report.flaps}")  # fmt: skip
    if hardware:
        candidates = [(profile, reports.get("ember") or simulate("ember", profile))]
        candidates += [(other, simulate("ember", other)) for other in hardware]
        for other, report in candidates:
            print(f"hardware {other.model or '?'}: SLO {report.slo_attainment:.2%}, cost {report.cost:.2f}, "
                  f"peak {report.peak_replicas} replicas")  # fmt: skip
        meeting = [(report.cost, other.model or "?", report) for other, report in candidates
                   if report.slo_attainment >= args.slo_target]  # fmt: skip
        if meeting:
            cost, model, report = min(meeting, key=lambda item: item[0])
            print(f"cheapest meeting {args.slo_target:.0%}: {model}, cost {cost:.2f}, up to {report.peak_replicas} replicas")
        else:
            print(f"no hardware meets {args.slo_target:.0%} SLO attainment")
    if args.plot:
        fleet_scale.plot_timeline(reports, args.plot)
        print(f"wrote {args.plot}")
    return 0
