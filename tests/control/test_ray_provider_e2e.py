"""The Ray provider for real: a local Ray head started by the test (2 CPUs, a 100 MB object store),
replicas of the tiny model as Ray actors running `ember serve`, behind a real `ember gateway` that the
provider registers them with, talked to with the openai SDK.

One test walks the whole life: 1 replica -> 2 (both serve) -> SIGKILL of one actor's `ember serve`
(every request sent after the kill is served; the dead replica leaves the gateway and a new actor
replaces it) -> 1 (drained and stopped) -> close (the actors and the head are gone)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from ember.control.autoscaling.provider import GatewayAdmin, ReplicaState
from ember.control.fleet import load_fleet
from ember.gateway.admin import CONTROL_TOKEN_ENV
from ember.gateway.config import FLEET_CREDENTIAL_ENV
from tests.conftest import free_port

ray = pytest.importorskip("ray")
from ember.control.autoscaling.ray_provider import RayProvider  # noqa: E402 - needs ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KEY = "sk-ember-local"
KEY_SHA256 = "0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271"
TOKEN = "control-token-for-the-ray-test"
NAMESPACE = "ember-ray-test"



async def wait_for(condition, what: str, limit_s: float = 120.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = await condition()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
def fleet_file(tmp_path: Path, tiny_model_dir: Path) -> Path:
    config = {
        "models": {
            "tiny": {
                "deployments": [{"model": "tiny", "replicas": []}],
                "autoscaling": {"min_replicas": 1, "max_replicas": 2, "ttft_p90_ms": 5000, "itl_p90_ms": 1000},
            },
            # Its `ember serve` exits at once (no such model): replaced after a growing backoff.
            "broken": {
                "deployments": [{"model": "broken", "replicas": []}],
                "autoscaling": {"min_replicas": 0, "max_replicas": 1, "ttft_p90_ms": 5000, "itl_p90_ms": 1000},
            },
        },
        "keys": {"inline": [{"name": "test", "sha256": KEY_SHA256}]},
        "health": {"interval_s": 0.3, "timeout_s": 2.0, "unhealthy_threshold": 2},
        "launch": {
            "gateway": {"port": free_port()},
            "autoscaled": {"tiny": {"model": str(tiny_model_dir), "capacity": 4, "args": [
                "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512"]}},
            "restart": {"initial_backoff_s": 0.5, "max_backoff_s": 4},
            "shutdown_timeout_s": 30,
            "ray": {"address": "local", "namespace": NAMESPACE, "head": {"num_cpus": 2, "object_store_memory_mb": 100},
                    "replica": {"num_cpus": 0.5, "memory_mb": 256}, "health_interval_s": 0.3},
        },
    }  # fmt: skip
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def gateway(fleet_file: Path):
    fleet = load_fleet(fleet_file)
    port = fleet.launch.gateway.port
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "gateway", "--config", str(fleet_file), "--host", "127.0.0.1",
         "--port", str(port)],
        # As `ember up` starts it: the control token, and the fleet credential its replicas require.
        env={**os.environ, CONTROL_TOKEN_ENV: TOKEN, FLEET_CREDENTIAL_ENV: fleet.credential},
        cwd=fleet_file.parent,  # the test's folder, where the gateway keeps its default job store
    )  # fmt: skip
    yield fleet
    process.terminate()
    process.wait(timeout=30)


async def gateway_replicas(fleet) -> dict[str, str]:
    """The gateway's own view: replica id -> state."""
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            response = await client.get(fleet.gateway_url + "/admin/replicas", headers={"authorization": f"Bearer {TOKEN}"})
        except httpx.HTTPError:
            return {}
    return {item["id"]: item["state"] for item in response.json()["data"]}


async def chat(client: openai.AsyncOpenAI, question: str) -> str:
    """The replica id that answered (x-ember-replica); the answer must be a real completion."""
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": question}], max_tokens=4
    )
    completion = raw.parse()
    assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
    return raw.headers["x-ember-replica"]


