"""Live autoscaling benchmark (issue 13): the same seeded bursty trace through the gateway of a static
2-replica fleet, then of an autoscaled min 0 / max 2 fleet, back to back, both started with `ember up`.

    flock /work/notes/bench.lock env PYTHONPATH=$PWD python benchmarks/autoscaling/live_bursty.py \
        --out benchmarks/results/2026-12-04-autoscaling-live

The model is the tests' tiny random-weight Llama (SmolLM2's tokenizer) unless `--model` names another
(a folder or a GGUF file, e.g. SmolLM2-135M-Instruct Q4_1 with `--dtype bfloat16`), one thread per
replica. With `--profile` (an `ember profile` file of that model on this machine), the autoscaled fleet's
policy also checks each scale down against the profile's throughput and step-time model. The
trace comes from the simulator's Poisson generator (`poisson_arrivals`): `--base-rate` requests/s, and
`--burst-rate` for `--burst-s` in the middle of every `--period-s`. Requests go out through the
project's bench client (`ember.bench.runner`, streamed chat completions, EOS ignored) at their trace
times. A request meets the SLO when it succeeds, its TTFT is within `--ttft-ms` and its mean
inter-token latency within `--itl-ms` (the same objectives the autoscaled fleet's policy gets).

Replica-seconds count the trace's window only (first request sent to last response read): for the
static fleet 2 x that window, for the autoscaled one the growth of `ember_autoscaler_replica_seconds_total`
over it (loading, ready and draining replicas; standby processes that wait to serve are not replicas).
Cold starts: the autoscaler's `cold_start_s` of every replica (process activation to admission by
the gateway) and, for the scale from zero, the first request's time to first token (it arrives with
no replica running).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ember.bench.datasets import Conversation, Turn
from ember.bench.runner import RunSettings, run_benchmark
from ember.control.autoscaling.simulator import poisson_arrivals
from tests.conftest import build_tiny_model_dir, stop_process

KEY = "sk-ember-local"
KEY_SHA256 = "0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271"
CAPACITY = 4  # concurrent requests the gateway sends one replica, in both fleets
SERVE_ARGS = [
    "--kv-cache-memory",
    "0.05",
    "--max-model-len",
    "512",
    "--num-threads",
    "1",
]
PROMPT_WORDS = 48


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def serve_args(args: argparse.Namespace) -> list[str]:
    return ["--dtype", args.dtype, *SERVE_ARGS]


def fleet_config(
    args: argparse.Namespace, model_dir: Path, autoscaled: bool, gateway_port: int, control_port: int
) -> dict:
    model: dict = {"deployments": [{"replicas": []}]}
    launch: dict = {"gateway": {"port": gateway_port}, "shutdown_timeout_s": 60}
    if autoscaled:
        model["autoscaling"] = {
            "min_replicas": 0, "max_replicas": 2, "ttft_p90_ms": args.ttft_ms, "itl_p90_ms": args.itl_ms,
            "scale_down_delay_s": args.scale_down_delay_s, "scale_to_zero_after_s": args.scale_to_zero_after_s,
            "stable_window_s": args.stable_window_s, "panic_window_s": 2, "hold_limit": 256,
        }  # fmt: skip
        autoscaled_model = {"model": str(model_dir), "capacity": CAPACITY, "args": serve_args(args)}
        if args.profile is not None:
            autoscaled_model["profile"] = str(args.profile.resolve())
        launch["autoscaled"] = {"tiny": autoscaled_model}
        launch["autoscaler"] = {"interval_s": 1.0, "port": control_port}
    else:
        ports = [free_port(), free_port()]
        model["deployments"][0]["replicas"] = [
            {"url": f"http://127.0.0.1:{port}", "capacity": CAPACITY} for port in ports
        ]
        launch["replicas"] = [{"port": port, "model": str(model_dir), "args": serve_args(args)} for port in ports]
    return {
        "models": {"tiny": model},
        "keys": {"inline": [{"name": "bench", "sha256": KEY_SHA256}]},
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "unhealthy_threshold": 2},
        "queue": {"default_deadline_ms": 120_000},
        "launch": launch,
    }


class Fleet:
    """`ember up` on a written fleet file, its output kept for the record."""

    def __init__(self, path: Path, config: dict, log: Path):
        path.write_text(yaml.safe_dump(config))
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "up", str(path)], stdout=self.log, stderr=subprocess.STDOUT
        )
        self.gateway = f"http://127.0.0.1:{config['launch']['gateway']['port']}"

    def wait_ready(self, ready_replicas: int, control: str | None, limit_s: float = 300.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"ember up exited with {self.process.returncode}; see {self.log.name}")
            try:
                health = httpx.get(self.gateway + "/health", timeout=2).status_code == 200
                if control is not None:
                    ready = health and httpx.get(control + "/status", timeout=2).status_code == 200
                else:
                    text = httpx.get(self.gateway + "/metrics", timeout=2).text
                    ready = (
                        health
                        and metric(text, "ember_gateway_replica_healthy", model="tiny") >= ready_replicas
                    )
                if ready:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the fleet was not ready after {limit_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        stop_process(self.process, 180)
        self.log.close()


class ReplicaTimeline:
    """The autoscaler's replica counts by state, sampled every second while the trace runs."""

    def __init__(self, control: str):
        self.control = control
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                text = httpx.get(self.control + "/metrics", timeout=2).text
            except httpx.HTTPError:
                continue
            counts = {
                state: metric(text, "ember_autoscaler_current_replicas", model="tiny", state=state)
                for state in ("loading", "ready", "draining")
            }
            self.samples.append((round(time.monotonic() - start, 1), counts))

    def __enter__(self) -> ReplicaTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def trace(args: argparse.Namespace) -> tuple[list[float], list[Conversation]]:
    burst_from = (args.period_s - args.burst_s) / 2

    def rate_at(t: float) -> float:
        return (
            args.burst_rate if burst_from <= t % args.period_s < burst_from + args.burst_s else args.base_rate
        )

    arrivals = poisson_arrivals(rate_at, args.duration_s, args.seed, output_tokens=args.output_tokens)
    conversations = [
        Conversation((Turn(" ".join(f"word{(index + k) % 97}" for k in range(PROMPT_WORDS)), PROMPT_WORDS, a.output_tokens),))
        for index, a in enumerate(arrivals)
    ]  # fmt: skip
    return [a.time_s for a in arrivals], conversations


