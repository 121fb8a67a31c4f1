"""The gateway takes a model's replicas from a Service's EndpointSlices: the real gateway on loopback,
FakeReplica servers as the pods (127.0.0.x, one port, as pod IPs behind a Service), the official
`kubernetes` client talking to fake_kube_api through a kubeconfig."""

from __future__ import annotations

import concurrent.futures

from gateway_harness import GatewayServer, http, wait_until
from kube_scenario import AUTH, DEPLOYMENT, IDS, PODS
from kubernetes import client

from ember.gateway.config import KubernetesDiscovery
from ember.gateway.discovery import Endpoint, slice_endpoints


def chat(gateway: GatewayServer, model: str = "tiny"):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return http.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH)


def states(gateway: GatewayServer) -> dict[str, str]:
    return {
        replica.id: ("draining" if draining else "ready" if replica.healthy else "loading")
        for draining, replicas in ((False, gateway.dispatcher.pool.all()), (True, gateway.dispatcher.pool.draining()))
        for replica in replicas
    }


def watcher(gateway: GatewayServer):
    (only,) = gateway.app.discovery
    return only


def test_pods_join_routing_once_ready_and_static_urls_keep_working(gateway, fake_api, pods):
    assert chat(gateway, "plain").headers["x-ember-replica"] == "static"
    wait_until(lambda: fake_api.watches, what="the first watch")
    assert states(gateway) == {"static": "ready"}  # two pods, neither Ready yet
    refused = chat(gateway)
    assert refused.status_code == 503 and refused.json()["error"]["type"]
    fake_api.set_ready(PODS[0])
    wait_until(lambda: states(gateway).get(IDS[0]) == "ready", what="pod 1 admitted")
    replica = gateway.dispatcher.pool.get(IDS[0])
    assert (replica.url, replica.capacity, replica.upstream_model) == (pods[0].url, 4, "tiny-v1")
    served = chat(gateway)
    assert served.status_code == 200 and served.headers["x-ember-replica"] == IDS[0]
    assert served.json()["choices"][0]["message"]["content"] == f"Hello from {PODS[0]}"
    assert pods[0].requests[-1]["model"] == "tiny-v1"
    assert pods[0].authorizations["/v1/chat/completions"] == {"Bearer fleet-secret"}  # the fleet credential
    fake_api.set_ready(PODS[1])
    wait_until(lambda: states(gateway).get(IDS[1]) == "ready", what="pod 2 admitted")
    assert {chat(gateway).headers["x-ember-replica"] for _ in range(4)} == {IDS[0], IDS[1]}
    fake_api.set_ready(PODS[1], ready=False)  # its readiness probe fails: out of routing
    wait_until(lambda: IDS[1] not in states(gateway), what="pod 2 out of routing")
    assert [chat(gateway).headers["x-ember-replica"] for _ in range(3)] == [IDS[0]] * 3
    first_list, first_watch = fake_api.requests[0], fake_api.watches[0]
    assert first_list[1] == "/apis/discovery.k8s.io/v1/namespaces/ember/endpointslices"
    assert first_list[2] == {"labelSelector": f"kubernetes.io/service-name={DEPLOYMENT}"}
    assert first_watch["allowWatchBookmarks"] == "true" and first_watch["resourceVersion"] == "101"


def test_a_terminating_pod_is_drained_not_cut(gateway, fake_api, pods):
    fake_api.set_ready(PODS[0])
    fake_api.set_ready(PODS[1])
    wait_until(lambda: list(states(gateway).values()).count("ready") == 3, what="both pods admitted")
    pods[0].hold()
    pods[1].hold()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = [pool.submit(chat, gateway), pool.submit(chat, gateway)]
        wait_until(lambda: pods[0].in_flight == 1 and pods[1].in_flight == 1, what="one request held on each pod")
        fake_api.start_deletion(PODS[0])  # serving and terminating while its preStop sleeps
        wait_until(lambda: states(gateway).get(IDS[0]) == "draining", what="pod 1 draining")
        assert watcher(gateway).last_reaction_s is not None
        pods[1].release()
        assert [chat(gateway).headers["x-ember-replica"] for _ in range(3)] == [IDS[1]] * 3
        assert pods[0].in_flight == 1  # still running on the terminating pod
        pods[0].release()
        assert sorted(future.result().headers["x-ember-replica"] for future in in_flight) == sorted(IDS[:2])
        assert all(future.result().status_code == 200 for future in in_flight)
    wait_until(lambda: IDS[0] not in states(gateway), what="pod 1 forgotten once drained")
    fake_api.finish_deletion(PODS[0])
    assert states(gateway) == {"static": "ready", IDS[1]: "ready"}


