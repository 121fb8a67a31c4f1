"""The Kubernetes provider against fake_kube_api through the official client, with the real gateway
discovering the same Deployment's pods (FakeReplicas on 127.0.0.x)."""

from __future__ import annotations

import asyncio
import time

from gateway_harness import http
from kube_scenario import AUTH, CONTROL_TOKEN, DEPLOYMENT, IDS, PODS

from ember.control.autoscaling.kubernetes_provider import (
    DELETION_COST,
    LOWEST_DELETION_COST,
    KubernetesProvider,
    KubernetesTarget,
)
from ember.control.autoscaling.provider import GatewayAdmin, ReplicaState
from ember.kube_client import api_client

SCALE_PATH = f"/apis/apps/v1/namespaces/ember/deployments/{DEPLOYMENT}/scale"


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def chat_replica(gateway) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    response = http.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 200
    return response.headers["x-ember-replica"]


def states(provider: KubernetesProvider) -> dict[str, ReplicaState]:
    return {replica.id: replica.state for replica in provider.list_replicas("tiny")}


async def test_scale_up_and_down_through_the_scale_subresource_with_a_drain_first(gateway, fake_api, pods):
    admin = GatewayAdmin(gateway.url, CONTROL_TOKEN, drain_timeout_s=10)
    target = KubernetesTarget(DEPLOYMENT, DEPLOYMENT, "ember", port=pods[0].server.port)
    provider = KubernetesProvider({"tiny": target}, admin, api_client(), log=lambda line: None)
    try:
        # Two pods, neither Ready: neither counts as ready.
        assert states(provider) == {IDS[0]: ReplicaState.LOADING, IDS[1]: ReplicaState.LOADING}
        fake_api.set_ready(PODS[0])
        fake_api.set_ready(PODS[1])
        assert states(provider) == {IDS[0]: ReplicaState.READY, IDS[1]: ReplicaState.READY}
        (first,) = [r for r in provider.list_replicas("tiny") if r.id == IDS[0]]
        assert first.url == pods[0].url and first.cold_start_s is not None and first.cold_start_s >= 0

        # Up, through a 409: someone else scaled between the provider's read and its patch.
        fake_api.conflict_next_patch = True
        started = await provider.start_replica("tiny")
        assert started.state == ReplicaState.LOADING and started.id == f"ember/{DEPLOYMENT}/pending-3"
        patches = [(body, content_type) for path, body, content_type in fake_api.patches if path == SCALE_PATH]
        assert [body["spec"]["replicas"] for body, _ in patches] == [3, 3]
        assert patches[0][0]["metadata"]["resourceVersion"] != patches[1][0]["metadata"]["resourceVersion"]
        assert {content_type for _, content_type in patches} == {"application/strategic-merge-patch+json"}
        assert fake_api.deployments[DEPLOYMENT].replicas == 3
        assert states(provider)[IDS[2]] == ReplicaState.LOADING  # created, not Ready
        fake_api.set_ready(PODS[2])
        await until(lambda: len(gateway.dispatcher.pool.healthy("tiny")) == 3, "the gateway to route to 3 pods")
        assert list(states(provider).values()) == [ReplicaState.READY] * 3

        # Down: pod 3 is chosen, out of routing and drained before the Deployment shrinks.
        pods[2].hold()
        held = asyncio.create_task(asyncio.to_thread(lambda: [chat_replica(gateway) for _ in range(3)]))  # until one sticks on pod 3
        await until(lambda: pods[2].in_flight == 1, "a request held on pod 3")
        stopping = asyncio.create_task(provider.stop_replica(IDS[2]))
        await until(lambda: gateway.dispatcher.pool.get(IDS[2]) is None, "pod 3 out of routing")
        assert fake_api.pods[PODS[2]].annotations == {DELETION_COST: LOWEST_DELETION_COST}
        assert states(provider)[IDS[2]] == ReplicaState.DRAINING
        assert fake_api.deployments[DEPLOYMENT].replicas == 3  # not scaled down while a request runs on it
        assert {chat_replica(gateway) for _ in range(4)} == {IDS[0], IDS[1]}
        pods[2].release()
        await stopping
        assert IDS[2] in await held  # the request held on pod 3 finished there (with a 200)
        assert fake_api.deployments[DEPLOYMENT].replicas == 2
        # The ReplicaSet deleted the pod with the lowest deletion cost: pod 3, not the oldest.
        assert [pod for pod in PODS if fake_api.pods[pod].terminating] == [PODS[2]]
        assert states(provider) == {IDS[0]: ReplicaState.READY, IDS[1]: ReplicaState.READY, IDS[2]: ReplicaState.DRAINING}
        fake_api.finish_deletion(PODS[2])
        assert states(provider) == {IDS[0]: ReplicaState.READY, IDS[1]: ReplicaState.READY}

        # A replica started and stopped before it was Ready: only the count goes down, and the
        # ReplicaSet removes the not-Ready pod first.
        pending = await provider.start_replica("tiny")
        await provider.stop_replica(pending.id)
        assert fake_api.deployments[DEPLOYMENT].replicas == 2
        assert [pod.name for pod in fake_api.pods.values() if pod.terminating] == [f"{DEPLOYMENT}-00004"]
    finally:
        await provider.close()
