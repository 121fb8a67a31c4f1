"""`ember gateway --header-timeout`: connections that do not send complete request headers in time are
closed (slowloris), requests that do are served. The same protocol runs `ember serve`
(tests/server/test_server_header_timeout.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from gateway_harness import free_port

HEADER_TIMEOUT_S = 2.0


def start_gateway(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    config = {"models": {"tiny": {"deployments": [{"replicas": [{"url": f"http://127.0.0.1:{free_port()}"}]}]}}}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    command = [sys.executable, "-m", "ember.cli", "gateway", "--config", str(path), "--port", str(port), *flags]
    # In the test's folder, where the gateway keeps its default job store (./ember-jobs.db).
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    return process, f"http://127.0.0.1:{port}"


def wait_serving(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the gateway did not start")


async def test_slow_header_connections_are_closed_and_normal_requests_served(tmp_path, slow_clients):
    process, url = start_gateway(tmp_path, "--header-timeout", str(HEADER_TIMEOUT_S))
    try:
        await asyncio.to_thread(wait_serving, process, url)
        attack = asyncio.create_task(slow_clients.attack(url, count=20, give_up_s=HEADER_TIMEOUT_S + 8))
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.get(url + "/health")).status_code == 200  # served while the attack runs
            # Headers sent in pieces, complete within the limit: served.
            pieces = [b"GET /health HTTP/1.1\r\n", b"Host: gateway\r\n", b"\r\n"]
            status_line = await slow_clients.headers_in_pieces(url, pieces, pause_s=0.4)
            assert status_line.startswith(b"HTTP/1.1 200")
            # A kept-alive connection outlives the header timeout: the limit is per request.
            assert (await client.get(url + "/health")).status_code == 200
            await asyncio.sleep(HEADER_TIMEOUT_S + 0.5)
            assert (await client.get(url + "/health")).status_code == 200
        closed_after = await attack
        assert None not in closed_after, closed_after  # every slow connection was closed
        assert all(HEADER_TIMEOUT_S - 0.1 <= seconds < HEADER_TIMEOUT_S + 5 for seconds in closed_after), closed_after
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_header_timeout_must_be_positive(tmp_path):
    process, _ = start_gateway(tmp_path, "--header-timeout", "0")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "ember gateway: error: --header-timeout must be above 0 seconds, got 0" in output
