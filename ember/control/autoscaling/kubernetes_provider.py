"""The replica provider for Kubernetes: each autoscaled model is a Deployment of `ember serve` pods
(`ember deploy k8s` renders it) whose Service the gateway discovers (ember.gateway.discovery).

- Starting a replica raises the Deployment's replica count by one through its scale subresource;
  stopping one lowers it. Both read the Scale first and send its resourceVersion with the patch, so a
  concurrent writer (kubectl scale, another controller) makes the API answer 409 Conflict instead of
  one write silently undoing the other; the provider then reads again and retries.
- Replicas are the pods the scale's selector matches: `ready` only when the pod's Ready condition is
  True, `loading` while it is not (and, as `pending-N`, the replicas the Deployment wants but the
  ReplicaSet controller has not created yet), `draining` once deleting.
- Scaling down chooses the pod itself: the ReplicaSet controller deletes the pod with the lowest
  `controller.kubernetes.io/pod-deletion-cost` first, so the provider (1) annotates the chosen pod
  with the lowest cost, (2) has the gateway take it out of routing and waits for its requests in flight
  (DELETE /admin/replicas/{namespace/service/pod}), then (3) lowers the replica count. The pod is out
  of routing before Kubernetes deletes it; other gateway pods stop routing to it when its endpoint
  turns terminating, while its preStop sleep keeps it serving (docs/kubernetes.md).

The official client is blocking: start/stop run it in a thread; `list_replicas`, synchronous in the
provider protocol, calls the API directly (two small GETs per model per autoscaler step).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes import client
from kubernetes.client.rest import ApiException

from ember.control.autoscaling.provider import GatewayAdmin, ManagedReplica, ReplicaState
from ember.control.fleet import Fleet
from ember.deploy.kubernetes import HTTP_PORT, model_deployments
from ember.deploy.settings import KubernetesLaunch

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_DELETION_COST = str(-(2**31))  # an int32: the pod the ReplicaSet controller deletes first
CONFLICT_RETRIES = 5
REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class KubernetesTarget:
    """Where one autoscaled model runs."""

    deployment: str  # the Deployment of its `ember serve` pods
    service: str  # its Service, the gateway's discovery source (replica ids are namespace/service/pod)
    namespace: str
    port: int = 8000


def fleet_targets(fleet: Fleet) -> dict[str, KubernetesTarget]:
    """The Deployment of each autoscaled model (it has exactly one deployment), named as `ember deploy k8s`
    renders it."""
    settings = fleet.launch.kubernetes or KubernetesLaunch()
    return {
        item.model: KubernetesTarget(deployment=item.name, service=item.name, namespace=settings.namespace, port=HTTP_PORT)
        for item in model_deployments(fleet, settings)
        if item.model in fleet.autoscaled
    }


class KubernetesProvider:
    def __init__(self, targets: dict[str, KubernetesTarget], gateway: GatewayAdmin, api: client.ApiClient, log=print):
        self.targets = targets
        self.gateway = gateway
        self.log = log
        self._apps = client.AppsV1Api(api)
        self._core = client.CoreV1Api(api)
        self._stopping: dict[str, str] = {}  # replica id -> model, while its drain and scale-down run

    # --- the scale subresource -------------------------------------------------------------------

    def _rescale(self, target: KubernetesTarget, delta: int) -> int:
        """Replicas += delta with optimistic concurrency; returns the new count."""
        for _ in range(CONFLICT_RETRIES):
            scale = self._apps.read_namespaced_deployment_scale(
                target.deployment, target.namespace, _request_timeout=REQUEST_TIMEOUT_S
            )
            replicas = max(0, scale.spec.replicas + delta)
            body = {"metadata": {"resourceVersion": scale.metadata.resource_version}, "spec": {"replicas": replicas}}
            try:
                self._apps.patch_namespaced_deployment_scale(
                    target.deployment, target.namespace, body, _request_timeout=REQUEST_TIMEOUT_S
                )
            except ApiException as exc:
                if exc.status == 409:  # written by someone else since we read it: read again
                    continue
                raise
            return replicas
        raise RuntimeError(f"scaling {target.namespace}/{target.deployment}: {CONFLICT_RETRIES} conflicts in a row")

    # --- the provider protocol -------------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to prepare: the Deployment's pods are the replicas."""

    async def resync(self) -> None:
        """Nothing to re-register: the gateway finds the pods through their EndpointSlices itself."""

    async def start_replica(self, model: str) -> ManagedReplica:
        target = self.targets[model]
        replicas = await asyncio.to_thread(self._rescale, target, +1)
        self.log(f"{model}: {target.namespace}/{target.deployment} scaled to {replicas}")
        return ManagedReplica(
            id=f"{target.namespace}/{target.service}/pending-{replicas}", model=model, url="",
            state=ReplicaState.LOADING, started_at=time.monotonic(),
        )  # fmt: skip

    async def stop_replica(self, replica_id: str) -> None:
        model, target = next(
            (name, target) for name, target in self.targets.items()
            if replica_id.startswith(f"{target.namespace}/{target.service}/")
        )  # fmt: skip
        pod = replica_id.rsplit("/", 1)[1]
        self._stopping[replica_id] = model
        try:
            if not pod.startswith("pending-"):  # a pod to choose; a pending one is not created yet
                patch = {"metadata": {"annotations": {DELETION_COST: LOWEST_DELETION_COST}}}
                await asyncio.to_thread(
                    self._core.patch_namespaced_pod, pod, target.namespace, patch, _request_timeout=REQUEST_TIMEOUT_S
                )
                await self.gateway.deregister(replica_id)  # out of routing, its requests finished
            await asyncio.to_thread(self._rescale, target, -1)
        finally:
            del self._stopping[replica_id]

    def list_replicas(self, model: str | None = None) -> list[ManagedReplica]:
        models = [model] if model is not None else list(self.targets)
        return [replica for name in models for replica in self._replicas_of(name)]

    def _replicas_of(self, model: str) -> list[ManagedReplica]:
        target = self.targets[model]
        scale = self._apps.read_namespaced_deployment_scale(
            target.deployment, target.namespace, _request_timeout=REQUEST_TIMEOUT_S
        )
        pods = self._core.list_namespaced_pod(
            target.namespace, label_selector=scale.status.selector, _request_timeout=REQUEST_TIMEOUT_S
        ).items
        replicas = [self._replica(model, target, pod) for pod in pods]
        live = sum(1 for replica in replicas if replica.state != ReplicaState.DRAINING)
        now = time.monotonic()
        replicas += [
            ManagedReplica(f"{target.namespace}/{target.service}/pending-{n}", model, "", ReplicaState.LOADING, now)
            for n in range(live + 1, (scale.spec.replicas or 0) + 1)
        ]
        return replicas

    def _replica(self, model: str, target: KubernetesTarget, pod: client.V1Pod) -> ManagedReplica:
        replica_id = f"{target.namespace}/{target.service}/{pod.metadata.name}"
        ready_at = next(
            (c.last_transition_time for c in pod.status.conditions or [] if c.type == "Ready" and c.status == "True"),
            None,
        )
        if pod.metadata.deletion_timestamp is not None or replica_id in self._stopping:
            state = ReplicaState.DRAINING
        else:
            state = ReplicaState.READY if ready_at is not None else ReplicaState.LOADING
        return ManagedReplica(
            id=replica_id, model=model, url=f"http://{pod.status.pod_ip}:{target.port}", state=state,
            started_at=_monotonic(pod.metadata.creation_timestamp),
            ready_at=_monotonic(ready_at) if ready_at is not None else None,
        )  # fmt: skip

    async def close(self) -> None:
        await self.gateway.close()


def _monotonic(when: datetime) -> float:
    """A wall-clock time from the API as a time.monotonic() value (ManagedReplica's clock)."""
    return time.monotonic() - (datetime.now(UTC) - when).total_seconds()
