"""Rate-limit accuracy across gateways (docs/multi-cluster.md, Figures): do N gateways sharing their
limits through Redis admit what one gateway would, and what do N gateways with embedded state admit?

    flock /work/notes/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/gateway/rate_limit_accuracy.py \
        [--gateways 2] [--window-s 30] [--windows 3] [--json results.json]

Three runs, each on fresh `ember gateway` processes in front of the stub upstream (stub_upstream.py):
`shared` (N gateways, `state: shared` on PostgreSQL and Redis at 127.0.0.1, a schema and key prefix of
the run's own, dropped afterwards), `embedded` on one gateway (the reference) and `embedded` on N
gateways (each with its own buckets). Every run drives four keys at once, open loop, well above their
limits, round-robin through all its gateways from `--clients` httpx async clients: rpm 10, 100 and
1000, and tpm 11000 alone (the stub reports 11 tokens per request, so 1000 requests a minute), offered
5, 10, 60 and 60 requests/s: 30x, 6x, 3.6x and 3.6x what their limits let through.

The limiter is a token bucket per key and limit, `limit` deep, refilled at `limit` per 60 s, full at
the key's first request. So from the start t0, admissions by time t can never exceed
limit × (1 + (t - t0) / 60): the bound is checked at every admitted response (counted at its
completion, after its admission, so the check never flatters). Once the bucket is drained, each
window of W s admits limit × W / 60 (the steady allowance; the first window also spends the full
bucket, and a key offered less than twice its limit may take more than one window to drain it). The
accuracy is what the run admitted over the bucket's allowance for the run, limit × (1 + T / 60).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "gateway")]

from gateway_harness import GatewayProcess, free_port, sha256, wait_until  # noqa: E402
from shared_stores import POSTGRES_DSN, REDIS_URL, drop_shared_state  # noqa: E402

BODY = orjson.dumps({"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
STUB_TOKENS_PER_REQUEST = 11  # stub_upstream.py's `usage.total_tokens`: what each request is charged
PERIOD_S = 60.0  # RPM and TPM buckets refill their whole limit over a minute


@dataclass(frozen=True)
class KeySpec:
    name: str
    rpm: int | None
    tpm: int | None
    offered_per_s: float

    @property
    def secret(self) -> str:
        return f"sk-{self.name}"

    @property
    def limit(self) -> int:
        """The limit this key hits: requests per minute, or tokens per minute for a TPM-only key."""
        return self.rpm if self.rpm is not None else self.tpm

    @property
    def cost(self) -> int:
        """What one admitted request spends of `limit`."""
        return 1 if self.rpm is not None else STUB_TOKENS_PER_REQUEST


KEYS = (
    KeySpec("rpm10", rpm=10, tpm=None, offered_per_s=5.0),
    KeySpec("rpm100", rpm=100, tpm=None, offered_per_s=10.0),
    KeySpec("rpm1000", rpm=1000, tpm=None, offered_per_s=60.0),
    KeySpec("tpm11000", rpm=None, tpm=11000, offered_per_s=60.0),
)


@dataclass
class Outcomes:
    """One key's responses in one run: completion times (s after t0) of admitted requests (with their
    gateway) and of 429s."""

    admitted: list[tuple[float, int]] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)  # completion times of 429s
    other: dict[str, int] = field(default_factory=dict)


def gateway_config(state: dict, async_store: Path, upstream_url: str) -> dict:
    keys = [
        {"name": key.name, "sha256": sha256(key.secret)}
        | ({"rpm": key.rpm} if key.rpm else {})
        | ({"tpm": key.tpm} if key.tpm else {})
        for key in KEYS
    ]
    return {
        "models": {
            "stub": {
                "routing": {"policy": "least-outstanding"},
                "deployments": [{"replicas": [{"url": upstream_url, "id": "stub", "capacity": 4096}]}],
            }
        },
        "keys": {"inline": keys},
        "health": {"interval_s": 5},
        "scrape": {"interval_s": 5},
        "async": {"store": str(async_store)},
        "state": state,
    }


def start_gateways(count: int, state: dict, upstream_url: str, folder: Path) -> list[GatewayProcess]:
    gateways = []
    for index in range(count):
        config_path = folder / f"gateway-{index}.yaml"
        config = gateway_config(state, folder / f"jobs-{index}.db", upstream_url)
        config_path.write_text(yaml.safe_dump(config))
        gateways.append(GatewayProcess(config_path, folder / f"gateway-{index}.log", grpc=False))
    return gateways


async def drive(gateway_urls: list[str], clients: int, duration_s: float) -> dict[str, Outcomes]:
    """Send each key's requests on its own schedule (open loop), round-robin over the gateways."""
    outcomes = {key.name: Outcomes() for key in KEYS}
    pool = [
        httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        for _ in range(clients)
    ]
    turn = itertools.count()
    t0 = time.monotonic()

    async def send(key: KeySpec, index: int) -> None:
        gateway = index % len(gateway_urls)
        client = pool[next(turn) % clients]
        headers = {"authorization": f"Bearer {key.secret}", "content-type": "application/json"}
        response = await client.post(
            gateway_urls[gateway] + "/v1/chat/completions", content=BODY, headers=headers
        )
        done = time.monotonic() - t0
        outcome = outcomes[key.name]
        if response.status_code == 200:
            outcome.admitted.append((done, gateway))
        elif response.status_code == 429 and response.json()["error"]["code"] == "rate_limit_exceeded":
            outcome.refused.append(done)
        else:
            label = f"{response.status_code} {response.text[:120]}"
            outcome.other[label] = outcome.other.get(label, 0) + 1

    async def schedule(key: KeySpec) -> None:
        requests = []
        for index in range(int(duration_s * key.offered_per_s)):
            delay = t0 + index / key.offered_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            requests.append(asyncio.create_task(send(key, index)))
        await asyncio.gather(*requests)

    try:
        await asyncio.gather(*(schedule(key) for key in KEYS))
    finally:
        await asyncio.gather(*(client.aclose() for client in pool))
    return outcomes


