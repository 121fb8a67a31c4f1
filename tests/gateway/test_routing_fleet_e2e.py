"""Routing end to end, on a fleet started by `ember up`: a real gateway in front of two real
`ember serve` replicas of the tiny model, talked to with the openai SDK.

The fleet declares the two replicas twice: as model `tiny` (prefix-cache policy, regions ignored)
and as model `tiny-geo` (round robin, region-aware: replica A in `east`, B in `west`). The last test
kills replica A and ends with SIGTERM to the supervisor, so it runs last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ember.gateway.scraper import parse_load_metrics
from tests.conftest import free_port, stop_process, wait_for

pytestmark = pytest.mark.slow

KEY = "sk-ember-local"
KEY_SHA256 = "0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271"
SYSTEM = (
    "You are the assistant of a fleet test. Answer every question about inference servers briefly, "
    "politely and in English, and never mention this instruction. "
) * 2




def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10.0).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def replica_total(metrics: dict, name: str, replica: str) -> float:
    """A counter summed over every label but `replica` (e.g. ejections of all reasons)."""
    return sum(value for (sample_name, labels), value in metrics.items() if sample_name == name and ("replica", replica) in labels)


class Fleet:
    def __init__(self, tmp_path: Path, model_dir: Path):
        self.gateway_port, self.port_a, self.port_b = free_port(), free_port(), free_port()
        self.url_a, self.url_b = f"http://127.0.0.1:{self.port_a}", f"http://127.0.0.1:{self.port_b}"
        replica_args = ["--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512"]
        config = {
            "regions": {"east": {"latency_ms": {"west": 60}}, "west": {}},
            "models": {
                "tiny": {
                    "routing": {"policy": "prefix-cache", "region_aware": False},
                    "deployments": [{"replicas": [
                        {"url": self.url_a, "id": "cache-a", "region": "east", "capacity": 4},
                        {"url": self.url_b, "id": "cache-b", "region": "west", "capacity": 4},
                    ]}],
                },
                "tiny-geo": {
                    "routing": {"policy": "round-robin"},
                    "deployments": [{"model": "tiny", "replicas": [
                        {"url": self.url_a, "id": "geo-east", "region": "east", "capacity": 4},
                        {"url": self.url_b, "id": "geo-west", "region": "west", "capacity": 4},
                    ]}],
                },
            },
            "keys": {"inline": [{"name": "test", "sha256": KEY_SHA256}]},
            "health": {"interval_s": 0.3, "timeout_s": 2.0, "unhealthy_threshold": 2},
            "launch": {
                "gateway": {"port": self.gateway_port},
                "replicas": [
                    {"port": self.port_a, "model": str(model_dir), "args": replica_args},
                    {"port": self.port_b, "model": str(model_dir), "args": replica_args},
                ],
                "restart": {"initial_backoff_s": 0.1, "max_backoff_s": 1.0},
                "shutdown_timeout_s": 60,
            },
        }  # fmt: skip
        path = tmp_path / "fleet.yaml"
        path.write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "up", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=tmp_path,  # where the gateway keeps its default job store (./ember-jobs.db)
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()
        self.gateway = f"http://127.0.0.1:{self.gateway_port}"
        self.client = openai.OpenAI(base_url=self.gateway + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def gateway_metrics(self) -> dict:
        return scrape(self.gateway + "/metrics")

    def admitted(self, *replica_ids: str) -> bool:
        try:
            metrics = self.gateway_metrics()
        except httpx.HTTPError:
            return False
        return all(
            any(name == "ember_gateway_replica_healthy" and ("replica", rid) in labels and value == 1.0
                for (name, labels), value in metrics.items())
            for rid in replica_ids
        )  # fmt: skip

    def wait_until_serving(self) -> None:
        # The gateway admits each replica at its first passing health probe (loading the model can take
        # a minute on a busy machine); a request sent earlier would wait in the gateway's queue.
        wait_for(lambda: self.admitted("cache-a", "cache-b", "geo-east", "geo-west"), "the gateway to admit both replicas")

    def chat(self, model: str, system: str, question: str, region: str | None = None) -> tuple[str, str]:
        """(replica id from x-ember-replica, reply text)."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=3,
            temperature=0,
            extra_headers={"x-ember-region": region} if region else None,
        )
        completion = raw.parse()
        assert completion.choices[0].finish_reason == "length"
        return raw.headers["x-ember-replica"], completion.choices[0].message.content

    def children(self) -> dict[int, str]:
        try:
            pids = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except FileNotFoundError:
            return {}
        found = {}
        for pid in map(int, pids):
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                continue
        return found

    def stop(self) -> None:
        stop_process(self.process, 120)
        self._reader.join(timeout=10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), tiny_model_dir)
    try:
        fleet.wait_until_serving()
        yield fleet
    finally:
        fleet.stop()


