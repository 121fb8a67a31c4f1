"""Who may call: 401/403 in OpenAI's shape, the SQLite key store and its CLI, the admin API."""

from __future__ import annotations

import httpx
from gateway_harness import gateway_config, http, model_config, sha256

from ember.cli import main as ember_main

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def post(gateway, authorization: str | None, body: dict = CHAT) -> httpx.Response:
    headers = {"authorization": authorization} if authorization is not None else {}
    return http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_missing_unknown_and_forbidden_keys(replicas, start_gateway):
    a, b = replicas
    gateway = start_gateway(
        gateway_config(
            {"tiny": model_config(a), "other": model_config(b)},
            [{"name": "narrow", "secret": "sk-narrow", "models": ["other"]}],
        )
    )
    missing = post(gateway, None)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert post(gateway, "Basic abc").json()["error"]["code"] == "missing_api_key"
    unknown = post(gateway, "Bearer sk-wrong")
    assert unknown.status_code == 401
    assert unknown.json() == {
        "error": {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    forbidden = post(gateway, "Bearer sk-narrow")
    assert forbidden.status_code == 403
    assert forbidden.json()["error"] == {
        "message": "API key 'narrow' may not use model `tiny`.",
        "type": "permission_error",
        "param": "model",
        "code": "model_not_allowed",
    }
    assert post(gateway, "Bearer sk-narrow", {**CHAT, "model": "other"}).status_code == 200
    assert a.requests == [] and len(b.requests) == 1
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="narrow", replica="", status="403") == 1


def test_key_store_cli_create_and_revoke_take_effect_on_a_running_gateway(replicas, start_gateway, tmp_path, capsys):
    a, _ = replicas
    db = tmp_path / "keys.db"
    assert ember_main(["keys", "create", "--db", str(db), "--name", "alice", "--models", "tiny", "--rpm", "60"]) == 0
    key = capsys.readouterr().out.splitlines()[0]
    assert key.startswith("sk-ember-")
    assert key not in db.read_bytes().decode("latin-1")  # only the digest is stored
    gateway = start_gateway({**gateway_config({"tiny": model_config(a)}, []), "keys": {"store": "keys.db"}})
    ok = post(gateway, f"Bearer {key}")
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "60"
    assert ember_main(["keys", "revoke", "--db", str(db), "alice"]) == 0
    revoked = post(gateway, f"Bearer {key}")
    assert revoked.status_code == 401 and revoked.json()["error"]["code"] == "invalid_api_key"
    assert ember_main(["keys", "list", "--db", str(db), "--all", "--json"]) == 0
    listed = capsys.readouterr().out
    assert '"name": "alice"' in listed and '"revoked_at": null' not in listed
    assert ember_main(["keys", "revoke", "--db", str(db), "alice"]) == 2
    assert "no key with id or name 'alice'" in capsys.readouterr().err


def test_admin_api_manages_keys(replicas, start_gateway):
    a, _ = replicas
    config = gateway_config({"tiny": model_config(a)}, [], admin_key_sha256=sha256("sk-admin"))
    config["keys"]["store"] = "keys.db"
    gateway = start_gateway(config)
    admin = {"authorization": "Bearer sk-admin"}
    assert http.get(gateway.url + "/admin/keys").status_code == 401
    assert http.get(gateway.url + "/admin/keys", headers={"authorization": "Bearer sk-x"}).status_code == 401
    bad = http.post(gateway.url + "/admin/keys", json={"name": "bob", "rpm": -1}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
    blank = http.post(gateway.url + "/admin/keys", json={"name": "   "}, headers=admin)
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "name", blank.text
    for field in ('"name": "\\ud800"', '"name": "bob", "models": ["\\udfff"]'):  # lone surrogates: were 500s
        json_headers = {**admin, "content-type": "application/json"}
        bad = http.post(gateway.url + "/admin/keys", content="{" + field + "}", headers=json_headers)
        assert bad.status_code == 400 and "lone surrogate" in bad.json()["error"]["message"], bad.text
    created = http.post(
        gateway.url + "/admin/keys", json={"name": "bob", "models": ["tiny"], "priority": 2}, headers=admin
    )
    assert created.status_code == 201
    record = created.json()
    assert record["name"] == "bob" and record["priority"] == 2 and record["key"].startswith("sk-ember-")
    duplicate = http.post(gateway.url + "/admin/keys", json={"name": "bob"}, headers=admin)
    assert duplicate.status_code == 409
    assert post(gateway, f"Bearer {record['key']}").status_code == 200
    listed = http.get(gateway.url + "/admin/keys", headers=admin).json()["data"]
    assert [entry["name"] for entry in listed] == ["bob"] and "key" not in listed[0]
    assert http.delete(gateway.url + f"/admin/keys/{record['id']}", headers=admin).status_code == 200
    assert post(gateway, f"Bearer {record['key']}").status_code == 401
    assert http.delete(gateway.url + "/admin/keys/nobody", headers=admin).status_code == 404
    replicas_view = http.get(gateway.url + "/admin/replicas", headers=admin).json()["data"]
    assert [(entry["id"], entry["healthy"]) for entry in replicas_view] == [("a", True)]


def test_admin_api_is_disabled_without_an_admin_key(replicas, start_gateway):
    a, _ = replicas
    gateway = start_gateway(gateway_config({"tiny": model_config(a)}, []))
    response = http.get(gateway.url + "/admin/keys", headers={"authorization": "Bearer anything"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"