def test_watches_resume_from_bookmarks_and_relist_after_410_gone(gateway, fake_api, pods):
    fake_api.set_ready(PODS[0])
    wait_until(lambda: states(gateway).get(IDS[0]) == "ready", what="pod 1 admitted")
    fake_api.bookmark()
    bookmark_version = str(fake_api.resource_version)
    wait_until(lambda: watcher(gateway).resource_version == bookmark_version, what="the bookmark's resourceVersion")
    fake_api.drop_watches()  # the connection drops: resume where the bookmark left off, no new list
    wait_until(lambda: len(fake_api.watches) == 2, what="a second watch")
    assert fake_api.watches[1]["resourceVersion"] == bookmark_version and fake_api.list_count == 1
    # Compacted while disconnected, pod 2 turned Ready meanwhile: 410 Gone, a new list shows it.
    fake_api.compact_and_drop_watches(lambda: fake_api.set_ready_now(PODS[1]))
    wait_until(lambda: states(gateway).get(IDS[1]) == "ready", what="pod 2 admitted after the re-list")
    assert watcher(gateway).relists == 1 and fake_api.list_count == 2
    wait_until(lambda: len(fake_api.watches) == 4, what="the watch after the re-list")  # it may still be opening
    gone, resumed = fake_api.watches[2], fake_api.watches[3]
    assert gone["resourceVersion"] == bookmark_version
    assert int(resumed["resourceVersion"]) == fake_api.compacted_before
    assert {chat(gateway).headers["x-ember-replica"] for _ in range(4)} == {IDS[0], IDS[1]}


def test_endpoints_are_read_as_kubernetes_defines_their_conditions():
    def endpoint(address: str, pod: str, **conditions) -> client.V1Endpoint:
        return client.V1Endpoint(
            addresses=[address], target_ref=client.V1ObjectReference(kind="Pod", name=pod),
            conditions=client.V1EndpointConditions(**conditions) if conditions else None,
        )  # fmt: skip

    endpoints = [
        endpoint("fd00::1", "unset"),  # no conditions: ready
        endpoint("fd00::2", "ready", ready=True, serving=True, terminating=False),
        endpoint("fd00::3", "loading", ready=False, serving=False, terminating=False),
        endpoint("fd00::4", "leaving", ready=False, serving=True, terminating=True),
    ]
    ipv6 = client.V1EndpointSlice(
        address_type="IPv6", endpoints=endpoints, metadata=client.V1ObjectMeta(name="s-1"),
        ports=[client.DiscoveryV1EndpointPort(name="metrics", port=9090), client.DiscoveryV1EndpointPort(name="http", port=8000)],
    )  # fmt: skip
    by_name = KubernetesDiscovery(service="svc", port="http")
    assert slice_endpoints(ipv6, by_name, "ns") == [
        Endpoint("ns/svc/unset", "http://[fd00::1]:8000", True),
        Endpoint("ns/svc/ready", "http://[fd00::2]:8000", True),
        Endpoint("ns/svc/loading", "http://[fd00::3]:8000", False),
        Endpoint("ns/svc/leaving", "http://[fd00::4]:8000", False),
    ]
    assert [e.url for e in slice_endpoints(ipv6, KubernetesDiscovery(service="svc", port=9090), "ns")][:1] == [
        "http://[fd00::1]:9090"
    ]
    assert slice_endpoints(ipv6, KubernetesDiscovery(service="svc", port="grpc"), "ns") == []  # no such port
    fqdn = client.V1EndpointSlice(address_type="FQDN", endpoints=endpoints[:1], ports=ipv6.ports)
    assert slice_endpoints(fqdn, by_name, "ns") == []
