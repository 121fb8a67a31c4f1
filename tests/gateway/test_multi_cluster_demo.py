"""`ember up` on a multi-cluster fleet file (the shape of the packaged `--demo multi-cluster`, with the
tiny model and ports of its own): two clusters in two regions, each two gateways sharing its PostgreSQL
schema and Redis prefix in front of two real `ember serve` replicas, and one front door, talked to with
the openai SDK. SIGKILL one east gateway: the other east gateway serves; SIGKILL it too: west serves;
the supervisor restarts them and east is preferred again. Each cluster's usage, counted by both its
gateways, sums in its own PostgreSQL schema."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import openai
import pytest
import redis
import yaml
from shared_stores import POSTGRES_DSN, REDIS_URL, require_stores, run_sql

from ember.commands.up import default_fleet_path
from tests.conftest import stop_process, wait_for

KEY = "sk-ember-local"
KEY_SHA256 = "0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271"
RESTART_BACKOFF_S = 15.0  # long enough to see a killed gateway's cluster serve without it


def free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports



class MultiClusterFleet:
    def __init__(self, tmp_path: Path, model_dir: Path):
        door, east_a, east_b, west_a, west_b, *replicas = free_ports(9)
        self.schema_prefix = f"ember_test_{uuid.uuid4().hex[:10]}"
        self.gateway_ports = {"east": [east_a, east_b], "west": [west_a, west_b]}
        spec = {
            "model": {"name": "tiny", "source": str(model_dir),
                      "args": ["--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512"]},
            "regions": {"us-east": {"latency_ms": {"us-west": 70}}, "us-west": {}},
            "front_door": {"port": door, "region": "us-east"},
            "keys": {"inline": [{"name": "client", "sha256": KEY_SHA256}]},
            "clusters": {
                "east": {"region": "us-east", "gateways": [east_a, east_b], "replicas": replicas[:2]},
                "west": {"region": "us-west", "gateways": [west_a, west_b], "replicas": replicas[2:]},
            },
            "state": {"schema_prefix": self.schema_prefix},
            "health": {"interval_s": 0.3, "timeout_s": 2.0, "unhealthy_threshold": 2},
            "restart": {"initial_backoff_s": RESTART_BACKOFF_S, "max_backoff_s": RESTART_BACKOFF_S},
            "shutdown_timeout_s": 60,
        }  # fmt: skip
        path = tmp_path / "multi-cluster.yaml"
        path.write_text(yaml.safe_dump({"multi_cluster": spec}))
        argv = [
            sys.executable,
            "-m",
            "ember.cli",
            "up",
            str(path),
            "--postgres-dsn",
            POSTGRES_DSN,
            "--redis-url",
            REDIS_URL,
        ]
        self.process = subprocess.Popen(  # in the test's folder: the front door keeps its job store in ./ember-jobs.db
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{door}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        self.served: list[str] = []  # the member of every request served, in order

    def served_by(self, cluster: str) -> int:
        return sum(member.startswith(f"{cluster}-") for member in self.served)

    def chat(self) -> str:
        """The front door's member (cluster gateway) that served one chat completion."""
        raw = self.client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hello?"}], max_tokens=3, temperature=0
        )
        completion = raw.parse()
        assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 3
        (member,) = [value for value in raw.headers.get_list("x-ember-replica") if value.endswith("/tiny")]
        self.served.append(member.removesuffix("/tiny"))
        return self.served[-1]

    def serving(self) -> bool:
        try:
            return self.chat().startswith("east-")
        except openai.APIError:
            return False

    def gateway_pid(self, port: int) -> int:
        pids = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        for pid in map(int, pids):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"gateway" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                return pid
        raise AssertionError(f"no gateway child on port {port}")

    def usage(self, cluster: str) -> int:
        rows = run_sql(
            f'SELECT COALESCE(SUM(requests), 0) AS n FROM "{self.schema_prefix}_{cluster}".key_usage'
        )
        return rows[0]["n"]

    def stop(self) -> None:
        stop_process(self.process, 120)
        self._reader.join(timeout=10)
        for cluster in self.gateway_ports:
            run_sql(f'DROP SCHEMA IF EXISTS "{self.schema_prefix}_{cluster}" CASCADE')
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{self.schema_prefix.replace('_', '-')}-*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_the_packaged_demo_describes_two_clusters_of_two_gateways_and_two_replicas(tmp_path):
    from ember.control.multi_cluster import load_multi_cluster

    fleet = load_multi_cluster(default_fleet_path("multi-cluster"), tmp_path, POSTGRES_DSN, REDIS_URL)
    names = [child.name for child in fleet.children]
    assert names == [
        "front-door",
        "east-gateway-8100", "east-gateway-8101", "east-replica-8110", "east-replica-8111",
        "west-gateway-8200", "west-gateway-8201", "west-replica-8210", "west-replica-8211",
    ]  # fmt: skip
    door_env = fleet.children[0].env
    east_gateway_env, west_gateway_env = fleet.children[1].env, fleet.children[5].env
    # A service key per cluster, held by the front door only; a replica credential per cluster.
    assert door_env["EMBER_CLUSTER_EAST_KEY"] != door_env["EMBER_CLUSTER_WEST_KEY"]
    assert "EMBER_CLUSTER_EAST_KEY" not in east_gateway_env
    assert east_gateway_env["EMBER_FLEET_CREDENTIAL"] != west_gateway_env["EMBER_FLEET_CREDENTIAL"]
    assert fleet.children[1].env == fleet.children[2].env
    east_file = yaml.safe_load((tmp_path / "cluster-east.yaml").read_text())
    assert east_file["state"]["postgres"] == {
        "dsn_env": "EMBER_POSTGRES_DSN",
        "schema": "ember_demo_east",
        "job_lease_s": 30.0,
    }
    assert door_env["EMBER_CLUSTER_EAST_KEY"] not in (tmp_path / "cluster-east.yaml").read_text()
    assert sorted(fleet.gateway.models) == ["smollm2-135m-instruct"]
    assert fleet.gateway_url == "http://127.0.0.1:8000"


