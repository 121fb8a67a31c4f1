"""The default `state: {backend: embedded}` needs no PostgreSQL and no Redis: a gateway in a network
namespace of its own (only loopback, where nothing listens on 5432 or 6379) serves, limits, counts usage,
manages keys through its admin API and runs async jobs, all in its SQLite files and its memory."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import socket
import subprocess
from pathlib import Path

import pytest
from gateway_harness import FakeReplica, gateway_config, http, model_config, sha256, wait_until
from protocols_support import ProtocolGateway

CLONE_NEWNET = 0x40000000
KEY, FREE_KEY, ADMIN_KEY = "sk-alone", "sk-free", "sk-admin"


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def chat(gateway: ProtocolGateway, key: str) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {key}"}
    return http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code


def serve_alone(base_dir: Path) -> dict:
    """Runs in the forked child, inside its own network namespace."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    found = {"postgres_refused": refuses(5432), "redis_refused": refuses(6379)}
    replica = FakeReplica("alone").start()
    config = gateway_config(
        {"tiny": model_config(replica)},
        [{"secret": KEY, "name": "limited", "rpm": 3}, {"secret": FREE_KEY, "name": "free"}],
        admin_key_sha256=sha256(ADMIN_KEY),
    )
    config["async"] = {"store": "jobs.db", "jobs": {"concurrency": 2, "poll_interval_s": 0.05}}
    config["keys"]["store"] = "keys.db"
    gateway = ProtocolGateway(config, base_dir).start()  # with the async jobs extension
    try:
        found["limited"] = [chat(gateway, KEY) for _ in range(4)]
        usage = http.get(gateway.url + "/v1/usage", headers={"authorization": f"Bearer {KEY}"}).json()
        found["usage_requests"] = usage["requests"]
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        created = http.post(gateway.url + "/admin/keys", json={"name": "made-here"}, headers=admin)
        found["created"] = created.status_code
        made = created.json()["key"]
        found["made_key"] = chat(gateway, made)
        found["revoked"] = http.delete(gateway.url + "/admin/keys/made-here", headers=admin).status_code
        found["after_revoke"] = chat(gateway, made)
        body = {"model": "tiny", "prompt": "a job", "max_tokens": 3}
        job = http.post(
            gateway.url + "/v1/async/completions", json=body, headers={"authorization": f"Bearer {made}"}
        )
        found["job_of_revoked_key"] = job.status_code
        free = {"authorization": f"Bearer {FREE_KEY}"}
        job = http.post(gateway.url + "/v1/async/completions", json=body, headers=free)
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]

        def job_state() -> dict:
            return http.get(gateway.url + f"/v1/async/jobs/{job_id}", headers=free).json()

        wait_until(
            lambda: job_state()["status"] in ("succeeded", "failed"), timeout_s=30, what="the async job"
        )
        done = job_state()
        found["job"] = (done["status"], done["result"]["choices"][0]["text"])
    finally:
        gateway.stop()
        replica.stop()
    found["files"] = sorted(path.name for path in base_dir.iterdir() if path.suffix == ".db")
    return found


def child(base_dir: Path, results) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        results.send({"skip": f"cannot make a network namespace: {os.strerror(ctypes.get_errno())}"})
        return
    try:
        results.send(serve_alone(base_dir))
    except BaseException as exc:  # the parent reports it
        results.send({"error": repr(exc)})


def test_embedded_state_serves_with_no_postgres_and_no_redis(tmp_path):
    receiving, sending = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(target=child, args=(tmp_path, sending))
    process.start()
    assert receiving.poll(120), "the gateway in its own network namespace did not answer"
    found = receiving.recv()
    process.join(30)
    if "skip" in found:
        pytest.skip(found["skip"])
    assert "error" not in found, found["error"]
    assert found["postgres_refused"] and found["redis_refused"]
    assert found["limited"] == [200, 200, 200, 429]
    assert found["usage_requests"] == 3
    assert (found["created"], found["made_key"], found["revoked"], found["after_revoke"]) == (
        201,
        200,
        200,
        401,
    )
    assert found["job_of_revoked_key"] == 401
    assert found["job"] == ("succeeded", "Hello from alone")
    assert found["files"] == ["jobs.db", "keys.db"]
