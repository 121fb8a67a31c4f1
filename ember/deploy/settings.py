"""The fleet file's `launch.kubernetes:` section: what `ember deploy k8s` needs beyond the gateway config.

    launch:
      kubernetes:
        namespace: ember
        image: ghcr.io/example/ember:0.1.0-cpu   # built from deploy/Dockerfile
        gateway: {replicas: 2, service_type: LoadBalancer}
        models:                                   # keyed by the model name under `models:`
          smollm2-135m-instruct:
            resources: {requests: {cpu: "2", memory: 2Gi}, limits: {memory: 4Gi}}
            volume: {claim: models, mount_path: /models}   # optional: weights from a PersistentVolumeClaim
            model: /models/SmolLM2-135M-Instruct.Q4_1.gguf # what `ember serve --model` loads in the pod
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ember.strict_model import StrictModel


class Resources(StrictModel):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)


def default_replica_resources() -> Resources:
    return Resources(requests={"cpu": "2", "memory": "2Gi"}, limits={"memory": "4Gi"})


def default_gateway_resources() -> Resources:
    return Resources(requests={"cpu": "500m", "memory": "256Mi"}, limits={"memory": "1Gi"})


class ModelVolume(StrictModel):
    claim: str = Field(description="A PersistentVolumeClaim holding the weights, mounted read-only")
    mount_path: str = "/models"


class KubernetesModel(StrictModel):
    model: str | None = Field(
        default=None, description="What `ember serve --model` loads in the pod; default: as `ember up` would"
    )
    resources: Resources = Field(default_factory=default_replica_resources)
    volume: ModelVolume | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)


class KubernetesGateway(StrictModel):
    replicas: int = Field(default=1, ge=1)
    resources: Resources = Field(default_factory=default_gateway_resources)
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class KubernetesAutoscaler(StrictModel):
    """Where `ember autoscale` finds the cluster and its gateway (the Deployments are the rendered ones)."""

    gateway_url: str | None = Field(
        default=None, description="The gateway whose /metrics it reads; default: the rendered gateway Service"
    )
    kubeconfig: str | None = Field(
        default=None, description="Kubeconfig file; default: in a pod its service account, else $KUBECONFIG"
    )


class KubernetesLaunch(StrictModel):
    namespace: str = "ember"
    image: str = "ember:0.1.0-cpu"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    gateway: KubernetesGateway = Field(default_factory=KubernetesGateway)
    models: dict[str, KubernetesModel] = Field(default_factory=dict)
    prestop_sleep_s: int = Field(
        default=5, ge=0, description="Seconds a terminating pod keeps serving so that routing drops it before its drain"
    )
    service_monitor: bool = Field(default=True, description="Render a Prometheus Operator ServiceMonitor")
    autoscaler: KubernetesAutoscaler = Field(default_factory=KubernetesAutoscaler)
