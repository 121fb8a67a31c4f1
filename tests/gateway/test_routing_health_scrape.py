"""Active health probes and /metrics scrapes against a real HTTP server that the test stops and
restarts on the same port."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from ember.gateway.config import parse_config
from ember.gateway.health import HealthProber
from ember.gateway.proxy import UpstreamClient
from ember.gateway.replicas import ReplicaPool
from ember.gateway.scraper import MetricsScraper
from tests.conftest import free_port

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
"""


class FakeReplicaServer:
    """A real aiohttp server on a fixed port answering /health and /metrics, startable many times."""

    def __init__(self, port: int):
        self.port = port
        self.health_status = 200
        self.metrics_text = VLLM_METRICS
        self._runner: web.AppRunner | None = None

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status, text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        await self._runner.cleanup()
        self._runner = None


def fleet(live_port: int, dead_port: int, **health):
    config = parse_config(
        {
            "health": {"unhealthy_threshold": 2, "healthy_threshold": 1, "timeout_s": 2.0, **health},
            "scrape": {"interval_s": 0.05},
            "models": {
                "tiny": {
                    "deployments": [
                        {
                            "replicas": [
                                {"url": f"http://127.0.0.1:{live_port}", "id": "live"},
                                {"url": f"http://127.0.0.1:{dead_port}", "id": "dead"},
                            ]
                        }
                    ]
                }
            },
        }
    )
    return config, ReplicaPool.from_config(config)


@pytest.fixture
async def server():
    server = FakeReplicaServer(free_port())
    await server.start()
    yield server
    if server._runner is not None:
        await server.stop()


@pytest.fixture
async def client():
    client = UpstreamClient(parse_config({"models": {"m": {"deployments": [{"replicas": [{"url": "http://x"}]}]}}}).timeouts)
    await client.start()
    yield client
    await client.close()


async def test_probes_admit_at_the_first_success_eject_after_failures_in_a_row_and_readmit(server, client):
    config, pool = fleet(server.port, free_port())
    events = []
    pool.add_listener(lambda event, replica: events.append((event, replica.id)))
    prober = HealthProber(pool, client, config.health)
    live, dead = pool.get("live"), pool.get("dead")

    assert not live.healthy and not dead.healthy  # configured replicas wait for their first probe
    await prober.probe_all()
    assert live.healthy and not live.awaiting_first_probe
    assert not dead.healthy and dead.awaiting_first_probe and dead.consecutive_failures == 1
    await prober.probe_all()
    assert dead.awaiting_first_probe and dead.ejection_reason is None  # never admitted: not an ejection

    await server.stop()
    assert await prober.probe(live) is False
    assert live.healthy  # one failure is below the threshold of two
    await prober.probe(live)
    assert not live.healthy

    await server.start()  # same port: the replica came back
    assert await prober.probe(live) is True
    assert live.healthy and live.consecutive_failures == 0
    assert events == [("admit", "live"), ("eject", "live"), ("readmit", "live")]


async def test_a_server_answering_5xx_counts_as_unhealthy(server, client):
    config, pool = fleet(server.port, free_port(), unhealthy_threshold=1)
    prober = HealthProber(pool, client, config.health)
    live = pool.get("live")
    server.health_status = 503  # e.g. still loading its model
    assert await prober.probe(live) is False
    assert not live.healthy
    server.health_status = 204
    assert await prober.probe(live) is True
    assert live.healthy


async def test_the_background_prober_ejects_and_readmits_on_its_own(server, client):
    config, pool = fleet(server.port, free_port(), interval_s=0.05)
    prober = HealthProber(pool, client, config.health)
    live = pool.get("live")
    changed = asyncio.Event()
    pool.add_listener(lambda event, replica: changed.set() if replica is live else None)
    await prober.start()
    try:
        assert live.healthy  # start() returns after a first round of probes
        changed.clear()
        await server.stop()
        await asyncio.wait_for(changed.wait(), 30)
        assert not live.healthy
        changed.clear()
        await server.start()
        await asyncio.wait_for(changed.wait(), 30)
        assert live.healthy
    finally:
        await prober.stop()
    assert not prober._task.running


async def test_scraper_fills_the_load_snapshot_and_clears_it_when_scrapes_fail(server, client):
    config, pool = fleet(server.port, free_port())
    scraper = MetricsScraper(pool, client, config.scrape)
    live, dead = pool.get("live"), pool.get("dead")
    await HealthProber(pool, client, config.health).probe_all()  # admits live; dead is never scraped
    await scraper.scrape_all()
    assert (live.metrics.waiting, live.metrics.running, live.metrics.kv_usage) == (7.0, 3.0, 0.5)
    assert live.metrics.scraped_at > 0
    assert dead.metrics.waiting is None and dead.metrics.scraped_at == 0
    pool.eject(live, "test")
    await scraper.scrape_all()  # an ejected replica's last snapshot is dropped, not kept for later
    assert live.metrics.waiting is None and live.metrics.scraped_at == 0
    pool.readmit(live)
    await scraper.scrape_all()
    assert live.metrics.waiting == 7.0

    server.metrics_text = "<html>not prometheus</html>"
    assert await scraper.scrape(live) is False
    assert live.metrics.waiting is None and live.metrics.scraped_at == 0

    server.metrics_text = VLLM_METRICS.replace("} 7.0", "} 2.0")
    await scraper.start()
    try:
        for _ in range(600):
            if live.metrics.waiting == 2.0:
                break
            await asyncio.sleep(0.05)
        assert live.metrics.waiting == 2.0
        await server.stop()
        for _ in range(600):
            if live.metrics.waiting is None:
                break
            await asyncio.sleep(0.05)
        assert live.metrics.waiting is None
    finally:
        await scraper.stop()
