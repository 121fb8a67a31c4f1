"""The gateway's `metrics:` config: /metrics open (default) or for the admin key only, and what the
per-key series carry in their `key` label (the key's name by default, its id, or nothing)."""

from __future__ import annotations

import pytest
from gateway_harness import gateway_config, http, model_config, sha256

from ember.gateway.config import GatewayConfigError, KeyPolicy, parse_config
from ember.gateway.keys import KeyStore

KEY = {"name": "alice", "secret": "sk-test-alice"}
AUTH = {"authorization": "Bearer sk-test-alice"}
ADMIN = {"authorization": "Bearer sk-admin"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def start(start_gateway, replica, **metrics):
    config = gateway_config({"tiny": model_config(replica)}, [KEY], admin_key_sha256=sha256("sk-admin"))
    if metrics:
        config["metrics"] = metrics
    return start_gateway(config)


def one_request(gateway) -> None:
    assert http.post(gateway.url + "/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200


def test_by_default_metrics_are_open_and_labelled_by_key_name(replicas, start_gateway):
    gateway = start(start_gateway, replicas[0])
    one_request(gateway)
    response = http.get(gateway.url + "/metrics")
    assert response.status_code == 200
    assert 'ember_gateway_tokens_total{key="alice",kind="completion"} 3.0' in response.text
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="alice", replica="a", status="200") == 1


def test_require_auth_serves_metrics_to_the_admin_key_only(replicas, start_gateway):
    gateway = start(start_gateway, replicas[0], require_auth=True)
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        response = http.get(gateway.url + "/metrics", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_admin_key"
    # A normal key is outside the admin scope (see test_key_scopes for keys scoped to admin).
    response = http.get(gateway.url + "/metrics", headers=AUTH)
    assert (response.status_code, response.json()["error"]["code"]) == (403, "endpoint_not_allowed")
    response = http.get(gateway.url + "/metrics", headers=ADMIN)
    assert response.status_code == 200 and "ember_gateway_requests_total" in response.text
    # Probes stay open.
    assert http.get(gateway.url + "/health").status_code == 200


def test_key_labels_id_labels_by_the_stored_keys_id(replicas, start_gateway, tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    key, record = store.create("bob", KeyPolicy())
    store.close()
    config = gateway_config({"tiny": model_config(replicas[0])}, [], metrics={"key_labels": "id"})
    config["keys"]["store"] = str(tmp_path / "keys.db")
    gateway = start_gateway(config)
    response = http.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=CHAT)
    assert response.status_code == 200
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key=record.id, replica="a", status="200") == 1
    assert "bob" not in http.get(gateway.url + "/metrics").text


def test_key_labels_none_keeps_one_series_for_all_keys(replicas, start_gateway):
    gateway = start(start_gateway, replicas[0], key_labels="none")
    one_request(gateway)
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="", replica="a", status="200") == 1
    assert gateway.metric("ember_gateway_tokens_total", key="", kind="prompt") == 7
    assert "alice" not in http.get(gateway.url + "/metrics").text


def test_require_auth_without_an_admin_key_is_a_config_error():
    config = gateway_config({"tiny": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:1"}]}]}}, [])
    with pytest.raises(GatewayConfigError, match="metrics.require_auth needs admin_key_sha256"):
        parse_config({**config, "metrics": {"require_auth": True}})
    with pytest.raises(GatewayConfigError, match="metrics.key_labels"):
        parse_config({**config, "metrics": {"key_labels": "email"}})
