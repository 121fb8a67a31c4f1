"""Replicas from Kubernetes: a deployment with `discovery: {kubernetes: {service, namespace, port}}`
routes to the endpoints of that Service, as its EndpointSlices list them, watched with the official
`kubernetes` client:

- list the Service's EndpointSlices (label kubernetes.io/service-name), then watch from the list's
  resourceVersion with bookmarks on; each event (and each bookmark) moves the resourceVersion on, so
  a watch that ends (its timeout, a dropped connection) resumes where it stopped;
- 410 Gone (the resourceVersion is too old to resume from) starts over with a fresh list;
- after every change, the Service's endpoints are reconciled with the gateway's pool on its event
  loop: a `ready` endpoint joins through the path /admin/replicas uses (admitted after its first
  health probe); an endpoint that turns `terminating` (the pod is being deleted, even while still
  `serving`), stops being ready, or disappears leaves routing at once and is drained: its requests
  in flight finish, none is cut.

The client is blocking (urllib3), so each watched Service has a thread; only the reconcile touches
the pool, on the loop thread, in the order the events came.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from ember.gateway.config import DeploymentConfig, KubernetesDiscovery
from ember.gateway.dispatch import Dispatcher
from ember.gateway.membership import join, leave, new_replica
from ember.kube_client import api_client, current_namespace

logger = logging.getLogger("ember.gateway")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 300  # the server ends each watch after this; the next one resumes from the last resourceVersion
LIST_TIMEOUT_S = 10.0
RETRY_S = 1.0  # after an error other than 410 (API server unreachable, 403 ...)
DRAIN_TIMEOUT_S = 120.0  # how long a leaving endpoint is listed as draining at most


@dataclass(frozen=True)
class Endpoint:
    replica_id: str  # namespace/service/pod (or address)
    url: str
    routable: bool  # ready and not terminating


def slice_endpoints(endpoint_slice: Any, source: KubernetesDiscovery, namespace: str) -> list[Endpoint]:
    """The endpoints of one EndpointSlice (a V1EndpointSlice) on the discovered port."""
    port = next(
        (p.port for p in endpoint_slice.ports or [] if source.port in (p.name, p.port)), None
    )  # a slice without that port (yet) lists nothing we can route to
    if port is None or endpoint_slice.address_type not in ("IPv4", "IPv6"):
        return []
    found = []
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        # Kubernetes: an unset `ready` means ready; a terminating endpoint is never ready.
        ready = conditions is None or conditions.ready is not False
        terminating = conditions is not None and conditions.terminating is True
        name = endpoint.target_ref.name if endpoint.target_ref is not None else None
        for address in endpoint.addresses[:1]:  # every address of an endpoint is the same pod
            host = f"[{address}]" if endpoint_slice.address_type == "IPv6" else address
            found.append(
                Endpoint(f"{namespace}/{source.service}/{name or address}", f"{source.scheme}://{host}:{port}",
                         ready and not terminating)
            )  # fmt: skip
    return found


class EndpointSliceWatcher:
    """One Service's EndpointSlices -> one deployment's replicas in the gateway's pool."""

    def __init__(self, dispatcher: Dispatcher, model: str, deployment: DeploymentConfig, api: client.ApiClient):
        self.dispatcher = dispatcher
        self.model = model
        self.deployment = deployment
        self.source: KubernetesDiscovery = deployment.discovery.kubernetes
        self.namespace = self.source.namespace or current_namespace()
        self._discovery_api = client.DiscoveryV1Api(api)
        self._selector = f"{SERVICE_NAME_LABEL}={self.source.service}"
        self._slices: dict[str, list[Endpoint]] = {}  # watcher thread only
        self._members: dict[str, str] = {}  # replica id -> url, as the pool has them (loop thread only)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch = watch.Watch()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ember-discovery-{self.source.service}", daemon=True)
        self.resource_version: str | None = None
        self.relists = 0  # lists after the first: each 410 Gone
        self.last_reaction_s: float | None = None  # event received -> pool updated, for the last event

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._watch.stop()  # shuts the socket of a watch in progress down
        await asyncio.to_thread(self._thread.join, 5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- the watcher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch_from(self.resource_version)
            except ApiException as exc:
                if exc.status == 410:  # Gone: too old to resume from; list again
                    logger.info("EndpointSlices of %s: resourceVersion %s expired, listing again",
                                self.source.service, self.resource_version)  # fmt: skip
                    self.resource_version = None
                    self.relists += 1
                    continue
                self._retry_later(exc)
            except Exception as exc:  # noqa: BLE001 - a dropped connection or a bad answer: try again
                self._retry_later(exc)

    def _retry_later(self, exc: Exception) -> None:
        if not self._stopping.is_set():
            logger.warning("EndpointSlices of %s: %s; retrying in %.0fs", self.source.service, exc, RETRY_S)
            self._stopping.wait(RETRY_S)

    def _list(self) -> None:
        listed = self._discovery_api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self._selector, _request_timeout=LIST_TIMEOUT_S
        )
        self._slices = {item.metadata.name: slice_endpoints(item, self.source, self.namespace) for item in listed.items}
        self.resource_version = listed.metadata.resource_version
        self._publish(time.monotonic())

    def _watch_from(self, resource_version: str) -> None:
        stream = self._watch.stream(
            self._discovery_api.list_namespaced_endpoint_slice, self.namespace, label_selector=self._selector,
            resource_version=resource_version, allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT_S,
        )  # fmt: skip
        for event in stream:
            received = time.monotonic()
            if event["type"] == "BOOKMARK":  # only a newer resourceVersion to resume from
                self.resource_version = event["raw_object"]["metadata"]["resourceVersion"]
                continue
            item = event["object"]
            if event["type"] == "DELETED":
                self._slices.pop(item.metadata.name, None)
            else:  # ADDED, MODIFIED
                self._slices[item.metadata.name] = slice_endpoints(item, self.source, self.namespace)
            self.resource_version = item.metadata.resource_version
            self._publish(received)

    def _publish(self, received: float) -> None:
        endpoints: dict[str, Endpoint] = {}
        for endpoint in (e for listed in self._slices.values() for e in listed):
            # A pod may show in two slices while they are rebalanced: routable if either copy says so.
            if endpoint.routable or endpoint.replica_id not in endpoints:
                endpoints[endpoint.replica_id] = endpoint
        if self._loop is not None and not self._stopping.is_set():
            self._loop.call_soon_threadsafe(self._reconcile, endpoints, received)

    # --- the event loop --------------------------------------------------------------------------

    def _reconcile(self, endpoints: dict[str, Endpoint], received: float) -> None:
        """Pool membership follows the endpoints; the pool changes here, synchronously, in event order."""
        for replica_id, url in list(self._members.items()):
            endpoint = endpoints.get(replica_id)
            if endpoint is None or not endpoint.routable or endpoint.url != url:
                del self._members[replica_id]
                self._spawn(leave(self.dispatcher, replica_id, DRAIN_TIMEOUT_S))
        for endpoint in endpoints.values():
            if endpoint.routable and endpoint.replica_id not in self._members:
                self._members[endpoint.replica_id] = endpoint.url
                replica = new_replica(
                    self.model, self.deployment, replica_id=endpoint.replica_id, url=endpoint.url,
                    region=self.source.region, labels={"service": self.source.service}, capacity=self.source.capacity,
                    api_key=self.deployment.replica_api_key,
                )  # fmt: skip
                self._spawn(join(self.dispatcher, replica))
        self.last_reaction_s = time.monotonic() - received

    def _spawn(self, coroutine) -> None:
        # join's pool.add and leave's pool.remove run before their first await, in creation order.
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def start_discovery(dispatcher: Dispatcher) -> list[EndpointSliceWatcher]:
    """A started watcher per deployment with a `discovery:` section."""
    api = api_client()
    watchers = [
        EndpointSliceWatcher(dispatcher, model_name, deployment, api)
        for model_name, model in dispatcher.config.models.items()
        for deployment in model.deployments
        if deployment.discovery is not None
    ]
    for watcher in watchers:
        watcher.start()
    return watchers
