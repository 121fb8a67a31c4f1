"""One Authorization and Content-Type rule (ember/http_rules.py) on both servers: a real `ember serve`
with --api-key and a real gateway (over a fake replica) with an inline key of the same secret get the
same requests and give the same answers."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import FakeReplica, GatewayServer, gateway_config, model_config
from protocols_support import start_ember_serve, stop_process

SECRET = "sk-shared-secret"
BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def serve_url(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    process, url = start_ember_serve(tiny_model_dir, log, max_model_len=256, extra_args=("--api-key", SECRET))
    yield url
    stop_process(process)


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    replica = FakeReplica("r").start()
    config = gateway_config({"tiny": model_config(replica)}, [{"secret": SECRET, "name": "shared"}])
    gateway = GatewayServer(config, tmp_path_factory.mktemp("gateway"))
    gateway.server.start()
    yield gateway.url
    gateway.server.stop()
    replica.stop()


@pytest.fixture(params=["serve", "gateway"])
def url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")


def post(url: str, headers: dict[str, str], content: bytes = BODY) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, content=content, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)


@pytest.mark.parametrize(
    "authorization",
    [f"Bearer {SECRET}", f"bearer {SECRET}", f"BEARER    {SECRET}", f"Bearer\t{SECRET}", f"beaRer \t {SECRET}"],
)
def test_bearer_scheme_in_any_case_with_any_whitespace(url, authorization):
    response = post(url, {"authorization": authorization, **JSON})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "authorization", [SECRET, f"Basic {SECRET}", "Bearer", "Bearer wrong", f"Bearer{SECRET}", f"Bearer {SECRET}x"]
)
def test_anything_else_is_401(url, authorization):
    assert post(url, {"authorization": authorization, **JSON}).status_code == 401


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_or_no_content_type_is_read_as_json(url, content_type):
    headers = {"authorization": f"Bearer {SECRET}"}
    if content_type is not None:
        headers["content-type"] = content_type
    response = post(url, headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded"]
)
def test_another_content_type_is_415(url, content_type):
    response = post(url, {"authorization": f"Bearer {SECRET}", "content-type": content_type})
    assert_error(response, 415, "unsupported_media_type")
    assert response.json()["error"]["message"].startswith(
        f"Content-Type must be application/json (or left out), got {content_type!r}."
    )


def test_the_415_tells_curl_users_what_to_add(url):
    response = post(url, {"authorization": f"Bearer {SECRET}", "content-type": "application/x-www-form-urlencoded"})
    assert response.json()["error"]["message"].endswith("add -H 'Content-Type: application/json'.)")


def test_the_gateways_other_json_routes_follow_the_rule(gateway_url):
    response = httpx.post(
        f"{gateway_url}/admin/keys", headers={"content-type": "text/plain"}, content=b'{"name": "x"}', timeout=30
    )
    assert_error(response, 415, "unsupported_media_type")
