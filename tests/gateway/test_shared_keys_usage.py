"""`state: {backend: shared}`: keys and usage live in PostgreSQL, so a key created through one gateway
works on the other, a revocation through one is refused by the other, and usage and budgets count
both gateways' requests once."""

from __future__ import annotations

import json
import time

import redis
import yaml
from gateway_harness import FakeReplica, gateway_config, http, model_config, sha256, wait_until
from protocols_support import ProtocolGateway, protocol_config
from shared_stores import REDIS_URL, run_sql

from ember.cli import main as ember_main

ADMIN = {"authorization": "Bearer sk-admin"}


def chat(gateway, key: str, max_tokens: int = 16):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return http.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def usage(gateway, key: str) -> dict:
    return http.get(gateway.url + "/v1/usage", headers={"authorization": f"Bearer {key}"}).json()


def two_gateways(start_gateway, replica, state: dict):
    config = gateway_config(
        {"tiny": model_config(replica)}, [], admin_key_sha256=sha256("sk-admin"), state=state
    )
    return start_gateway(config), start_gateway(config)


def test_key_created_on_one_gateway_works_on_the_other_and_revocation_is_seen_by_both(
    shared_state, replicas, start_gateway
):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state)
    created = http.post(first.url + "/admin/keys", json={"name": "team", "rpm": 100}, headers=ADMIN)
    assert created.status_code == 201
    key = created.json()["key"]
    assert chat(first, key).status_code == 200
    wait_until(
        lambda: chat(second, key).status_code == 200, timeout_s=2, what="the new key on the other gateway"
    )
    listed = http.get(second.url + "/admin/keys", headers=ADMIN).json()["data"]
    assert [(k["name"], k["rpm"], k["revoked_at"]) for k in listed] == [("team", 100, None)]
    duplicate = http.post(second.url + "/admin/keys", json={"name": "team"}, headers=ADMIN)
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "key_exists"

    revoked = http.delete(second.url + "/admin/keys/team", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert chat(second, key).status_code == 401  # the revoking gateway: at once
    # The other gateway too, from its very next request: its admission reads the revocation's mark in Redis.
    refused = chat(first, key).json()["error"]
    mark = f"{shared_state['redis']['key_prefix']}:limits:{{{created.json()['id']}}}:revoked"
    assert redis.Redis.from_url(REDIS_URL).ttl(mark) > 3000
    assert (refused["type"], refused["code"]) == ("invalid_request_error", "invalid_api_key")
    again = http.delete(first.url + f"/admin/keys/{created.json()['id']}", headers=ADMIN)
    assert again.status_code == 404 and "already revoked" in again.json()["error"]["message"]


def test_keys_cli_manages_the_shared_store_of_running_gateways(
    shared_state, replicas, start_gateway, tmp_path, capsys
):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state)
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump(gateway_config({"tiny": model_config(a)}, [], state=shared_state)))
    assert ember_main(["keys", "create", "--config", str(config), "--name", "cli", "--rpm", "60"]) == 0
    key = capsys.readouterr().out.splitlines()[0]
    schema = shared_state["postgres"]["schema"]
    rows = run_sql(f'SELECT name FROM "{schema}".api_keys WHERE sha256 = $1', sha256(key))
    assert [row["name"] for row in rows] == ["cli"] and key.startswith("sk-ember-")
    wait_until(
        lambda: chat(first, key).status_code == 200, timeout_s=2, what="the CLI's key on the first gateway"
    )
    wait_until(
        lambda: chat(second, key).status_code == 200, timeout_s=2, what="the CLI's key on the second gateway"
    )
    assert ember_main(["keys", "list", "--config", str(config), "--json"]) == 0
    assert [(k["name"], k["rpm"]) for k in json.loads(capsys.readouterr().out)] == [("cli", 60)]

    assert ember_main(["keys", "revoke", "--config", str(config), "cli"]) == 0
    assert capsys.readouterr().out.startswith("revoked cli ")
    for gateway in (first, second):  # refused at once by both: the CLI marked the revocation in Redis
        refused = chat(gateway, key)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert ember_main(["keys", "revoke", "--config", str(config), "cli"]) == 2
    assert "no key with id or name 'cli'" in capsys.readouterr().err
    unreachable = {
        **shared_state,
        "postgres": {**shared_state["postgres"], "dsn": "postgresql://postgres@127.0.0.1:1/test"},
    }
    config.write_text(yaml.safe_dump(gateway_config({"tiny": model_config(a)}, [], state=unreachable)))
    assert ember_main(["keys", "list", "--config", str(config)]) == 2
    assert "cannot open PostgreSQL for the shared state" in capsys.readouterr().err


