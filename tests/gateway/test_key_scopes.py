"""Per-key scopes: a key may be limited to models and to endpoints (chat, completions, batch, async,
admin; by default all but admin). Keys come from `ember keys create` and the admin API, requests go
over HTTP, WebSocket and gRPC to a real gateway; anything outside a key's scope is a 403 in OpenAI's
shape. Keys stored before scopes existed keep working as before."""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import sys

import grpc
import httpx
import pytest
from gateway_harness import FakeReplica, free_port, sha256
from protocols_support import ProtocolGateway, protocol_config
from websockets.sync.client import connect

from ember.gateway.config import KeyPolicy
from ember.gateway.keys import KeyStore
from ember.gateway.proto.ember.v1 import inference_pb2 as pb
from ember.gateway.proto.ember.v1 import inference_pb2_grpc as pb_grpc

ADMIN = {"authorization": "Bearer sk-admin"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
BATCH_LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


@pytest.fixture(scope="module")
def replica():
    replica = FakeReplica("r").start()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("keys") / "keys.db"


@pytest.fixture(scope="module")
def gateway(replica, store_path, tmp_path_factory):
    config = protocol_config([replica.url], admin_key_sha256=sha256("sk-admin"))
    config["keys"]["store"] = str(store_path)
    config["models"]["other"] = {"deployments": [{"replicas": [{"url": replica.url, "id": "other-r0"}]}]}
    gateway = ProtocolGateway(config, tmp_path_factory.mktemp("gateway"), grpc_port=free_port()).start()
    yield gateway
    gateway.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def cli_create(store_path, name: str, *options: str) -> dict:
    command = [sys.executable, "-m", "ember.cli", "keys", "create", "--db", str(store_path), "--name", name, "--json"]
    finished = subprocess.run([*command, *options], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(finished.stdout)


def assert_forbidden(response: httpx.Response, code: str) -> str:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("permission_error", code)
    return error["message"]


def upload(gateway, key: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/files",
        headers=bearer(key),
        data={"purpose": "batch"},
        files={"file": ("batch.jsonl", io.BytesIO(json.dumps(BATCH_LINE).encode()))},
        timeout=30,
    )


def test_a_key_scoped_by_the_cli_is_held_to_its_models_and_endpoints(gateway, store_path):
    created = cli_create(store_path, "narrow", "--models", "tiny", "--endpoints", "chat,completions")
    assert (created["models"], created["endpoints"]) == (["tiny"], ["chat", "completions"])
    key = created["key"]
    url = gateway.url

    assert httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), json=CHAT).status_code == 200
    assert httpx.post(f"{url}/v1/completions", headers=bearer(key), json=COMPLETION).status_code == 200
    message = assert_forbidden(
        httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), json={**CHAT, "model": "other"}),
        "model_not_allowed",
    )
    assert message == "API key 'narrow' may not use model `other`."
    message = assert_forbidden(
        httpx.post(f"{url}/v1/async/chat/completions", headers=bearer(key), json=CHAT), "endpoint_not_allowed"
    )
    assert message == "API key 'narrow' may not use the async endpoint; it may use: chat, completions."
    assert_forbidden(upload(gateway, key), "endpoint_not_allowed")
    assert_forbidden(httpx.get(f"{url}/v1/batches", headers=bearer(key)), "endpoint_not_allowed")
    assert_forbidden(httpx.get(f"{url}/admin/keys", headers=bearer(key)), "endpoint_not_allowed")


def test_endpoint_scopes_hold_on_websocket_and_grpc(gateway, store_path, replica):
    key = cli_create(store_path, "chat-only", "--endpoints", "chat")["key"]
    received_before = len(replica.requests)
    with connect(gateway.ws_url, additional_headers=bearer(key)) as socket:
        socket.send(json.dumps({"type": "completions", "id": "c1", "body": COMPLETION}))
        frame = json.loads(socket.recv(timeout=30))
    assert (frame["type"], frame["id"], frame["status"]) == ("error", "c1", 403)
    assert frame["error"]["code"] == "endpoint_not_allowed"
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi"), metadata=[("authorization", f"Bearer {key}")])
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may not use the completions endpoint" in caught.value.details()
        chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")])
        reply = stub.Complete(pb.GenerateRequest(model="tiny", chat=chat), metadata=[("authorization", f"Bearer {key}")])
        assert reply.text == "Hello from r"
    assert len(replica.requests) == received_before + 1


def test_the_admin_api_creates_scoped_keys_and_an_admin_scoped_key_may_use_it(gateway):
    response = httpx.post(
        f"{gateway.url}/admin/keys", headers=ADMIN, json={"name": "ops", "models": ["tiny"], "endpoints": ["admin"]}
    )
    assert response.status_code == 201, response.text
    ops = response.json()
    assert ops["endpoints"] == ["admin"]
    listed = httpx.get(f"{gateway.url}/admin/keys", headers=bearer(ops["key"]))
    assert listed.status_code == 200
    assert {key["name"]: key["endpoints"] for key in listed.json()["data"]}["ops"] == ["admin"]
    assert_forbidden(
        httpx.post(f"{gateway.url}/v1/chat/completions", headers=bearer(ops["key"]), json=CHAT), "endpoint_not_allowed"
    )
    refused = httpx.post(f"{gateway.url}/admin/keys", headers=ADMIN, json={"name": "bad", "endpoints": ["embeddings"]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "endpoints.0"


def test_a_key_stored_before_scopes_existed_behaves_as_before(gateway, store_path):
    store = KeyStore(store_path)
    key, record = store.create("legacy", KeyPolicy(models=["tiny"]))
    store.close()
    with sqlite3.connect(store_path) as db:  # the policy JSON an older gateway wrote: no endpoints
        policy = json.loads(db.execute("SELECT policy FROM api_keys WHERE id = ?", (record.id,)).fetchone()[0])
        del policy["endpoints"]
        db.execute("UPDATE api_keys SET policy = ? WHERE id = ?", (json.dumps(policy), record.id))
    url = gateway.url
    assert httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), json=CHAT).status_code == 200
    assert httpx.post(f"{url}/v1/completions", headers=bearer(key), json=COMPLETION).status_code == 200
    assert httpx.post(f"{url}/v1/async/completions", headers=bearer(key), json=COMPLETION).status_code == 202
    assert upload(gateway, key).status_code == 200
    assert_forbidden(
        httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), json={**CHAT, "model": "other"}),
        "model_not_allowed",
    )
    assert_forbidden(httpx.get(f"{url}/admin/keys", headers=bearer(key)), "endpoint_not_allowed")


def test_the_cli_refuses_an_unknown_endpoint(store_path):
    command = [sys.executable, "-m", "ember.cli", "keys", "create", "--db", str(store_path), "--name", "x"]
    finished = subprocess.run([*command, "--endpoints", "chat,embeddings"], capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0
    assert "endpoints" in finished.stderr and "Traceback" not in finished.stderr
