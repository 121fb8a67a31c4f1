"""The front door across regions, with real processes: two clusters, each an `ember gateway` process in
front of an `ember serve` replica of the tiny model, each in its own network namespace (regions_harness;
loopback where namespaces cannot be made), east 2 ms and west 35 ms away from the front door (a
delaying relay), and the front door itself an `ember gateway` process in us-east.

The nearest cluster serves while it keeps up, load spills west when east's own metrics show its queue
building, and when east dies whole (SIGKILL of its gateway and replica) under load, requests not yet
started are served by west, streams already started end with an error event and [DONE], never a
hang, and east is re-admitted when it comes back. Cut off instead (its veth link down: no reset),
east is ejected by its probes, its silent stream ends with an error event and [DONE], and it is
re-admitted once the link is back."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
import yaml
from gateway_harness import EmberServe, GatewayProcess, http, sha256, wait_until
from prometheus_client.parser import text_string_to_metric_families
from regions_harness import Cluster, RegionNetwork

CLIENT_KEY = "sk-client"
NEAR_DELAY_S = 0.002  # front door -> east, each way
FAR_DELAY_S = 0.035  # front door -> west, each way: the 70 ms round trip of the latency matrix


@dataclass
class FrontDoor:
    gateway: GatewayProcess
    east: Cluster
    west: Cluster
    network: RegionNetwork

    def served(self) -> dict[str, float]:
        """Requests the front door completed per cluster (its `ember_gateway_requests_total`, status 200)."""
        text = http.get(self.gateway.url + "/metrics").text
        counts = {"east": 0.0, "west": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "ember_gateway_requests_total" and sample.labels["status"] == "200":
                    cluster = sample.labels["replica"].split("/")[0]
                    if cluster in counts:
                        counts[cluster] += sample.value
        return counts


@pytest.fixture(scope="module")
def front_door(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoor]:
    workdir = tmp_path_factory.mktemp("front-door")
    network = RegionNetwork()
    clusters: list[Cluster] = []
    gateway = None
    try:
        for name, delay_s, replica_capacity in (("east", NEAR_DELAY_S, 1), ("west", FAR_DELAY_S, 4)):
            region = network.add_region(name)
            replica = EmberServe(tiny_model_dir, name, host=region.address, prefix=region.prefix)
            clusters.append(Cluster(region, replica, workdir, delay_s, replica_capacity).start())
        east, west = clusters
        config = {
            "listener_region": "us-east",
            "regions": {"us-east": {"latency_ms": {"us-west": 70}}, "us-west": {}},
            "keys": {"inline": [{"name": "client", "sha256": sha256(CLIENT_KEY)}]},
            "health": {"interval_s": 0.25, "timeout_s": 1.0, "unhealthy_threshold": 2},
            "scrape": {"interval_s": 0.2, "timeout_s": 1.0},
            "async": {"store": "front-door-jobs.db"},
            "clusters": {
                "models": ["tiny"],
                # More than either cluster's replicas hold: only their metrics can say one is full.
                "members": {"east": east.member("us-east", 8), "west": west.member("us-west", 8)},
            },
        }
        config_path = workdir / "front-door.yaml"
        config_path.write_text(yaml.safe_dump(config))
        gateway = GatewayProcess(config_path, workdir / "front-door.log", grpc=False)
        door = FrontDoor(gateway, east, west, network)
        wait_until(
            lambda: http.get(gateway.url + "/ready").status_code == 200, 60, "the front door to admit both"
        )
        yield door
    finally:
        if gateway is not None:
            gateway.stop()
        for cluster in clusters:
            cluster.stop()
        network.close()


def chat_body(max_tokens: int = 8, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        **extra,
    }


def chat(door: FrontDoor, max_tokens: int = 8) -> httpx.Response:
    return http.post(
        door.gateway.url + "/v1/chat/completions",
        json=chat_body(max_tokens, ignore_eos=True),
        headers={"authorization": f"Bearer {CLIENT_KEY}"},
    )


@dataclass
class StreamResult:
    status: int
    events: list[str] = field(default_factory=list)  # the `data:` payloads, [DONE] included
    first_event_at: float | None = None  # time.monotonic()
    hung: bool = False

    @property
    def error(self) -> dict | None:
        for event in self.events:
            if event.startswith('{"error"'):
                return orjson.loads(event)["error"]
        return None

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.events[-1:] == ["[DONE]"] and self.error is None

    @property
    def cut(self) -> bool:
        """Started, then ended by the front door with an error event and [DONE]."""
        return (
            self.status == 200
            and len(self.events) >= 3
            and self.error is not None
            and self.error["code"] == "upstream_stream_error"
            and self.events[-2].startswith('{"error"')
            and self.events[-1] == "[DONE]"
        )


def stream(door: FrontDoor, max_tokens: int, started: threading.Event | None = None) -> StreamResult:
    """One streamed chat completion, read to its end; a read stalled for 30 s counts as a hang."""
    body = chat_body(max_tokens, ignore_eos=True, stream=True)
    headers = {"authorization": f"Bearer {CLIENT_KEY}"}
    result = StreamResult(0)
    try:
        with httpx.stream(
            "POST", door.gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as response:
            result.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if result.first_event_at is None:
                        result.first_event_at = time.monotonic()
                        if started is not None:
                            started.set()
                    result.events.append(line.removeprefix("data: "))
    except httpx.ReadTimeout:
        result.hung = True
    return result


def test_the_nearest_cluster_serves_and_load_spills_when_its_queue_builds(front_door: FrontDoor):
    before = front_door.served()
    started = time.monotonic()
    assert all(chat(front_door).status_code == 200 for _ in range(4))
    assert front_door.served()["east"] - before["east"] == 4  # east, 2 ms away, not west, 35 ms away
    assert front_door.served()["west"] == before["west"]
    # The relay is in the path: four round trips to east, each at least twice its delay.
    assert time.monotonic() - started >= 4 * 2 * NEAR_DELAY_S

    # Four clients at once against east's single replica slot: east's gateway queues them, its
    # /metrics says so, and the front door sends the following requests west, although it has at
    # most four in flight to east, half of the capacity it gives east.
    before = front_door.served()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rounds = list(pool.map(lambda _: [chat(front_door, 48).status_code for _ in range(3)], range(4)))
    assert rounds == [[200] * 3] * 4
    after = front_door.served()
    assert after["east"] - before["east"] >= 1
    assert after["west"] - before["west"] >= 1
    assert (after["east"] - before["east"]) + (after["west"] - before["west"]) == 12


def test_a_cluster_killed_under_load_fails_over_and_is_readmitted(front_door: FrontDoor):
    # A long stream that east serves (nearest, idle), running when east dies.
    east_streaming = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long_stream = pool.submit(stream, front_door, 400, east_streaming)
        assert east_streaming.wait(60), "the long stream did not start"
        load_results: list[StreamResult] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                load_results.append(stream(front_door, 16))

        loaders = [pool.submit(load) for _ in range(3)]
        time.sleep(0.5)
        before_kill = front_door.served()
        killed_at = time.monotonic()
        front_door.east.kill()
        time.sleep(3.0)
        stop.set()
        for loader in loaders:
            loader.result(timeout=60)
        cut = long_stream.result(timeout=60)

    assert not cut.hung and cut.cut, cut.events[-3:]
    assert not any(result.hung for result in load_results)
    for result in load_results:
        # Every request not yet streaming at the kill was served whole (by west); a stream cut by the
        # kill had started before it.
        assert result.complete or (result.cut and result.first_event_at < killed_at + 0.5), result.events[-2:]
    after_kill = [
        r for r in load_results if r.first_event_at is not None and r.first_event_at > killed_at + 0.5
    ]
    assert after_kill and all(result.complete for result in after_kill)
    assert front_door.served()["west"] - before_kill["west"] >= len(after_kill)

    # East back (same addresses): probed back and preferred again.
    front_door.east.start()
    before = front_door.served()
    wait_until(lambda: chat(front_door).status_code == 200 and front_door.served()["east"] > before["east"], 60,
               "east to be re-admitted")  # fmt: skip


def test_a_partitioned_cluster_is_left_and_its_silent_streams_end(front_door: FrontDoor):
    if not front_door.network.isolated:
        pytest.skip("a partition needs the regions in network namespaces (root); loopback cannot be cut")
    wait_until(lambda: chat(front_door).status_code == 200, 60, "a front door serving")
    east_streaming = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long_stream = pool.submit(stream, front_door, 400, east_streaming)
        assert east_streaming.wait(60), "the long stream did not start"
        # No reset, no close: east's gateway keeps streaming into a link that is down.
        front_door.network.partition(front_door.east.region)
        try:
            cut = long_stream.result(timeout=60)
            assert not cut.hung and cut.cut, cut.events[-3:]
            assert "since it was ejected" in cut.error["message"]
            before = front_door.served()
            assert all(chat(front_door).status_code == 200 for _ in range(3))
            assert front_door.served()["west"] - before["west"] == 3
        finally:
            front_door.network.heal(front_door.east.region)
    before = front_door.served()
    wait_until(lambda: chat(front_door).status_code == 200 and front_door.served()["east"] > before["east"], 60,
               "east to be re-admitted")  # fmt: skip
