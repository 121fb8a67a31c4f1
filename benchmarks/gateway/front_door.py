"""The front door across regions: what it adds to time to first token on top of the inter-region
latency, and how long a cluster failover takes.

    flock /work/notes/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/gateway/front_door.py [-n 300]

Two clusters, east and west, each an `ember gateway` in front of the stub upstream (stub_upstream.py:
the replica costs next to nothing, so what is measured is the gateways and the network), each in its
own network namespace joined by a veth pair (tests/gateway/regions_harness.py; loopback ports where
namespaces cannot be made), behind a delaying TCP relay: east `--near-ms` away each way, west
`--far-ms`. The front door is an `ember gateway` process with `clusters:` in us-east.

1. TTFT overhead: streamed requests one at a time, alternating between the front door and east's
   gateway reached directly through the same relay (ttft.py's client), paired differences.
2. Failover: `--clients` concurrent clients send small non-streamed requests through the front door;
   east's gateway and replica are SIGKILLed. Under continuous load the first request fails at the kill
   (the front door retries it on west); east counts as moved out once the front door has ejected it
   (its `ember_gateway_replica_healthy`, polled every 5 ms). Every request started after that must
   be served by west (x-ember-replica) with status 200; the script checks it and prints the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "gateway"), str(ROOT / "benchmarks" / "gateway")]

from gateway_harness import GatewayProcess, free_port, sha256, wait_until  # noqa: E402
from regions_harness import Cluster, Region, RegionNetwork  # noqa: E402
from ttft import Target, percentile  # noqa: E402

CLIENT_KEY = "sk-bench"
SMALL = {"model": "stub", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}


class StubReplica:
    """stub_upstream.py in a region, at a fixed address (restartable)."""

    def __init__(self, region: Region):
        self.region = region
        self.port = free_port()
        self.url = f"http://{region.address}:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> StubReplica:
        command = [
            *self.region.prefix, sys.executable, str(ROOT / "benchmarks" / "gateway" / "stub_upstream.py"),
            "--host", self.region.address, "--port", str(self.port), "--tokens", "16", "--token-interval-ms", "20",
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: _answers(self.url + "/health"), 60, "the stub replica")
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def summary(values_ms: list[float]) -> str:
    return f"p50 {statistics.median(values_ms):7.3f} ms   p90 {percentile(values_ms, 0.9):7.3f} ms"


async def ttft_overhead(front_door_url: str, east: Cluster, n: int, warmup: int) -> None:
    direct, through = Target(east.relay.url, east.service_key), Target(front_door_url, CLIENT_KEY)
    for _ in range(warmup):
        await direct.ttft()
        await through.ttft()
    direct_ms, through_ms = [], []
    for _ in range(n):
        direct_ms.append(await direct.ttft() * 1000)
        through_ms.append(await through.ttft() * 1000)
    added = [t - d for t, d in zip(through_ms, direct_ms, strict=True)]
    print(f"TTFT, {n} streamed requests each, alternating:")
    print(f"  east's gateway through the relay: {summary(direct_ms)}")
    print(f"  through the front door:           {summary(through_ms)}")
    print(f"  added by the front door (paired): {summary(added)}")
    print(
        f"  added (p50 - p50):                {statistics.median(through_ms) - statistics.median(direct_ms):7.3f} ms"
    )


@dataclass
class Sample:
    started: float
    ended: float
    status: int
    replica: str


def east_healthy(front_door_url: str) -> bool:
    text = httpx.get(front_door_url + "/metrics", timeout=5).text
    return (
        'ember_gateway_replica_healthy{deployment="clusters",model="stub",region="us-east",replica="east/stub"} 1.0'
        in text
    )


async def failover(front_door_url: str, east: Cluster, clients: int, after_s: float) -> bool:
    samples: list[Sample] = []
    stop = asyncio.Event()
    headers = {"authorization": f"Bearer {CLIENT_KEY}"}

    async def client() -> None:
        async with httpx.AsyncClient(base_url=front_door_url, headers=headers, timeout=30) as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    response = await http.post("/v1/chat/completions", json=SMALL)
                    status, replica = response.status_code, response.headers.get("x-ember-replica", "")
                except httpx.HTTPError:
                    status, replica = 0, ""
                samples.append(Sample(started, time.monotonic(), status, replica))

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.sleep(2.0)
    before = [s for s in samples if s.replica == "east/stub"]
    killed_at = time.monotonic()
    await asyncio.to_thread(east.kill)
    ejected_at = None
    while ejected_at is None:
        if not await asyncio.to_thread(east_healthy, front_door_url):
            ejected_at = time.monotonic()
        else:
            await asyncio.sleep(0.005)
    await asyncio.sleep(after_s)
    stop.set()
    await asyncio.gather(*tasks)

    moved = [s for s in samples if s.started >= ejected_at]
    in_window = [s for s in samples if s.ended >= killed_at and s.started < ejected_at]
    failed = [s for s in samples if s.status != 200]
    last_east = max((s.ended for s in samples if s.replica == "east/stub"), default=killed_at)
    ok = bool(moved) and all(s.status == 200 and s.replica == "west/stub" for s in moved)
    print(f"Failover, {clients} clients of small non-streamed requests ({len(samples)} requests):")
    print(f"  before the kill: {len(before)} served by east")
    print(
        f"  SIGKILL -> east ejected at the front door: {(ejected_at - killed_at) * 1000:.1f} ms (5 ms polling)"
    )
    print(f"  last response from east ended {(last_east - killed_at) * 1000:.1f} ms after the kill")
    window_ms = [(s.ended - s.started) * 1000 for s in in_window]
    if window_ms:
        print(
            f"  {len(in_window)} requests in flight or started before the ejection: longest {max(window_ms):.1f} ms"
        )
    print(f"  failed (status != 200) at the client: {len(failed)}")
    print(f"  after the ejection: {len(moved)} requests, all served by west with 200: {ok}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="TTFT pairs")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured TTFT pairs first")
    parser.add_argument(
        "--near-ms", type=float, default=10.0, help="east's delay from the front door, each way"
    )
    parser.add_argument(
        "--far-ms", type=float, default=35.0, help="west's delay from the front door, each way"
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients during the failover")
    parser.add_argument("--after-s", type=float, default=2.0, help="load kept up after the ejection")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ember-front-door-"))
    network = RegionNetwork()
    clusters: list[Cluster] = []
    front_door = None
    try:
        for name, delay_ms in (("east", args.near_ms), ("west", args.far_ms)):
            region = network.add_region(name)
            clusters.append(
                Cluster(
                    region, StubReplica(region), workdir, delay_ms / 1000, replica_capacity=64, model="stub"
                ).start()
            )
        east, west = clusters
        print(f"regions: {'network namespaces + veth' if network.isolated else 'loopback'}; "
              f"relay delay east {args.near_ms} ms, west {args.far_ms} ms each way")  # fmt: skip
        config = {
            "listener_region": "us-east",
            "regions": {"us-east": {"latency_ms": {"us-west": 2 * args.far_ms}}, "us-west": {}},
            "keys": {"inline": [{"name": "bench", "sha256": sha256(CLIENT_KEY)}]},
            "health": {"interval_s": 0.5, "timeout_s": 1.0, "unhealthy_threshold": 2},
            "async": {"store": "front-door-jobs.db"},
            "clusters": {"models": ["stub"], "members": {"east": east.member("us-east", 64), "west": west.member("us-west", 64)}},
        }  # fmt: skip
        config_path = workdir / "front-door.yaml"
        config_path.write_text(yaml.safe_dump(config))
        front_door = GatewayProcess(config_path, workdir / "front-door.log", port=free_port(), grpc=False)
        wait_until(lambda: _answers(front_door.url + "/ready"), 60, "the front door to admit both clusters")
        asyncio.run(ttft_overhead(front_door.url, east, args.n, args.warmup))
        moved = asyncio.run(failover(front_door.url, east, args.clients, args.after_s))
        if not moved:
            sys.exit("failover check failed: a request after the ejection was not served by west")
    finally:
        if front_door is not None:
            front_door.stop()
        for cluster in clusters:
            cluster.stop()
        network.close()


if __name__ == "__main__":
    main()
