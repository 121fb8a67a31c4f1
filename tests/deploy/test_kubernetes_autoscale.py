"""`ember autoscale` end to end: the autoscaler of a fleet file against fake_kube_api (official client)
and the real gateway discovering the Deployment's pods (FakeReplicas on 127.0.0.x). A burst scales the
Deployment up through its scale subresource; idle scales it down, the chosen pod out of routing first."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from gateway_harness import http
from kube_scenario import AUTH, DEPLOYMENT, IDS, PODS

from ember.cli import main
from ember.commands.autoscale import autoscale, gateway_url
from ember.commands.up import default_fleet_path
from ember.control.autoscaling.kubernetes_provider import DELETION_COST, LOWEST_DELETION_COST, fleet_targets
from ember.control.fleet import FleetError, load_fleet

SCALE_PATH = f"/apis/apps/v1/namespaces/ember/deployments/{DEPLOYMENT}/scale"
BURST = 10  # requests held at once: 8 fill the two pods' capacity (4 each), 2 wait in the gateway's queue


def fleet_file(tmp_path, gateway_url: str | None, **autoscaling) -> str:
    tiny = {
        "deployments": [{"name": "main", "model": "tiny-v1", "discovery": {"kubernetes": {"service": DEPLOYMENT, "port": "http"}}}],
        "autoscaling": {"min_replicas": 2, "max_replicas": 3, "ttft_p90_ms": 60_000, "itl_p90_ms": 60_000,
                        "scale_down_delay_s": 0.5, "stable_window_s": 2, "panic_window_s": 1, **autoscaling},
    }  # fmt: skip
    kubernetes = {"namespace": "ember", "autoscaler": {"gateway_url": gateway_url} if gateway_url else {}}
    fleet = {
        "models": {"tiny": tiny},
        "launch": {"autoscaled": {"tiny": {"capacity": 4}}, "autoscaler": {"interval_s": 0.2}, "kubernetes": kubernetes},
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return str(path)


async def until(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def test_the_fleet_names_the_rendered_deployment_and_gateway_service(tmp_path):
    fleet = load_fleet(fleet_file(tmp_path, None))
    (target,) = fleet_targets(fleet).values()
    assert (target.deployment, target.service, target.namespace, target.port) == (DEPLOYMENT, DEPLOYMENT, "ember", 8000)
    assert gateway_url(fleet) == "http://ember-gateway.ember.svc:8000"


def test_autoscale_without_a_token_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EMBER_GATEWAY_CONTROL_TOKEN", raising=False)
    assert main(["autoscale", fleet_file(tmp_path, None)]) == 2
    assert capsys.readouterr().err == (
        "ember autoscale: error: set EMBER_GATEWAY_CONTROL_TOKEN to the gateway's control token or admin key "
        "(its drain calls need it)\n"
    )


def test_autoscale_of_a_fleet_without_autoscaled_models_is_refused(monkeypatch):
    monkeypatch.setenv("EMBER_GATEWAY_CONTROL_TOKEN", "token")
    with pytest.raises(FleetError, match="no model has an autoscaling section"):
        asyncio.run(autoscale(load_fleet(default_fleet_path())))


async def test_burst_scales_the_deployment_up_and_idle_scales_it_down_after_a_drain(gateway, fake_api, pods, tmp_path):
    fake_api.set_ready(PODS[0])
    fake_api.set_ready(PODS[1])
    await until(lambda: len(gateway.dispatcher.pool.healthy("tiny")) == 2, "the gateway to route to 2 pods")
    fleet = load_fleet(fleet_file(tmp_path, gateway.url))
    stop = asyncio.Event()
    running = asyncio.create_task(autoscale(fleet, stop))
    try:
        # Burst: every request held on the pods, more than their capacity: the Deployment goes to 3.
        for pod in pods:
            pod.hold()
        with ThreadPoolExecutor(BURST) as pool:
            burst = [pool.submit(chat_through, gateway) for _ in range(BURST)]
            await until(lambda: fake_api.deployments[DEPLOYMENT].replicas == 3, "the scale-up patch")
            scale_patches = [body["spec"]["replicas"] for path, body, _ in fake_api.patches if path == SCALE_PATH]
            assert scale_patches == [3]
            fake_api.set_ready(PODS[2])
            await until(lambda: len(gateway.dispatcher.pool.healthy("tiny")) == 3, "the gateway to route to pod 3")
            for pod in pods:
                pod.release()
            assert [future.result() for future in burst] == [200] * BURST

        # Idle: one pod is chosen, annotated, out of routing (drained), and only then the Deployment shrinks.
        order: list[str] = []

        def watch() -> bool:
            chosen = [pod for pod in PODS if fake_api.pods[pod].annotations.get(DELETION_COST) == LOWEST_DELETION_COST]
            if chosen and "out of routing" not in order and gateway.dispatcher.pool.get(f"ember/{DEPLOYMENT}/{chosen[0]}") is None:
                order.append("out of routing")
            if fake_api.deployments[DEPLOYMENT].replicas == 2 and "scaled to 2" not in order:
                order.append("scaled to 2")
            return len(order) == 2

        await until(watch, "the scale-down")
        assert order == ["out of routing", "scaled to 2"]
        scale_patches = [body["spec"]["replicas"] for path, body, _ in fake_api.patches if path == SCALE_PATH]
        assert scale_patches == [3, 2]
        (chosen,) = [pod for pod in PODS if fake_api.pods[pod].annotations.get(DELETION_COST) == LOWEST_DELETION_COST]
        # The ReplicaSet deleted the pod the autoscaler chose, and the gateway no longer routes to it.
        assert [pod for pod in PODS if fake_api.pods[pod].terminating] == [chosen]
        assert {replica.id for replica in gateway.dispatcher.pool.healthy("tiny")} == set(IDS) - {f"ember/{DEPLOYMENT}/{chosen}"}
        fake_api.finish_deletion(chosen)
        await asyncio.sleep(1.0)  # a few more rounds: min_replicas holds it at 2
        assert fake_api.deployments[DEPLOYMENT].replicas == 2
    finally:
        stop.set()
        assert await running == 0


def chat_through(gateway) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    return http.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH).status_code