def test_same_prefix_requests_land_on_one_replica_and_hit_its_prefix_cache(fleet):
    before = {url: scrape(url + "/metrics") for url in (fleet.url_a, fleet.url_b)}
    served = [fleet.chat("tiny", SYSTEM, question)[0] for question in ("What is a KV cache?", "Define prefill.", "Why batch?")]
    assert len(set(served)) == 1, served
    holder_url, other_url = (fleet.url_a, fleet.url_b) if served[0] == "cache-a" else (fleet.url_b, fleet.url_a)
    holder_before, holder_after = before[holder_url], scrape(holder_url + "/metrics")
    # The gateway's scraper reads this same exposition: idle now, and the same hit count.
    load = parse_load_metrics(httpx.get(holder_url + "/metrics", timeout=10.0).text)
    assert (load.waiting, load.running) == (0.0, 0.0) and 0.0 <= load.kv_usage < 1.0
    assert load.prefix_cache_hits == sample(holder_after, "ember:prefix_cache_hits_total", model_name="tiny")
    hits = sample(holder_after, "ember:prefix_cache_hits_total", model_name="tiny") - sample(
        holder_before, "ember:prefix_cache_hits_total", model_name="tiny"
    )
    # The shared system prompt is well over 16-token blocks long: the 2nd and 3rd requests reuse them.
    assert hits >= 2 * 16
    assert sample(holder_after, "vllm:prefix_cache_hits_total", model_name="tiny") == sample(
        holder_after, "ember:prefix_cache_hits_total", model_name="tiny"
    )
    other_queries = "ember:prefix_cache_queries_total"
    assert sample(scrape(other_url + "/metrics"), other_queries, model_name="tiny") == sample(
        before[other_url], other_queries, model_name="tiny"
    )  # the other replica was not sent any of them
    # A different prefix goes to the replica that holds none yet, and then stays there.
    fresh = "You translate every message into French and add nothing else to your answer whatsoever. " * 2
    newcomer = fleet.chat("tiny", fresh, "Hello")[0]
    assert newcomer != served[0]
    assert fleet.chat("tiny", fresh, "Goodbye")[0] == newcomer
    decisions = fleet.gateway_metrics()
    assert sample(decisions, "ember_gateway_routing_decisions_total", model="tiny", policy="prefix-cache",
                  reason="cache-hit", replica=served[0]) >= 2  # fmt: skip


def test_requests_are_served_in_their_own_region(fleet):
    for _ in range(3):
        assert fleet.chat("tiny-geo", SYSTEM, "east?", region="east")[0] == "geo-east"
        assert fleet.chat("tiny-geo", SYSTEM, "west?", region="west")[0] == "geo-west"


def test_replicas_refuse_every_caller_but_the_gateway(fleet):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for url in (fleet.url_a, fleet.url_b):
        for authorization in ({}, {"Authorization": f"Bearer {KEY}"}):  # no key, or a gateway user's key
            direct = httpx.post(url + "/v1/chat/completions", json=body, headers=authorization, timeout=30.0)
            assert direct.status_code == 401
            assert direct.json()["error"]["code"] == "invalid_api_key"
    through_gateway = httpx.post(
        fleet.gateway + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120.0
    )
    assert through_gateway.status_code == 200 and through_gateway.json()["usage"]["completion_tokens"] == 2
    # The credential travels in the children's environment, never in their command lines.
    (replica_pid,) = [pid for pid, cmd in fleet.children().items() if f"--port {fleet.port_a} " in cmd + " "]
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{replica_pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    credential = environ[b"EMBER_API_KEY"].decode()
    assert all(credential not in cmd for cmd in fleet.children().values())
    keyed = httpx.post(fleet.url_a + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {credential}"},
                       timeout=120.0)  # fmt: skip
    assert keyed.status_code == 200


def test_region_spill_over_on_outage_then_readmission_after_restart_then_clean_shutdown(fleet):
    first = fleet.children()
    (pid_a,) = [pid for pid, cmd in first.items() if f"--port {fleet.port_a} " in cmd + " "]
    (gateway_pid,) = [pid for pid, cmd in first.items() if " gateway " in cmd]
    ejections_before = replica_total(fleet.gateway_metrics(), "ember_gateway_ejections_total", "geo-east")
    os.kill(pid_a, signal.SIGKILL)
    # East's only replica is down: east clients are served by west, the next nearest region,
    # including the request that found A dead (retried there before anything reached the client).
    for question in ("after the crash", "still down?", "and now?"):
        assert fleet.chat("tiny-geo", SYSTEM, question, region="east")[0] == "geo-west"
    assert replica_total(fleet.gateway_metrics(), "ember_gateway_ejections_total", "geo-east") == ejections_before + 1

    # `ember up` restarts A; the gateway's health probes re-admit it, and east is local again.
    restarted = wait_for(
        lambda: [pid for pid, cmd in fleet.children().items() if f"--port {fleet.port_a} " in cmd + " " and pid != pid_a],
        "the supervisor to restart replica A",
    )
    wait_for(lambda: fleet.admitted("geo-east", "cache-a"), "the gateway to re-admit replica A")
    assert replica_total(fleet.gateway_metrics(), "ember_gateway_readmissions_total", "geo-east") >= 1
    assert fleet.chat("tiny-geo", SYSTEM, "back home?", region="east")[0] == "geo-east"
    assert gateway_pid in fleet.children()  # only the killed replica was restarted

    children = list(fleet.children())
    fleet.process.send_signal(signal.SIGTERM)
    assert fleet.process.wait(timeout=120) == 0
    fleet._reader.join(timeout=10)
    for pid in (*children, *restarted):
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived `ember up`"
    output = "".join(fleet.lines)
    assert f"replica-{fleet.port_a} exited with signal SIGKILL" in output
    assert output.count(f"replica-{fleet.port_a} started") == 2
    assert output.count(f"[ember up] fleet ready: send requests to {fleet.gateway}/v1") == 1
    assert "killing it" not in output  # every child stopped on SIGTERM alone
    assert output.rstrip().endswith("[ember up] all processes stopped")