def run_fleet(args: argparse.Namespace, model_dir: Path, autoscaled: bool, workdir: Path) -> dict:
    name = "autoscaled" if autoscaled else "static"
    gateway_port, control_port = free_port(), free_port()
    control = f"http://127.0.0.1:{control_port}" if autoscaled else None
    config = fleet_config(args, model_dir, autoscaled, gateway_port, control_port)
    fleet = Fleet(workdir / f"fleet-{name}.yaml", config, args.out / f"{name}-ember-up.log")
    try:
        fleet.wait_ready(2, control)
        offsets, conversations = trace(args)
        settings = RunSettings(
            base_url=fleet.gateway, model="tiny", api="chat", api_key=KEY, ignore_eos=True,
            request_timeout=180.0, show_progress=False,
        )  # fmt: skip
        before = httpx.get(control + "/metrics", timeout=5).text if control else ""
        timeline = ReplicaTimeline(control) if control else None
        with timeline or _nothing():
            wall_start = time.monotonic()
            outcome = asyncio.run(run_benchmark(settings, conversations, offsets))
            window_s = time.monotonic() - wall_start
        results = [record.result for record in outcome.records]
        if control:
            after = httpx.get(control + "/metrics", timeout=5).text
            status = httpx.get(control + "/status", timeout=5).json()
            seconds = "ember_autoscaler_replica_seconds_total"
            replica_seconds = metric(after, seconds, model="tiny") - metric(before, seconds, model="tiny")
            cold_starts = [
                r["cold_start_s"] for r in status["models"]["tiny"]["replicas"] if r["cold_start_s"]
            ]
            cold_start_sum = metric(after, "ember_autoscaler_cold_start_seconds_sum", model="tiny")
            cold_start_count = metric(after, "ember_autoscaler_cold_start_seconds_count", model="tiny")
            scale_events = {
                direction: metric(
                    after, "ember_autoscaler_scale_events_total", model="tiny", direction=direction
                )
                for direction in ("up", "down")
            }
            decisions = status["decisions"]
        else:
            replica_seconds = 2 * window_s
            cold_starts, cold_start_sum, cold_start_count, scale_events, decisions = [], 0.0, 0.0, {}, []
    finally:
        fleet.stop()
    return summarise(args, name, results, window_s, replica_seconds, {
        "cold_starts_admission_s": cold_starts,
        "cold_start_mean_s": cold_start_sum / cold_start_count if cold_start_count else None,
        "cold_start_count": cold_start_count,
        "scale_events": scale_events,
        "decisions": decisions,
        "replica_timeline": timeline.samples if timeline else [],
    })  # fmt: skip


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def summarise(
    args: argparse.Namespace, name: str, results: list, window_s: float, replica_seconds: float, extra: dict
) -> dict:
    def within(result) -> bool:  # noqa: ANN001
        mean_itl = statistics.fmean(result.itl) if result.itl else 0.0
        return result.success and result.ttft * 1000 <= args.ttft_ms and mean_itl * 1000 <= args.itl_ms

    ok = [r for r in results if r.success]
    ttfts = sorted(r.ttft for r in ok)
    itls = sorted(x for r in ok for x in r.itl)
    first = min(results, key=lambda r: r.start_time) if results else None
    errors: dict[str, int] = {}
    for result in results:
        if not result.success:
            errors[result.error_key] = errors.get(result.error_key, 0) + 1
    return {
        "fleet": name,
        "requests": len(results),
        "succeeded": len(ok),
        "errors": errors,
        "slo_attainment": sum(map(within, results)) / len(results) if results else 0.0,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "itl_p90_s": itls[int(0.9 * (len(itls) - 1))] if itls else None,
        "window_s": window_s,
        "replica_seconds": replica_seconds,
        "first_request_ttft_s": first.ttft if first is not None and first.success else None,
        **extra,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="Folder for the JSON result and the fleets' logs"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="The replicas' model, a folder or a GGUF file (default: the tests' tiny model, built here)",
    )
    parser.add_argument(
        "--dtype", default="float32", help="The replicas' --dtype (default float32, as the tiny model's)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="An `ember profile` file of the model on this machine, for the autoscaled fleet's policy",
    )
    parser.add_argument("--duration-s", type=float, default=600.0, help="Trace length (default 600)")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the trace (default 0)")
    parser.add_argument(
        "--base-rate", type=float, default=0.3, help="Requests/s between bursts (default 0.3)"
    )
    parser.add_argument("--burst-rate", type=float, default=4.0, help="Requests/s in a burst (default 4)")
    parser.add_argument("--burst-s", type=float, default=60.0, help="Length of a burst (default 60)")
    parser.add_argument("--period-s", type=float, default=300.0, help="One burst per period (default 300)")
    parser.add_argument("--output-tokens", type=int, default=32, help="Tokens per reply (default 32)")
    parser.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT objective (default 2000)")
    parser.add_argument(
        "--itl-ms", type=float, default=200.0, help="Mean inter-token latency objective (default 200)"
    )
    parser.add_argument(
        "--scale-down-delay-s", type=float, default=10.0, help="Autoscaled fleet (default 10)"
    )
    parser.add_argument(
        "--scale-to-zero-after-s", type=float, default=60.0, help="Autoscaled fleet (default 60)"
    )
    parser.add_argument("--stable-window-s", type=float, default=10.0, help="Autoscaled fleet (default 10)")
    parser.add_argument("--only", choices=("static", "autoscaled"), default=None, help="Run one fleet only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ember-live-bursty-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model or build_tiny_model_dir(workdir / "tiny-model")
        reports = []
        for autoscaled in (False, True):
            if args.only in (None, "autoscaled" if autoscaled else "static"):
                reports.append(run_fleet(args, model_dir, autoscaled, workdir))
                print(
                    json.dumps(
                        {k: v for k, v in reports[-1].items() if k not in ("decisions", "replica_timeline")}
                    )
                )
    (args.out / "live_bursty.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "reports": reports}, indent=1)
    )
    if len(reports) == 2:
        static, scaled = reports
        print(f"SLO attainment: static {static['slo_attainment']:.1%}, autoscaled {scaled['slo_attainment']:.1%}; "
              f"replica-seconds: static {static['replica_seconds']:.0f}, autoscaled {scaled['replica_seconds']:.0f} "
              f"({1 - scaled['replica_seconds'] / static['replica_seconds']:.0%} fewer)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
