"""SLA autoscaling end to end: `ember up` with tiny-model fleets, real `ember serve` processes started
and stopped by the autoscaler, and the openai SDK as the client. With min 0 / max 2, one test in
order: scale from zero (the gateway holds requests while a replica starts), a burst that scales up,
idle that scales back down to zero, then a clean stop. With min 1 / max 3: a burst scales up, the
gateway routes to no replica before admitting it, and the replicas drain back to one under a light
load that loses no request."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ember.control.autoscaling.policy import AutoscalingPolicy, observation_from_dict
from ember.gateway.config import load_config
from tests.conftest import free_port, stop_process, wait_for

pytestmark = pytest.mark.slow

KEY = "sk-ember-local"
KEY_SHA256 = "0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271"




def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    found = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10.0).text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                found += sample.value
    return found


class AutoscaledFleet:
    def __init__(self, tmp_path: Path, model_dir: Path, **autoscaling):
        self.gateway_port, self.control_port = free_port(), free_port()
        config = {
            "models": {
                "tiny": {
                    "deployments": [{"replicas": []}],
                    "autoscaling": {
                        "min_replicas": 0, "max_replicas": 2,
                        # Generous objectives: on a shared 2-core machine latency is noise; the bursts
                        # below scale up through the queue (more requests than slots), deterministically.
                        "ttft_p90_ms": 60_000, "itl_p90_ms": 10_000,
                        "scale_down_delay_s": 3, "scale_to_zero_after_s": 20,
                        "stable_window_s": 6, "panic_window_s": 2, "hold_limit": 32,
                        **autoscaling,
                    },
                },
            },
            "keys": {"inline": [{"name": "test", "sha256": KEY_SHA256}]},
            "health": {"interval_s": 0.3, "timeout_s": 2.0, "unhealthy_threshold": 2},
            "queue": {"default_deadline_ms": 180_000},
            "launch": {
                "gateway": {"port": self.gateway_port},
                "autoscaled": {"tiny": {"model": str(model_dir), "capacity": 2, "args": [
                    "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512",
                ]}},
                "autoscaler": {"interval_s": 0.5, "port": self.control_port},
                "shutdown_timeout_s": 60,
            },
        }  # fmt: skip
        self.path = tmp_path / "fleet.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "up", str(self.path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=tmp_path,  # where the gateway keeps its default job store (./ember-jobs.db)
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()
        self.gateway = f"http://127.0.0.1:{self.gateway_port}"
        self.control = f"http://127.0.0.1:{self.control_port}"
        self.client = openai.OpenAI(base_url=self.gateway + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def up(self) -> bool:
        try:
            return httpx.get(self.gateway + "/health", timeout=2).status_code == 200 and bool(self.status())
        except httpx.HTTPError:
            return False

    def status(self) -> dict:
        return httpx.get(self.control + "/status", timeout=5).json()

    def states(self) -> list[str]:
        return sorted(replica["state"] for replica in self.status()["models"]["tiny"]["replicas"])

    def chat(self, question: str, stream: bool = False, max_tokens: int = 8) -> tuple[str, float]:
        """(the reply, seconds to its first token)."""
        started = time.monotonic()
        messages = [{"role": "user", "content": question}]
        if not stream:
            completion = self.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
            )
            assert completion.choices[0].finish_reason == "length"
            return completion.choices[0].message.content, time.monotonic() - started
        first_token_s, text = None, ""
        for chunk in self.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                first_token_s = first_token_s or time.monotonic() - started
                text += chunk.choices[0].delta.content
        return text, first_token_s

    def stop(self) -> int:
        stop_process(self.process, 180)
        self._reader.join(timeout=10)
        return self.process.returncode


@contextlib.contextmanager
def running(fleet: AutoscaledFleet):
    try:
        wait_for(fleet.up, "the gateway and the autoscaler")
        yield fleet
    finally:
        fleet.stop()
        print("".join(line for line in fleet.lines if "GET /" not in line and "POST /" not in line))


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    with running(AutoscaledFleet(tmp_path, tiny_model_dir)) as fleet:
        yield fleet


@pytest.fixture
def fleet_1_to_3(tmp_path, tiny_model_dir):
    # scale_down_delay_s long enough to see the delay in the decision log, short enough for a test.
    with running(AutoscaledFleet(tmp_path, tiny_model_dir, min_replicas=1, max_replicas=3, scale_down_delay_s=8)) as fleet:
        yield fleet


class RoutedToUnadmitted:
    """Samples the gateway's /metrics until stopped: a replica with requests in flight that the gateway
    had not admitted (replica_healthy 0) would be a request sent to a replica before it was healthy."""

    def __init__(self, gateway: str):
        self.url = gateway + "/metrics"
        self.seen: set[str] = set()  # replica ids the gateway listed
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            healthy, outstanding = {}, {}
            for family in text_string_to_metric_families(httpx.get(self.url, timeout=10.0).text):
                for sample in family.samples:
                    if sample.name == "ember_gateway_replica_healthy" and sample.labels["model"] == "tiny":
                        healthy[sample.labels["replica"]] = sample.value
                    elif sample.name == "ember_gateway_replica_outstanding" and sample.labels["model"] == "tiny":
                        outstanding[sample.labels["replica"]] = sample.value
            self.seen |= healthy.keys()
            self.violations += [f"{replica}: {outstanding[replica]:g} in flight" for replica, up in healthy.items()
                                if not up and outstanding.get(replica)]  # fmt: skip

    def __enter__(self) -> RoutedToUnadmitted:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_scale_from_zero_up_on_a_burst_and_back_to_zero_without_losing_a_request(fleet):
    assert fleet.states() == []
    assert httpx.get(fleet.gateway + "/ready", timeout=5).status_code == 200  # held, not "not ready"

    # From zero: requests, streamed and not, are held while the first replica starts, then served.
    # Two: one replica's slots (more would be a queue overflow, which starts a second one at once).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cold = [pool.submit(fleet.chat, f"cold {index}", index % 2 == 1) for index in range(2)]
        replies = [future.result() for future in cold]
    assert all(text for text, _ in replies)
    cold_start = wait_for(  # recorded on the autoscaler's next round
        lambda: metric(fleet.control + "/metrics", "ember_autoscaler_cold_start_seconds_sum", model="tiny"),
        "the cold start to be recorded",
    )
    # The first token came after the replica's cold start (the request waited for it, it was not refused).
    assert min(first_token for _, first_token in replies) >= cold_start * 0.5
    assert metric(fleet.control + "/metrics", "ember_autoscaler_decisions_total", model="tiny", reason="activate") >= 1
    assert fleet.states() == ["ready"]
    # The replica requires the fleet's service credential: only the gateway may use it.
    (replica_url,) = [replica["url"] for replica in fleet.status()["models"]["tiny"]["replicas"]]
    direct = httpx.post(replica_url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert direct.status_code == 401 and direct.json()["error"]["code"] == "invalid_api_key"

    # A burst: 12 requests for one replica of 2 slots. A second replica starts (the gateway admits it once
    # healthy), and every request succeeds. Which rule starts it depends on the round that first sees the
    # burst: a full queue is panic; a round that saw the first few requests only (more than the slots, a
    # queue not yet full) is "queue". Both happen on a loaded machine.
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        burst = [pool.submit(fleet.chat, f"burst {index}", index % 3 == 0, 48) for index in range(12)]
        assert all(future.result()[0] for future in burst)
    assert metric(fleet.control + "/metrics", "ember_autoscaler_scale_events_total", model="tiny", direction="up") == 2
    wait_for(
        lambda: metric(fleet.control + "/metrics", "ember_autoscaler_cold_start_seconds_count", model="tiny") == 2,
        "the second replica to be admitted",
    )
    gateway_metrics = fleet.gateway + "/metrics"
    assert metric(gateway_metrics, "ember_gateway_requests_total", model="tiny", status="200") == 14
    assert metric(gateway_metrics, "ember_gateway_requests_total", model="tiny") == 14  # no 408, 429, 502, 503

    # Idle: one replica drains and stops after scale_down_delay_s, the last after scale_to_zero_after_s.
    wait_for(lambda: fleet.states() == [], "the fleet to scale back to zero", limit_s=120)
    reasons = [entry["reason"] for entry in fleet.status()["decisions"]]
    assert "scale_down" in reasons and "scale_to_zero" in reasons
    assert metric(fleet.control + "/metrics", "ember_autoscaler_scale_events_total", model="tiny", direction="down") == 2
    assert httpx.get(fleet.gateway + "/admin/replicas", timeout=5).status_code in (401, 403)  # admin stays guarded

    # The live run's rounds, replayed through a fresh policy object, give the same decisions: the
    # policy is a pure function of what it observed (what the simulator relies on).
    recorded = httpx.get(fleet.control + "/rounds", timeout=10).json()["tiny"]
    assert recorded["complete"] and len(recorded["rounds"]) > 20
    replay = AutoscalingPolicy(load_config(fleet.path).models["tiny"].autoscaling)
    for round_ in recorded["rounds"]:
        assert asdict(replay.decide(observation_from_dict(round_["observation"]))) == round_["decision"]

    # `ember fleet status` shows the same decisions.
    shown = subprocess.run(
        [sys.executable, "-m", "ember.cli", "fleet", "status", str(fleet.path)], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("tiny: desired 0 (min 0, max 2); 0 ready, 0 loading, 0 draining")
    for step in ("0 -> 1  activate", "2 -> 1  scale_down", "1 -> 0  scale_to_zero"):
        assert step in shown.stdout, shown.stdout
    assert "1 -> 2  panic" in shown.stdout or "1 -> 2  queue" in shown.stdout, shown.stdout

    assert fleet.stop() == 0
    output = "".join(fleet.lines)
    assert output.count("drained and stopped") == 2
    # The first replica's process was a standby, started with the fleet and waiting before any request.
    first = re.search(r"autoscaler: tiny: started tiny-(\d+) \(activate\)", output)
    assert output.index(f"replica-{first.group(1)} started (pid") < first.start()


def test_a_burst_against_min_one_max_three_scales_up_then_drains_back_to_one_without_cutting_a_request(fleet_1_to_3):
    fleet = fleet_1_to_3
    wait_for(lambda: fleet.states() == ["ready"], "min_replicas' replica")
    with RoutedToUnadmitted(fleet.gateway) as routing:
        # 18 requests for one replica of 2 slots: the queue overflows and panic asks for 9 replicas,
        # capped at 3. A round that sees only the first few requests may add one first, by the queue rule (as
        # in the scale-from-zero test) or by panic in proportion to the few it saw ("2 queued on 1 ready").
        # Every request succeeds, whichever replica serves it.
        with concurrent.futures.ThreadPoolExecutor(18) as pool:
            burst = [pool.submit(fleet.chat, f"burst {index}", index % 3 == 0, 48) for index in range(18)]
            assert all(future.result()[0] for future in burst)
        burst_over = time.time()
        ups = [(e["current"], e["desired"], e["reason"]) for e in fleet.status()["decisions"] if e["desired"] > e["current"]]
        assert ups[0] == (0, 1, "min_replicas") and ups[-1][1:] == (3, "panic")
        assert all(reason in ("queue", "panic") for _, _, reason in ups[1:-1]), ups
        assert all(earlier[1] < later[1] for earlier, later in itertools.pairwise(ups)), ups
        wait_for(
            lambda: metric(fleet.control + "/metrics", "ember_autoscaler_cold_start_seconds_count", model="tiny") == 3,
            "the burst's two replicas to be admitted",
        )
        assert fleet.states() == ["ready", "ready", "ready"]

        # A light load (one streamed request at a time) keeps running while the two extra replicas
        # drain and stop: each request on a draining replica finishes there.
        light: list[str] = []
        stop_light = threading.Event()

        def light_load() -> None:
            while not stop_light.is_set():
                light.append(fleet.chat(f"light {len(light)}", stream=True, max_tokens=24)[0])

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running_light = pool.submit(light_load)
            wait_for(lambda: fleet.states() == ["ready"], "the fleet to drain back to min_replicas", limit_s=120)
            stop_light.set()
            running_light.result()
    assert light and all(light)
    assert routing.violations == [] and len(routing.seen) == 3

    decisions = fleet.status()["decisions"]
    downs = [entry for entry in decisions if entry["reason"] == "scale_down"]
    assert [(entry["current"], entry["desired"]) for entry in downs] == [(3, 2), (2, 1)]
    # Not before the scale-down delay after the burst, and one step per delay.
    first_down = datetime.fromisoformat(downs[0]["time"]).timestamp()
    assert first_down >= burst_over + 8 - 1  # the log's times are whole seconds
    assert datetime.fromisoformat(downs[1]["time"]).timestamp() - first_down >= 8 - 1
    assert "scale_to_zero" not in [entry["reason"] for entry in decisions]

    gateway_metrics = fleet.gateway + "/metrics"
    served = metric(gateway_metrics, "ember_gateway_requests_total", model="tiny")
    assert served == 18 + len(light)
    assert metric(gateway_metrics, "ember_gateway_requests_total", model="tiny", status="200") == served
    assert fleet.stop() == 0
    output = "".join(fleet.lines)
    assert output.count("drained and stopped") == 2  # the two scale-downs
