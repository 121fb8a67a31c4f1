"""The autoscaler in the gateway console, in a real headless Chromium: `ember up` runs a fleet whose
model `tiny` is autoscaled (min 1, max 2, real `ember serve` replicas of a tiny model); its autoscaler
reports each round to the gateway, and the console's fleet view shows the model's current and desired
replicas, the decision that started the first replica and, after a burst of requests, the one that
wants a second, each with its reason; and the burst, then steady traffic, in the charts."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from console_browser import ADMIN_KEY, log_in, screenshot
from gateway_harness import free_port, sha256

from tests.conftest import stop_process

pytestmark = pytest.mark.slow

USER_KEY = "sk-test"
START_TIMEOUT_S = 240  # `ember up`, its gateway and the first replica on a loaded 2-core machine
SPREAD_S = 60  # the steady traffic after the burst: twelve of the series' 5-second buckets


class AutoscaledFleet:
    """`ember up` of one autoscaled model, stopped with SIGTERM as an operator would."""

    def __init__(self, tmp_path: Path, model_dir: Path):
        self.gateway = f"http://127.0.0.1:{free_port()}"
        config = {
            "models": {"tiny": {
                "deployments": [{"replicas": []}],
                "autoscaling": {"min_replicas": 1, "max_replicas": 2, "ttft_p90_ms": 60_000, "itl_p90_ms": 10_000},
            }},
            "keys": {"inline": [{"name": "test", "sha256": sha256(USER_KEY)}]},
            "admin_key_sha256": sha256(ADMIN_KEY),
            "metrics": {"replica_price_per_hour": 2.5},  # for the cost chart
            "health": {"interval_s": 0.3, "timeout_s": 2.0, "unhealthy_threshold": 2},
            "launch": {
                "gateway": {"port": int(self.gateway.rsplit(":", 1)[1])},
                "autoscaled": {"tiny": {"model": str(model_dir), "capacity": 2, "args": [
                    "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512",
                ]}},
                "autoscaler": {"interval_s": 0.5},
                "shutdown_timeout_s": 30,
            },
        }  # fmt: skip
        path = tmp_path / "fleet.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = open(tmp_path / "ember-up.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "up", str(path)], stdout=self.log, stderr=subprocess.STDOUT,
            cwd=tmp_path,  # where the gateway keeps its default job store
        )  # fmt: skip

    def wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"ember up exited with {self.process.returncode}"
            try:
                if httpx.get(self.gateway + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("the fleet's gateway did not start")

    def stop(self) -> None:
        stop_process(self.process, 120)
        self.log.close()


@pytest.fixture
def fleet(tmp_path, tiny_model_dir) -> Iterator[AutoscaledFleet]:
    fleet = AutoscaledFleet(tmp_path, tiny_model_dir)
    try:
        fleet.wait_up()
        yield fleet
    finally:
        fleet.stop()


def test_the_fleet_view_shows_the_autoscalers_counts_and_decisions(browser, fleet):
    page = log_in(browser, fleet.gateway, "#models tr[data-model='tiny']")
    timeout_ms = START_TIMEOUT_S * 1000
    # The first round finds no replica below min_replicas 1 and starts one; it counts while loading.
    decision = "#decisions tr[data-model='tiny'][data-reason='min_replicas']"
    page.wait_for_selector(decision, timeout=timeout_ms)
    assert page.locator(f"{decision} td").all_text_contents()[2:] == ["0 → 1", "min_replicas", "0 running"]
    counts = "#models tr[data-model='tiny'] td.autoscaler[data-current='1'][data-desired='1']"
    page.wait_for_selector(counts, timeout=timeout_ms)
    assert page.text_content(counts) == "1 → 1"
    assert page.text_content("#models tr[data-model='tiny'] td:nth-child(5)") == "1 … 2"
    assert re.fullmatch(r"[\d.]+ s ago", page.text_content("#models tr[data-model='tiny'] td:nth-child(6)"))
    # The replica it started joins the gateway's table once admitted.
    page.wait_for_selector("#replicas tr[data-state='ready'] td:text-is('tiny')", timeout=timeout_ms)
    page.wait_for_selector("#models tr[data-model='tiny'] td:nth-child(3):text-is('1 / 1')")

    # A burst of 12 requests for one replica of 2 slots: the autoscaler wants a second replica, the
    # page shows the decision and its reason, then both replicas counted.
    client = openai.OpenAI(base_url=fleet.gateway + "/v1", api_key=USER_KEY, max_retries=0, timeout=300)

    def ask(stream: bool) -> str:
        """One request of the burst; a third of them streamed, which the inter-token latency chart needs."""
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "burst"}], max_tokens=48, stream=stream
        )
        if not stream:
            return reply.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        burst = [pool.submit(ask, index % 3 == 0) for index in range(12)]
        scale_up = "#decisions tr[data-model='tiny'] td:nth-child(3):text-is('1 → 2')"
        page.wait_for_selector(scale_up, timeout=timeout_ms)
        reason = page.text_content(
            "#decisions tr[data-model='tiny']:has(td:text-is('1 → 2')) td:nth-child(4)"
        )
        assert reason in ("panic", "queue", "slo_ttft", "slo_itl", "slo_queue_wait"), reason
        assert all(future.result() for future in burst)
    page.wait_for_selector(
        "#models tr[data-model='tiny'] td.autoscaler[data-desired='2']", timeout=timeout_ms
    )
    screenshot(page, "gateway-fleet", "#fleet-section")
    # Then steady traffic, one request after another for SPREAD_S, so the charts draw lines through
    # a dozen buckets rather than the burst's lone dot.
    spread_until, index = time.monotonic() + SPREAD_S, 0
    while time.monotonic() < spread_until:
        assert ask(stream=index % 2 == 0)
        index += 1
        time.sleep(1)
    page.wait_for_function(
        """(buckets) => document.querySelectorAll(
            "figure[data-chart='Requests'] g[data-series='200'] circle").length >= buckets""",
        arg=SPREAD_S // 5 - 1,
        timeout=15_000,
    )
    # The burst and the steady traffic in the charts: requests, first-token and inter-token
    # latencies, the queue.
    charts = (
        ("Requests", "200"),
        ("Inter-token latency", "p90"),
        ("Queue", "depth"),
        ("Cost", "per 1M output tokens"),
    )
    for chart, series in charts:
        page.wait_for_selector(
            f"figure[data-chart='{chart}'] g[data-series='{series}'] circle", timeout=15_000
        )
    screenshot(page, "gateway-charts", "#charts-section")