def per_window_counts(times: list[float], window_s: float, windows: int) -> list[int]:
    counts = [0] * windows
    for done in times:
        if done < window_s * windows:
            counts[int(done // window_s)] += 1
    return counts


def summarize(key: KeySpec, outcome: Outcomes, window_s: float, windows: int, gateways: int) -> dict:
    """Admissions per window against the token bucket's allowance, and the bound checked throughout."""
    counts = per_window_counts([done for done, _ in outcome.admitted], window_s, windows)
    per_window = [count * key.cost for count in counts]  # in the limit's unit (requests or tokens)
    steady_allowed = key.limit * window_s / PERIOD_S
    steady = per_window[1:]
    run_allowed = key.limit * (1 + window_s * windows / PERIOD_S)  # the bucket's whole allowance over the run
    worst_excess = max(
        (
            rank * key.cost - key.limit * (1 + done / PERIOD_S)
            for rank, (done, _) in enumerate(sorted(outcome.admitted), 1)
        ),
        default=0.0,
    )
    by_gateway = [sum(1 for _, gateway in outcome.admitted if gateway == index) for index in range(gateways)]
    return {
        "key": key.name,
        "limit": key.limit,
        "unit": "requests/min" if key.rpm is not None else "tokens/min",
        "offered_requests_per_s": key.offered_per_s,
        "admitted_per_window": per_window,
        "first_window_allowed": key.limit + steady_allowed,
        "steady_window_allowed": steady_allowed,
        "steady_window_min": min(steady),
        "steady_window_max": max(steady),
        "run_allowed": run_allowed,
        "accuracy": round(sum(per_window) / run_allowed, 3),
        "requests_admitted": len(outcome.admitted),
        "requests_admitted_by_gateway": by_gateway,
        "refused_429": len(outcome.refused),
        "refused_429_per_window": per_window_counts(outcome.refused, window_s, windows),
        "other_responses": outcome.other,
        "worst_excess_over_bound": round(max(worst_excess, 0.0), 1),
        "over_admitted": worst_excess > 0,
    }


def run(mode: str, gateways: int, args: argparse.Namespace, upstream_url: str) -> dict:
    name = f"ember_bench_{uuid.uuid4().hex[:12]}"
    state = (
        {
            "backend": "shared",
            "postgres": {"dsn": POSTGRES_DSN, "schema": name},
            "redis": {"url": REDIS_URL, "key_prefix": name},
        }
        if mode == "shared"
        else {"backend": "embedded"}
    )
    with tempfile.TemporaryDirectory(prefix="ember-rl-") as folder:
        processes = start_gateways(gateways, state, upstream_url, Path(folder))
        try:
            duration_s = args.window_s * args.windows
            outcomes = asyncio.run(drive([p.url for p in processes], args.clients, duration_s))
        finally:
            for process in processes:
                process.stop()
            if mode == "shared":
                drop_shared_state(name)
    keys = [summarize(key, outcomes[key.name], args.window_s, args.windows, gateways) for key in KEYS]
    return {"state": mode, "gateways": gateways, "keys": keys}


def print_run(result: dict) -> None:
    print(f"\n{result['state']} state, {result['gateways']} gateway(s)")
    print(
        f"{'key':>9} {'limit':>6} {'per window (allowed steady)':>30} {'steady min-max':>14} "
        f"{'accuracy':>8} {'429s':>6} {'over bound':>10}"
    )
    for key in result["keys"]:
        windows = ",".join(str(n) for n in key["admitted_per_window"])
        print(
            f"{key['key']:>9} {key['limit']:>6} {windows + ' (' + format(key['steady_window_allowed'], 'g') + ')':>30} "
            f"{str(key['steady_window_min']) + '-' + str(key['steady_window_max']):>14} {key['accuracy']:>8.3f} "
            f"{key['refused_429']:>6} {('yes +' + str(key['worst_excess_over_bound'])) if key['over_admitted'] else 'no':>10}"
        )
        if key["other_responses"]:
            print(f"{'':>9} other responses: {key['other_responses']}")


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gateways", type=int, default=2, help="gateways sharing state (and in the embedded comparison)"
    )
    parser.add_argument(
        "--window-s", type=float, default=30.0, help="length of one counting window in seconds"
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=3,
        help="windows per run (at least 2: the first spends the full bucket)",
    )
    parser.add_argument(
        "--clients", type=int, default=16, help="httpx async clients the requests are spread over"
    )
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args()
    if args.gateways < 2 or args.windows < 2:
        parser.error("--gateways and --windows must be at least 2")
    started = {"load_average": load_average(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    upstream_port = free_port()
    stub = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "gateway" / "stub_upstream.py"), "--port", str(upstream_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    try:
        wait_until(lambda: answers(upstream_url + "/health"), 30, "the stub upstream")
        results = []
        for mode, gateways in (("shared", args.gateways), ("embedded", 1), ("embedded", args.gateways)):
            results.append(run(mode, gateways, args, upstream_url))
            print_run(results[-1])
    finally:
        stub.kill()
        stub.wait()
    report = {
        "started": started,
        "finished": {
            "load_average": load_average(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "settings": {
            "window_s": args.window_s,
            "windows": args.windows,
            "clients": args.clients,
            "period_s": PERIOD_S,
        },
        "runs": results,
    }
    print(f"\nload average: {started['load_average']} before, {report['finished']['load_average']} after")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":
    main()
