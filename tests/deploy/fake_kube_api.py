"""A Kubernetes API server small enough to read, for the paths and JSON the official `kubernetes`
client sends and receives when Ember discovers replicas and scales Deployments (no API server can be
installed on these machines):

    GET   /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=   list, with resourceVersion
    GET   ...endpointslices?watch=true&resourceVersion=&allowWatchBookmarks=&timeoutSeconds=
          a stream of {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...} lines; a
          resourceVersion older than the last compaction gets an ERROR event with code 410 (Gone)
    GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale          autoscaling/v1 Scale
    PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale          merge patch; a stale
          metadata.resourceVersion gets 409 Conflict
    GET   /api/v1/namespaces/{ns}/pods?labelSelector=                     PodList
    PATCH /api/v1/namespaces/{ns}/pods/{name}                              merge patch (annotations)

Behind them, what the controllers would do: scaling a Deployment up creates a pod (`make_pod` says
its IP: a test starts a replica there), not Ready until `set_ready`; scaling down marks the pod with
the lowest `controller.kubernetes.io/pod-deletion-cost` terminating, as the ReplicaSet controller
does, until `finish_deletion`; the Service's EndpointSlice follows the pods (ready / serving /
terminating), one event per change.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway_harness import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


@dataclass
class FakePod:
    name: str
    ip: str
    labels: dict[str, str]
    ready: bool = False
    terminating: bool = False
    annotations: dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=now_text)
    ready_since: str | None = None


@dataclass
class OpenWatch:
    events: asyncio.Queue  # None ends the stream
    bookmarks: bool


@dataclass
class FakeDeployment:
    name: str
    service: str
    port: int
    labels: dict[str, str]
    make_pod: Callable[[int], str]  # the n-th pod's IP (a test starts a replica there)
    replicas: int = 0
    resource_version: int = 1
    created: int = 0


class FakeKubeApi:
    def __init__(self, namespace: str = "ember"):
        self.namespace = namespace
        self.resource_version = 100
        self.compacted_before = 0  # a watch from an older resourceVersion gets 410 Gone
        self.history: list[tuple[int, str, dict]] = []  # (resourceVersion, event type, EndpointSlice)
        self.deployments: dict[str, FakeDeployment] = {}
        self.pods: dict[str, FakePod] = {}
        self.conflict_next_patch = False  # a concurrent writer (e.g. an HPA) changes the scale first
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, query), in arrival order
        self.patches: list[tuple[str, Any, str]] = []  # (path, body, content type)
        self._watches: list[OpenWatch] = []
        self.last_event_at = 0.0  # time.monotonic() when the last EndpointSlice event was queued on the watches
        routes = [
            Route("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._endpoint_slices),
            Route("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", self._scale, methods=["GET", "PATCH"]),
            Route("/api/v1/namespaces/{ns}/pods", self._list_pods),
            Route("/api/v1/namespaces/{ns}/pods/{name}", self._patch_pod, methods=["PATCH"]),
        ]
        self.server = ServerThread(Starlette(routes=routes))
        self.url = self.server.url

    def start(self) -> FakeKubeApi:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.call(self._end_watches)
        self.server.stop()

    def kubeconfig(self) -> str:
        """A kubeconfig for the official client: this server, a bearer token, a default namespace."""
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": self.namespace}}],
        })  # fmt: skip

    # --- what tests (and the controllers) do; every method runs on the server's loop via `call` ---

    def call(self, fn: Callable[[], Any]) -> None:
        self.server.call(fn)

    def add_deployment(self, name: str, service: str, port: int, make_pod: Callable[[int], str], replicas: int) -> None:
        def add() -> None:
            labels = {"app.kubernetes.io/name": "ember", "app.kubernetes.io/instance": name}
            self.deployments[name] = FakeDeployment(name, service, port, labels, make_pod)
            self._scale_to(self.deployments[name], replicas)

        self.call(add)

    def set_ready(self, pod_name: str, ready: bool = True) -> None:
        self.call(lambda: self.set_ready_now(pod_name, ready))

    def set_ready_now(self, pod_name: str, ready: bool = True) -> None:
        pod = self.pods[pod_name]
        pod.ready, pod.ready_since = ready, now_text() if ready else None
        self._publish_slice(self._deployment_of(pod))

    def start_deletion(self, pod_name: str) -> None:
        """`kubectl delete pod`: terminating (still serving while its preStop runs) until finish_deletion."""

        def delete() -> None:
            pod = self.pods[pod_name]
            pod.terminating = True
            self._publish_slice(self._deployment_of(pod))

        self.call(delete)

    def finish_deletion(self, pod_name: str) -> None:
        def delete() -> None:
            pod = self.pods.pop(pod_name)
            self._publish_slice(self._deployment_of(pod))

        self.call(delete)

    def bookmark(self) -> None:
        """A BOOKMARK to every watch that allowed them: nothing changed, here is a newer resourceVersion."""

        def send() -> None:
            self.resource_version += 1
            event = {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                                    "metadata": {"resourceVersion": str(self.resource_version)}}}  # fmt: skip
            for watch in self._watches:
                if watch.bookmarks:
                    watch.events.put_nowait(event)

        self.call(send)

    def compact_and_drop_watches(self, change: Callable[[], None]) -> None:
        """The watches drop, `change` happens, and etcd compacts past it: a watch resumed from an older
        resourceVersion gets 410 Gone, and only a new list shows the change."""

        def compact() -> None:
            self._end_watches()
            change()
            self.compacted_before = self.resource_version

        self.call(compact)

    def drop_watches(self) -> None:
        """Connections lost (an API server restart): the watches end; resuming is allowed."""
        self.call(self._end_watches)

    @property
    def watches(self) -> list[dict[str, str]]:
        """The query of every watch request, in order."""
        return [query for method, path, query in self.requests if query.get("watch") == "true"]

    @property
    def list_count(self) -> int:
        return sum(1 for method, path, query in self.requests
                   if path.endswith("/endpointslices") and query.get("watch") != "true")  # fmt: skip

    # --- the controllers -------------------------------------------------------------------------

    def _deployment_of(self, pod: FakePod) -> FakeDeployment:
        return next(d for d in self.deployments.values() if d.labels.items() <= pod.labels.items())

    def _scale_to(self, deployment: FakeDeployment, replicas: int) -> None:
        deployment.replicas = replicas
        deployment.resource_version += 1
        live = [pod for pod in self.pods.values() if self._deployment_of(pod) is deployment and not pod.terminating]
        for _ in range(replicas - len(live)):
            deployment.created += 1
            name = f"{deployment.name}-{deployment.created:05d}"
            self.pods[name] = FakePod(name, deployment.make_pod(deployment.created), dict(deployment.labels))
        by_cost = sorted(live, key=lambda pod: (int(pod.annotations.get(DELETION_COST, "0")), pod.ready))
        for pod in by_cost[: max(0, len(live) - replicas)]:
            pod.terminating = True
        self._publish_slice(deployment)

    def _publish_slice(self, deployment: FakeDeployment) -> None:
        self.resource_version += 1
        endpoints = [
            {"addresses": [pod.ip], "conditions": {"ready": pod.ready and not pod.terminating, "serving": pod.ready,
                                                   "terminating": pod.terminating},
             "targetRef": {"kind": "Pod", "name": pod.name, "namespace": self.namespace}}
            for pod in self.pods.values()
            if self._deployment_of(pod) is deployment
        ]  # fmt: skip
        endpoint_slice = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{deployment.service}-abcde", "namespace": self.namespace,
                         "resourceVersion": str(self.resource_version),
                         "labels": {"kubernetes.io/service-name": deployment.service}},
            "ports": [{"name": "http", "port": deployment.port, "protocol": "TCP"}],
            "endpoints": endpoints,
        }  # fmt: skip
        kind = "MODIFIED" if any(obj["metadata"]["name"] == endpoint_slice["metadata"]["name"] for _, _, obj in self.history) else "ADDED"
        self.history.append((self.resource_version, kind, endpoint_slice))
        self.last_event_at = time.monotonic()
        for watch in self._watches:
            watch.events.put_nowait({"type": kind, "object": endpoint_slice})

    def _slices(self, selector: str) -> dict[str, dict]:
        current: dict[str, dict] = {}
        for _, _, obj in self.history:
            current[obj["metadata"]["name"]] = obj
        wanted = dict(item.split("=", 1) for item in selector.split(",") if item)
        return {name: obj for name, obj in current.items() if wanted.items() <= obj["metadata"]["labels"].items()}

    def _end_watches(self) -> None:
        for watch in self._watches:
            watch.events.put_nowait(None)

    # --- the API ---------------------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        self.requests.append((request.method, request.url.path, dict(request.query_params)))

    async def _endpoint_slices(self, request: Request):
        self._record(request)
        query = request.query_params
        selector = query.get("labelSelector", "")
        if query.get("watch") != "true":
            return JSONResponse({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                 "metadata": {"resourceVersion": str(self.resource_version)},
                                 "items": list(self._slices(selector).values())})  # fmt: skip
        since = int(query.get("resourceVersion") or 0)
        watch = OpenWatch(asyncio.Queue(), bookmarks=query.get("allowWatchBookmarks") == "true")
        if since < self.compacted_before:
            message = f"too old resource version: {since} ({self.compacted_before})"
            watch.events.put_nowait({"type": "ERROR", "object": status(410, "Expired", message)})
            watch.events.put_nowait(None)
        else:
            for version, kind, obj in self.history:
                if version > since and obj["metadata"]["name"] in self._slices(selector):
                    watch.events.put_nowait({"type": kind, "object": obj})
        self._watches.append(watch)
        timeout_s = float(query.get("timeoutSeconds") or 1800)

        async def events():
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout_s
                while True:
                    try:
                        event = await asyncio.wait_for(watch.events.get(), max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        return
                    if event is None:
                        return
                    yield json.dumps(event) + "\n"
            finally:
                self._watches.remove(watch)

        return StreamingResponse(events(), media_type="application/json")

    def _scale_object(self, deployment: FakeDeployment) -> dict[str, Any]:
        live = [pod for pod in self.pods.values() if self._deployment_of(pod) is deployment and not pod.terminating]
        selector = ",".join(f"{key}={value}" for key, value in deployment.labels.items())
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": deployment.name, "namespace": self.namespace,
                             "resourceVersion": str(deployment.resource_version)},
                "spec": {"replicas": deployment.replicas},
                "status": {"replicas": len(live), "selector": selector}}  # fmt: skip

    async def _scale(self, request: Request) -> JSONResponse:
        self._record(request)
        deployment = self.deployments.get(request.path_params["name"])
        if deployment is None:
            name = request.path_params["name"]
            return JSONResponse(status(404, "NotFound", f'deployments.apps "{name}" not found'), status_code=404)
        if request.method == "PATCH":
            body = await request.json()
            self.patches.append((request.url.path, body, request.headers.get("content-type", "")))
            if self.conflict_next_patch:
                self.conflict_next_patch = False
                deployment.resource_version += 1  # someone else wrote first
            sent = body.get("metadata", {}).get("resourceVersion")
            if sent is not None and sent != str(deployment.resource_version):
                message = (f'Operation cannot be fulfilled on deployments.apps "{deployment.name}": the object has '
                           "been modified; please apply your changes to the latest version and try again")  # fmt: skip
                return JSONResponse(status(409, "Conflict", message), status_code=409)
            self._scale_to(deployment, body["spec"]["replicas"])
        return JSONResponse(self._scale_object(deployment))

    def _pod_object(self, pod: FakePod) -> dict[str, Any]:
        metadata = {"name": pod.name, "namespace": self.namespace, "labels": pod.labels, "annotations": pod.annotations,
                    "creationTimestamp": pod.created, "resourceVersion": str(self.resource_version)}  # fmt: skip
        if pod.terminating:
            metadata["deletionTimestamp"] = now_text()
        conditions = [{"type": "Ready", "status": "True" if pod.ready and not pod.terminating else "False",
                       "lastTransitionTime": pod.ready_since or pod.created}]  # fmt: skip
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                "spec": {"containers": [{"name": "replica", "image": "ember:0.1.0-cpu"}]},
                "status": {"phase": "Running", "podIP": pod.ip, "conditions": conditions}}  # fmt: skip

    async def _list_pods(self, request: Request) -> JSONResponse:
        self._record(request)
        wanted = dict(item.split("=", 1) for item in request.query_params.get("labelSelector", "").split(",") if item)
        items = [self._pod_object(pod) for pod in self.pods.values() if wanted.items() <= pod.labels.items()]
        return JSONResponse({"apiVersion": "v1", "kind": "PodList",
                             "metadata": {"resourceVersion": str(self.resource_version)}, "items": items})  # fmt: skip

    async def _patch_pod(self, request: Request) -> JSONResponse:
        self._record(request)
        pod = self.pods.get(request.path_params["name"])
        if pod is None:
            name = request.path_params["name"]
            return JSONResponse(status(404, "NotFound", f'pods "{name}" not found'), status_code=404)
        body = await request.json()
        self.patches.append((request.url.path, body, request.headers.get("content-type", "")))
        pod.annotations.update(body.get("metadata", {}).get("annotations", {}))
        return JSONResponse(self._pod_object(pod))
