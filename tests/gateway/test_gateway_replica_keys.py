"""Replica keys: the gateway sends each replica its own configured key (`api_key`, `api_key_env`,
per deployment or per replica) on proxied requests, health probes and metrics scrapes, and never
forwards the client's key. The fleet credential of `ember up` runs end to end in
test_routing_fleet_e2e.py."""

from __future__ import annotations

import pytest
from gateway_harness import gateway_config, http, wait_until

from ember.gateway.config import GatewayConfigError, parse_config, with_replica_api_keys

CLIENT_KEY = "sk-client-key"


def test_each_replica_gets_its_own_key_on_every_request_and_never_the_clients(replicas, start_gateway, monkeypatch):
    a, b = replicas
    monkeypatch.setenv("REPLICA_A_KEY", "sk-replica-a")
    config = gateway_config(
        {
            "tiny": {"deployments": [{"api_key_env": "REPLICA_A_KEY", "replicas": [{"url": a.url, "id": "a"}]}]},
            "other": {"deployments": [{"api_key": "sk-deployment", "replicas": [
                {"url": b.url, "id": "b", "api_key": "sk-replica-b"}]}]},  # the replica's own key wins
        },  # fmt: skip
        [{"name": "client", "secret": CLIENT_KEY}],
        scrape={"interval_s": 0.1},
    )
    gateway = start_gateway(config)
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
    for model in ("tiny", "other"):
        for stream in (False, True):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            response = http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
    wait_until(lambda: "/metrics" in a.authorizations and "/metrics" in b.authorizations, what="a metrics scrape")
    for replica, key in ((a, "sk-replica-a"), (b, "sk-replica-b")):
        assert replica.authorizations == {
            "/v1/chat/completions": {f"Bearer {key}"},
            "/health": {f"Bearer {key}"},
            "/metrics": {f"Bearer {key}"},
        }


def test_a_replica_without_a_configured_key_gets_no_authorization(replicas, start_gateway):
    a, _ = replicas
    config = gateway_config({"tiny": {"deployments": [{"replicas": [{"url": a.url}]}]}}, [{"name": "c", "secret": CLIENT_KEY}])
    gateway = start_gateway(config)
    body = {"model": "tiny", "prompt": "hi"}
    response = http.post(gateway.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert response.status_code == 200
    assert a.authorizations["/v1/completions"] == {None}


def test_replica_key_settings_are_checked_when_the_config_loads(monkeypatch):
    monkeypatch.delenv("UNSET_REPLICA_KEY", raising=False)

    def config(**credential) -> dict:
        return {"models": {"tiny": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:9", **credential}]}]}}}

    with pytest.raises(GatewayConfigError, match=r"models\.tiny\.deployments\[0\]\.replicas\[0\]: set api_key or api_key_env, not both"):
        parse_config(config(api_key="k", api_key_env="K"))
    with pytest.raises(GatewayConfigError, match=r"replicas\[0\]: api_key_env: the environment variable UNSET_REPLICA_KEY is not set"):
        parse_config(config(api_key_env="UNSET_REPLICA_KEY"))
    keyed = with_replica_api_keys(parse_config(config(id="r1", api_key="old")), {"r1": "fleet-credential"})
    assert keyed.models["tiny"].deployments[0].replicas[0].replica_api_key == "fleet-credential"
    with pytest.raises(GatewayConfigError, match=r"no replica under models has the id\(s\): r2"):
        with_replica_api_keys(keyed, {"r2": "fleet-credential"})