def test_a_bad_multi_cluster_file_fails_before_anything_starts(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"multi_cluster": {
        "model": {"name": "tiny"},
        "clusters": {"east": {"region": "us-east", "gateways": [9000], "replicas": [9000]}},
    }}))  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "up", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "multi_cluster: every port must be used once, repeated: 9000" in result.stderr
    assert "Traceback" not in result.stderr
    path.write_text(yaml.safe_dump({"multi_cluster": {
        "model": {"name": "tiny"},
        "regions": {"us-east": {}},
        "clusters": {"east": {"region": "us-eest", "gateways": [9000], "replicas": [9001]}},
    }}))  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "up", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert (
        f"{path}: multi_cluster: regions not declared under regions: clusters.east.region 'us-eest'"
        in result.stderr
    )
    path.write_text(yaml.safe_dump({"multi_cluster": {"model": {"name": "tiny"}}, "models": {}}))
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "up", str(path)], capture_output=True, text=True, timeout=120
    )
    assert (
        result.returncode == 2
        and "a multi-cluster file has only `multi_cluster:`, remove: models" in result.stderr
    )


@pytest.mark.slow
def test_killed_cluster_gateways_leave_their_cluster_or_the_other_serving(tmp_path, tiny_model_dir):
    require_stores()
    fleet = MultiClusterFleet(tmp_path, tiny_model_dir)
    try:
        wait_for(fleet.serving, "the front door to serve through the east cluster")
        east = [fleet.chat() for _ in range(4)]
        assert all(member.startswith("east-") for member in east), east  # nearest region first
        wait_for(lambda: fleet.usage("east") == fleet.served_by("east"), "east's usage flushed to its schema")
        east_before_kills = fleet.served_by("east")

        first, second = (f"east-{port}" for port in fleet.gateway_ports["east"])
        os.kill(fleet.gateway_pid(fleet.gateway_ports["east"][0]), signal.SIGKILL)
        # Each succeeds: a request that fails before its first byte is retried on another member.
        after_first = [fleet.chat() for _ in range(6)]
        assert set(after_first) == {second}, after_first

        os.kill(fleet.gateway_pid(fleet.gateway_ports["east"][1]), signal.SIGKILL)
        after_both = [fleet.chat() for _ in range(6)]
        assert all(member.startswith("west-") for member in after_both), after_both
        # Both east gateways counted into one schema; the second's last requests flushed before its kill or lost.
        assert east_before_kills <= fleet.usage("east") <= east_before_kills + len(after_first)
        wait_for(lambda: fleet.usage("west") == fleet.served_by("west"), "west's usage flushed to its schema")

        # The supervisor restarts both after the backoff; the front door probes them back and prefers east.
        wait_for(fleet.serving, "east re-admitted", limit_s=RESTART_BACKOFF_S + 120)
        log = "".join(fleet.lines)
        assert f"{first.replace('east-', 'east-gateway-')} exited with signal SIGKILL" in log
        assert f"{second.replace('east-', 'east-gateway-')} exited with signal SIGKILL" in log
    except BaseException:
        print("".join(fleet.lines)[-30_000:])  # the fleet's log (every gateway's tracebacks) with the failure
        raise
    finally:
        fleet.stop()
    assert fleet.process.returncode == 0
    assert "all processes stopped" in "".join(fleet.lines)


def test_demo_flag_and_state_flags_are_checked_on_the_command_line(tmp_path):
    def up(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ember.cli", "up", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    printed = up("--demo", "multi-cluster", "--print-commands")
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert [line.split(":")[0] for line in lines][:2] == ["front-door", "east-gateway-8100"] and len(
        lines
    ) == 9
    both = up(default_fleet_path(), "--demo", "multi-cluster")
    assert both.returncode == 2 and "give a fleet file or --demo, not both" in both.stderr
    single = up("--demo", "default", "--redis-url", "redis://127.0.0.1:6379/0", "--print-commands")
    assert (
        single.returncode == 2
        and "--postgres-dsn and --redis-url are for multi-cluster fleets" in single.stderr
    )
