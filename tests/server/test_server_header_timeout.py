"""`ember serve`'s header-read timeout (default 10 s): connections that do not send complete request
headers in time are closed (slowloris), requests that do are served. The flag itself and the same
protocol under the gateway: tests/gateway/test_gateway_header_timeout.py."""

from __future__ import annotations

import asyncio

import httpx

DEFAULT_HEADER_TIMEOUT_S = 10.0


async def test_slow_header_connections_are_closed_after_the_default_timeout(server, auth, slow_clients):
    attack = asyncio.create_task(slow_clients.attack(server.url, count=20, give_up_s=DEFAULT_HEADER_TIMEOUT_S + 10))
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(timeout=60) as client:
        models = await client.get(server.url + "/v1/models", headers=auth)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    pieces = [b"GET /health HTTP/1.1\r\n", b"Host: ember\r\n", b"\r\n"]
    assert (await slow_clients.headers_in_pieces(server.url, pieces, pause_s=1.0)).startswith(b"HTTP/1.1 200")
    closed_after = await attack
    assert None not in closed_after, closed_after
    assert all(DEFAULT_HEADER_TIMEOUT_S - 0.1 <= seconds < DEFAULT_HEADER_TIMEOUT_S + 5 for seconds in closed_after)
