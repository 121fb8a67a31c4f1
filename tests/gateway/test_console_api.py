"""The console's data routes: /admin/console/series (the last hour in 5 s buckets, fed where the
gateway records its Prometheus metrics) and /admin/console/fleet, both for the admin key only."""

from __future__ import annotations

import httpx
from gateway_harness import gateway_config, http, model_config, sha256

from ember.gateway.console.series import ConsoleSeries, percentile

KEY = {"name": "alice", "secret": "sk-test-alice"}
AUTH = {"authorization": "Bearer sk-test-alice"}
ADMIN = {"authorization": "Bearer sk-admin"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def start(start_gateway, replicas, **metrics):
    config = gateway_config(
        {"tiny": model_config(*replicas)}, [KEY], admin_key_sha256=sha256("sk-admin"), metrics=metrics
    )
    return start_gateway(config)


def test_series_count_requests_tokens_and_cost_as_prometheus_does(replicas, start_gateway):
    gateway = start(start_gateway, replicas, replica_price_per_hour=3.6)
    for _ in range(2):
        assert http.post(gateway.url + "/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", headers=AUTH, json={**CHAT, "stream": True}
    ) as response:
        assert response.status_code == 200
        response.read()
    assert http.post(gateway.url + "/v1/chat/completions", headers={"authorization": "Bearer nope"}, json=CHAT).status_code == 401

    series = http.get(gateway.url + "/admin/console/series", headers=ADMIN).json()
    assert series["object"] == "console.series" and series["bucket_s"] == 5.0
    points = series["points"]
    requests_by_status: dict[str, float] = {}
    for point in points:
        for status, per_s in point["requests_per_s"].items():
            requests_by_status[status] = requests_by_status.get(status, 0) + per_s * 5
    assert requests_by_status == {"200": 3}  # an unauthenticated request names no model: not counted
    assert gateway.metric("ember_gateway_requests_total", model="tiny", key="alice", replica="a", status="200") + \
        gateway.metric("ember_gateway_requests_total", model="tiny", key="alice", replica="b", status="200") == 3
    # Each fake reply has 3 completion tokens; the stream's usage is forced by the gateway.
    assert sum(point["output_tokens_per_s"] * 5 for point in points) == 9
    ttfts = [point["ttft_s"]["p50"] for point in points if point["ttft_s"]["p50"] is not None]
    assert ttfts and all(0 < value < 5 for value in ttfts)
    assert any(point["itl_s"]["p50"] is not None for point in points)  # from the stream
    # Two healthy replicas at 3.6 an hour cost 0.01 per 5 s bucket.
    for point in points:
        if point["output_tokens_per_s"]:
            tokens = point["output_tokens_per_s"] * 5
            assert abs(point["cost_per_1m_output_tokens"] - 0.01 / tokens * 1e6) < 1e-6


def test_fleet_lists_models_and_replicas_with_their_state(replicas, start_gateway):
    gateway = start(start_gateway, replicas)
    fleet = http.get(gateway.url + "/admin/console/fleet", headers=ADMIN).json()
    assert [model["name"] for model in fleet["models"]] == ["tiny"]
    assert fleet["models"][0]["replicas"] == 2 and fleet["models"][0]["autoscaling"] is None
    assert sorted(r["id"] for r in fleet["replicas"]) == ["a", "b"]
    assert {"waiting", "running", "kv_usage"} <= set(fleet["replicas"][0]["metrics"])


def test_console_data_needs_the_admin_key_but_the_page_does_not(replicas, start_gateway):
    gateway = start(start_gateway, replicas)
    for path in ("/admin/console/series", "/admin/console/fleet"):
        response = http.get(gateway.url + path)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_admin_key"
        response = http.get(gateway.url + path, headers=AUTH)
        assert (response.status_code, response.json()["error"]["code"]) == (403, "endpoint_not_allowed")
    response = http.get(gateway.url + "/admin/console/series?since_s=0", headers=ADMIN)
    assert response.status_code == 400 and response.json()["error"]["param"] == "query.since_s"
    page = http.get(gateway.url + "/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # nothing loaded from elsewhere
    assert "default-src 'self'" in page.headers["content-security-policy"]
    script = http.get(gateway.url + "/console/gateway.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    missing = http.get(gateway.url + "/console/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"


def test_series_buckets_roll_over_and_keep_one_hour():
    now = [1000.0]
    series = ConsoleSeries(clock=lambda: now[0])
    for _ in range(800):  # 800 buckets of 5 s: more than the hour's 720
        series.request("200")
        now[0] += 5
    points = series.to_json(3600, None)["points"]
    assert len(points) == 720 and points[-1]["t"] == 1000.0 + 799 * 5
    assert points[-1]["requests_per_s"] == {"200": 0.2}
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and percentile([], 0.9) is None