async def test_replicas_as_ray_actors_serve_survive_a_killed_process_and_scale_1_2_1(gateway):
    fleet = gateway
    client = openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    admin = GatewayAdmin(fleet.gateway_url, TOKEN, drain_timeout_s=30)
    await wait_for(lambda: _answers(fleet.gateway_url + "/health"), "the gateway")
    log: list[str] = []
    provider = await RayProvider.connect(fleet, admin, log=log.append)
    closed = False
    try:
        assert ray.cluster_resources()["CPU"] == 2.0

        # 1 replica.
        first = await provider.start_replica("tiny")
        assert first.state == ReplicaState.LOADING and first.id.startswith("tiny-ray-")
        await wait_for(lambda: _ready(provider, 1), "the first replica to be admitted")
        assert await chat(client, "hello?") == first.id
        # The replica requires the fleet credential: only the gateway gets past it.
        async with httpx.AsyncClient(timeout=30) as direct:
            assert (await direct.get(first.url + "/v1/models")).status_code == 401
            assert (await direct.get(first.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})).status_code == 401

        # 1 -> 2: Ray places the second actor (half a CPU each on a 2-CPU head); both serve.
        second = await provider.start_replica("tiny")
        await wait_for(lambda: _ready(provider, 2), "the second replica to be admitted")
        assert await gateway_replicas(fleet) == {first.id: "ready", second.id: "ready"}
        # Each actor holds its request: half a CPU and 256 MB of the head's.
        await wait_for(lambda: _reserved(cpus=1.0, memory=512 << 20), "Ray to account both actors' resources")
        served = set(await asyncio.gather(*(chat(client, f"question {n}") for n in range(8))))
        assert served == {first.id, second.id}

        # SIGKILL the second actor's `ember serve`: every request sent after the kill is served.
        actor = ray.get_actor(f"ember-{second.id}", namespace=NAMESPACE)
        pid = await actor.pid.remote()
        os.kill(pid, signal.SIGKILL)
        answered = await asyncio.gather(*(chat(client, f"after the kill {n}") for n in range(6)))
        assert answered == [first.id] * 6  # the replacement is still loading its model
        # The provider notices, takes it out of the gateway and starts a replacement actor at once.
        await wait_for(lambda: _replaced(provider, second.id), "a replacement replica")
        replacement = next(r for r in provider.list_replicas() if r.id not in (first.id, second.id))
        assert f"ray: {second.id} ember serve exited (signal SIGKILL); replaced by {replacement.id}" in log
        assert await gateway_replicas(fleet) == {first.id: "ready", replacement.id: "ready"}
        assert set(await asyncio.gather(*(chat(client, f"again {n}") for n in range(8)))) == {first.id, replacement.id}

        # 2 -> 1: drained out of the gateway, then its process and actor stopped.
        replacement_pid = await ray.get_actor(f"ember-{replacement.id}", namespace=NAMESPACE).pid.remote()
        await provider.stop_replica(replacement.id)
        assert [r.id for r in provider.list_replicas()] == [first.id]
        assert await gateway_replicas(fleet) == {first.id: "ready"}
        assert not Path(f"/proc/{replacement_pid}").exists()
        with pytest.raises(ValueError):
            ray.get_actor(f"ember-{replacement.id}", namespace=NAMESPACE)
        assert await chat(client, "one left?") == first.id

        # A gateway that no longer knows a ready replica (it restarted): resync registers it again.
        async with httpx.AsyncClient(timeout=30) as control:
            forgotten = await control.delete(f"{fleet.gateway_url}/admin/replicas/{first.id}",
                                             headers={"authorization": f"Bearer {TOKEN}"})  # fmt: skip
        assert forgotten.status_code == 200 and await gateway_replicas(fleet) == {}
        await provider.resync()
        assert first.state == ReplicaState.LOADING
        await wait_for(lambda: _ready(provider, 1), "the replica to be admitted again")
        assert await gateway_replicas(fleet) == {first.id: "ready"}
        assert f"ray: {first.id} admitted again by the gateway" in log
        assert await chat(client, "back?") == first.id

        # A replica that dies before its admission is replaced after the restart backoff, doubling.
        broken = await provider.start_replica("broken")
        await wait_for(lambda: _logged(log, "replaced by broken-", 3), "three replacements of the broken replica")
        replacements = [line for line in log if "replaced by broken-" in line]
        assert replacements[0].startswith(f"ray: {broken.id} ember serve exited (code 2); replaced by ")
        assert [line.rsplit(" in ", 1)[-1] for line in replacements[:3]] == ["0.5s", "1s", "2s"]
        assert len(provider.list_replicas("broken")) == 1  # one at a time, listed as loading meanwhile

        first_pid = await ray.get_actor(f"ember-{first.id}", namespace=NAMESPACE).pid.remote()
        await provider.close()
        closed = True
        assert not Path(f"/proc/{first_pid}").exists()
        assert await gateway_replicas(fleet) == {}
        assert provider.list_replicas() == []
        assert not ray.is_initialized()
    finally:
        if not closed:
            await provider.close()


async def _answers(url: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as client:
        try:
            return (await client.get(url)).status_code == 200
        except httpx.HTTPError:
            return False


async def _reserved(cpus: float, memory: int) -> bool:
    total, available = ray.cluster_resources(), ray.available_resources()
    return total["CPU"] - available.get("CPU", 0) == cpus and total["memory"] - available.get("memory", 0) == memory


async def _logged(log: list[str], text: str, count: int) -> bool:
    return sum(text in line for line in log) >= count


async def _ready(provider: RayProvider, count: int) -> bool:
    replicas = provider.list_replicas("tiny")
    return len(replicas) == count and all(r.state == ReplicaState.READY for r in replicas)


async def _replaced(provider: RayProvider, dead_id: str) -> bool:
    replicas = provider.list_replicas("tiny")
    return dead_id not in {r.id for r in replicas} and await _ready(provider, 2)


def test_ember_up_with_a_ray_section_runs_the_autoscaled_replica_as_a_ray_actor(fleet_file: Path):
    """`launch.ray` selects the provider for `ember up`: the autoscaler's min_replicas=1 becomes one
    Ray actor, requests are served through the gateway, SIGTERM drains and stops it all."""
    fleet = load_fleet(fleet_file)
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "up", str(fleet_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=fleet_file.parent,  # the test's folder, where the gateway keeps its default job store
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        deadline = time.monotonic() + 120
        while not any("admitted by the gateway" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            time.sleep(0.2)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello?"}], max_tokens=3
        )
        assert raw.parse().usage.completion_tokens == 3
        assert raw.headers["x-ember-replica"].startswith("tiny-ray-")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            exit_code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:  # never leave a fleet (and its Ray head) behind a failed test
            process.kill()
            process.wait()
            raise
        reader.join(timeout=10)
    assert exit_code == 0
    output = "".join(lines)
    url = next(line.split(" at ")[-1].strip() for line in lines if "runs ember serve at" in line)
    assert "[ember up] ray: connected to local (2 CPUs, 0 GPUs)" in output
    assert output.count("runs ember serve at") == 1  # min_replicas 1, no load: exactly one actor
    assert "SIGTERM received: draining" in output  # the replica was stopped, not killed
    assert output.rstrip().endswith("[ember up] all processes stopped")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
