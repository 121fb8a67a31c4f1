"""The console's data routes: /admin/console/series (the last hour in 5 s buckets, fed where the
gateway records its Prometheus metrics), /admin/console/fleet (with the autoscaler's last report) and
PUT /admin/autoscaler, where the autoscaler reports; all for the admin key (or control token) only."""

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
    assert (
        http.post(
            gateway.url + "/v1/chat/completions", headers={"authorization": "Bearer nope"}, json=CHAT
        ).status_code
        == 401
    )

    series = http.get(gateway.url + "/admin/console/series", headers=ADMIN).json()
    assert series["object"] == "console.series" and series["bucket_s"] == 5.0
    points = series["points"]
    requests_by_status: dict[str, float] = {}
    for point in points:
        for status, per_s in point["requests_per_s"].items():
            requests_by_status[status] = requests_by_status.get(status, 0) + per_s * 5
    assert requests_by_status == {"200": 3}  # an unauthenticated request names no model: not counted
    assert (
        gateway.metric("ember_gateway_requests_total", model="tiny", key="alice", replica="a", status="200")
        + gateway.metric("ember_gateway_requests_total", model="tiny", key="alice", replica="b", status="200")
        == 3
    )
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


def autoscaler_report(desired: int, states: list[str], decisions: list[dict]) -> dict:
    """The document Autoscaler.status() sends, for one model `auto`."""
    replicas = [{"id": f"auto-{n}", "url": f"http://127.0.0.1:{9000 + n}", "state": s, "cold_start_s": None}
                for n, s in enumerate(states)]  # fmt: skip
    return {"models": {"auto": {"min_replicas": 0, "max_replicas": 3, "desired": desired, "replicas": replicas}},
            "decisions": decisions}  # fmt: skip


def decision(time: str, current: int, desired: int, reason: str, detail: str = "") -> dict:
    return {
        "time": time,
        "model": "auto",
        "current": current,
        "desired": desired,
        "reason": reason,
        "detail": detail,
    }


def test_the_fleet_shows_the_autoscalers_last_report(replicas, start_gateway):
    auto = {
        "deployments": [{"replicas": []}],
        "autoscaling": {"min_replicas": 0, "max_replicas": 3, "ttft_p90_ms": 500, "itl_p90_ms": 50},
    }
    config = gateway_config(
        {"tiny": model_config(*replicas), "auto": auto}, [KEY], admin_key_sha256=sha256("sk-admin")
    )
    gateway = start_gateway(config)

    def autoscaling() -> dict:
        models = http.get(gateway.url + "/admin/console/fleet", headers=ADMIN).json()["models"]
        return next(model for model in models if model["name"] == "auto")["autoscaling"]

    assert autoscaling()["autoscaler"] is None  # nothing reported yet
    decisions = [
        decision("2026-12-04T18:00:00+00:00", 0, 1, "activate", "1 held, 0 loading"),
        decision("2026-12-04T18:00:05+00:00", 1, 2, "panic", "queue 9 on 1 ready"),
    ]
    report = autoscaler_report(2, ["ready", "loading", "draining"], decisions)
    stored = http.put(gateway.url + "/admin/autoscaler", headers=ADMIN, json=report)
    assert stored.status_code == 200 and stored.json()["object"] == "autoscaler.report"

    shown = autoscaling()["autoscaler"]
    assert (shown["current"], shown["desired"]) == (2, 2)  # ready + loading; the draining one is leaving
    assert shown["replicas_by_state"] == {"draining": 1, "loading": 1, "ready": 1}
    assert [(d["reason"], d["current"], d["desired"]) for d in shown["decisions"]] == [
        ("panic", 1, 2),
        ("activate", 0, 1),
    ]
    assert 0 <= shown["reported_s_ago"] < 5


def test_an_autoscaler_report_is_validated_and_needs_the_admin_key(replicas, start_gateway):
    gateway = start(start_gateway, replicas)
    report = autoscaler_report(1, ["ready"], [])
    assert http.put(gateway.url + "/admin/autoscaler", json=report).status_code == 401
    assert http.put(gateway.url + "/admin/autoscaler", headers=AUTH, json=report).status_code == 403
    too_many = autoscaler_report(1, [], [decision("2026-12-04T18:00:00+00:00", 0, 1, "activate")] * 201)
    for bad, param in (
        ({"models": {}}, "decisions"),
        (too_many, "decisions"),
        ({**report, "models": []}, "models"),
    ):
        refused = http.put(gateway.url + "/admin/autoscaler", headers=ADMIN, json=bad)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