def test_a_key_marked_revoked_in_redis_is_refused_before_any_gateway_reloads_it(
    shared_state, replicas, start_gateway
):
    a, _ = replicas
    gateway, _ = two_gateways(start_gateway, a, shared_state)
    created = http.post(gateway.url + "/admin/keys", json={"name": "team"}, headers=ADMIN).json()
    assert chat(gateway, created["key"]).status_code == 200
    # Only the mark, as a revoking gateway writes it after its commit; PostgreSQL still holds the key live.
    mark = f"{shared_state['redis']['key_prefix']}:limits:{{{created['id']}}}:revoked"
    redis.Redis.from_url(REDIS_URL).set(mark, "1", ex=60)
    refused = chat(gateway, created["key"])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert (
        gateway.metric("ember_gateway_requests_total", model="tiny", key="team", replica="", status="401")
        == 1
    )
    assert gateway.metric("ember_gateway_rate_limited_total", key="team", limit="invalid_request_error") == 0
    listed = http.get(gateway.url + "/admin/keys", headers=ADMIN).json()["data"]
    assert [(k["name"], k["revoked_at"]) for k in listed] == [("team", None)]


def test_usage_and_budget_are_counted_once_across_gateways(shared_state, replicas, start_gateway):
    a, _ = replicas
    first, second = two_gateways(start_gateway, a, shared_state)
    key = http.post(first.url + "/admin/keys", json={"name": "k", "token_budget": 40}, headers=ADMIN).json()[
        "key"
    ]
    wait_until(
        lambda: usage(second, key).get("key") == "k", timeout_s=2, what="the key on the second gateway"
    )
    # Each request is estimated at 21 tokens (4 + ceil(2 / 4) + max_tokens 16); the replica reports 10.
    assert chat(first, key).status_code == 200
    assert chat(second, key).status_code == 200
    wait_until(lambda: usage(first, key)["total_tokens"] == 20, what="both gateways' usage in PostgreSQL")
    refused = chat(first, key)  # 20 used + 21 > 40, whichever gateway served the first 20
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    assert "has 20 of its token budget of 40 tokens left" in refused.json()["error"]["message"]
    assert chat(second, key, max_tokens=10).status_code == 200  # 20 + 15 <= 40
    for gateway in (first, second):
        wait_until(lambda: usage(gateway, key)["total_tokens"] == 30, what="the third request's usage")  # noqa: B023
        totals = usage(gateway, key)
        assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == (3, 21, 9)
        assert totals["budget_remaining"] == 10 and totals["tokens_reserved"] == 0
    first.server.stop()
    second.server.stop()  # shutdown flushes; PostgreSQL holds each request once
    schema = shared_state["postgres"]["schema"]
    rows = run_sql(f'SELECT requests, prompt_tokens, completion_tokens FROM "{schema}".key_usage')
    assert [tuple(row) for row in rows] == [(3, 21, 9)]


def test_queued_job_of_a_key_revoked_on_another_gateway_does_not_run(shared_state, tmp_path):
    replica = FakeReplica("held").start()
    config = protocol_config(
        [replica.url], admin_key_sha256=sha256("sk-admin"), state=shared_state, keys={"inline": []}
    )
    config["async"] = {**config["async"], "jobs": {"concurrency": 1, "poll_interval_s": 0.05}}
    first = ProtocolGateway(config, tmp_path).start()
    second = ProtocolGateway(config, tmp_path).start()
    try:
        created = http.post(
            first.url + "/admin/keys", json={"name": "jobs", "endpoints": ["async"]}, headers=ADMIN
        )
        key = created.json()["key"]
        wait_until(
            lambda: usage(second, key).get("key") == "jobs", timeout_s=2, what="the key on the second gateway"
        )
        replica.hold()
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        submitted = [
            http.post(
                gateway.url + "/v1/async/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            for gateway in (first, second, first, second)
        ]
        assert [response.status_code for response in submitted] == [202] * 4
        wait_until(lambda: replica.in_flight == 2, what="one job running on each gateway")
        assert http.delete(first.url + "/admin/keys/jobs", headers=ADMIN).status_code == 200
        time.sleep(0.5)  # the revocation reaches the second gateway (NOTIFY) before the queued jobs run
        replica.release()
        schema = shared_state["postgres"]["schema"]

        def outcomes() -> list[
            tuple[str, str | None]
        ]:  # read from PostgreSQL: the revoked key cannot GET its jobs
            rows = run_sql(f"SELECT status, error::json->>'code' AS code FROM \"{schema}\".jobs")
            return sorted((row["status"], row["code"]) for row in rows)

        wait_until(
            lambda: all(status in ("succeeded", "failed") for status, _ in outcomes()), what="the four jobs"
        )
    finally:
        first.stop()
        second.stop()
        replica.stop()
    # The two jobs already running when the key was revoked finish; the two still queued never run.
    assert outcomes() == [("failed", "invalid_api_key")] * 2 + [("succeeded", None)] * 2
