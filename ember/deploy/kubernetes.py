"""`ember deploy k8s fleet.yaml -o DIR`: the fleet file as plain Kubernetes manifests.

Per deployment of each model under `models:` a Deployment running `ember serve` and a Service in
front of it; the gateway as a Deployment + Service whose config is the fleet's own, with every
model deployment's static `replicas:` replaced by `discovery: {kubernetes: ...}` of that Service
(ember.gateway.discovery watches its EndpointSlices). Around them: the gateway config as a
ConfigMap, its keys and admin digest and the fleet's service credential as Secrets, the gateway's
RBAC to watch EndpointSlices, a PodDisruptionBudget per Deployment, Prometheus scrape annotations
and a ServiceMonitor.

Drain on pod deletion: the pod is marked terminating, its endpoint turns `serving, terminating`
and the gateway stops sending it new requests (ember.gateway.discovery); `preStop` keeps the pod
serving `prestop_sleep_s` for that to reach every gateway, then SIGTERM starts `ember serve`'s own
drain (`--drain-timeout`). terminationGracePeriodSeconds covers both plus a margin.

The deploy step imports no torch: only the fleet file's validation and PyYAML.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ember.control.fleet import Fleet, FleetError
from ember.deploy.settings import KubernetesLaunch, KubernetesModel, Resources
from ember.gateway.config import CONTROL_TOKEN_ENV, FLEET_CREDENTIAL_ENV
from ember.server.settings import API_KEY_ENV

HTTP_PORT = 8000
SERVER_DRAIN_TIMEOUT_S = 30  # `ember serve --drain-timeout`'s default
GATEWAY_SHUTDOWN_S = 10  # `ember gateway`'s graceful shutdown (uvicorn timeout_graceful_shutdown)
GRACE_MARGIN_S = 5
CONFIG_DIR = "/etc/ember"
KEYS_DIR = "/etc/ember/keys"
GATEWAY_NAME = "ember-gateway"
CREDENTIAL_SECRET = "ember-fleet-credential"
KEYS_SECRET = "ember-gateway-keys"
AUTOSCALER_NAME = "ember-autoscaler"
AUTOSCALER_DIR = "/etc/ember/autoscaler"
CONTROL_TOKEN_SECRET = "ember-control-token"
PART_OF = "ember"


@dataclass(frozen=True)
class ModelDeployment:
    """One Deployment + Service of `ember serve` pods: a deployment of a model under `models:`."""

    name: str  # the Kubernetes name, e.g. ember-smollm2-135m-instruct-stable
    model: str  # the name clients use
    deployment: str
    replicas: int
    argv: list[str]  # `ember serve ...`
    drain_timeout_s: int
    settings: KubernetesModel
    capacity: int
    region: str | None


def dns_label(text: str) -> str:
    """A DNS-1123 label (Kubernetes object names): lower case, digits and '-', at most 63 characters."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return label[:63].rstrip("-") or "x"


def cpu_threads(resources: Resources) -> int | None:
    """`--num-threads` from the CPU request ("2" -> 2, "500m" -> 1); None when none is set."""
    request = resources.requests.get("cpu")
    if request is None:
        return None
    cores = int(request[:-1]) / 1000 if request.endswith("m") else float(request)
    return max(1, int(cores))


def model_deployments(fleet: Fleet, settings: KubernetesLaunch) -> list[ModelDeployment]:
    launched_by_port = {replica.port: replica for replica in fleet.launch.replicas}
    deployments = []
    for model_name, model in fleet.gateway.models.items():
        pod_settings = settings.models.get(model_name) or KubernetesModel()
        for deployment in model.deployments:
            upstream = deployment.model or model_name
            launch_model, args = upstream, []
            if model.autoscaling is not None:
                replicas = model.autoscaling.min_replicas
                how = fleet.launch.autoscaled.get(model_name)
                if how is not None:
                    launch_model, args = how.model or upstream, how.args
                capacity, region = (how.capacity, how.region) if how is not None else (16, None)
            else:
                replicas = len(deployment.replicas)
                first = deployment.replicas[0] if deployment.replicas else None
                launched = launched_by_port.get(urlsplit(first.url).port) if first is not None else None
                if launched is not None:
                    launch_model, args = launched.model or upstream, launched.args
                capacity = first.capacity if first is not None else 16
                region = first.region if first is not None else None
            args = list(args)
            drain_timeout_s = SERVER_DRAIN_TIMEOUT_S
            if "--drain-timeout" in args:
                drain_timeout_s = int(float(args[args.index("--drain-timeout") + 1]))
                del args[args.index("--drain-timeout") : args.index("--drain-timeout") + 2]
            argv = ["serve", "--model", pod_settings.model or launch_model, "--served-model-name", upstream,
                    "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--drain-timeout", str(drain_timeout_s)]  # fmt: skip
            threads = cpu_threads(pod_settings.resources)
            if "--num-threads" not in args and threads is not None:
                argv += ["--num-threads", str(threads)]
            deployments.append(
                ModelDeployment(
                    name=dns_label(f"ember-{model_name}-{deployment.name}"), model=model_name,
                    deployment=deployment.name, replicas=replicas, argv=[*argv, *args], drain_timeout_s=drain_timeout_s,
                    settings=pod_settings, capacity=capacity, region=region,
                )
            )  # fmt: skip
    names = [item.name for item in deployments]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise FleetError(f"{fleet.path}: two model deployments map to the Kubernetes name(s) {', '.join(repeated)}")
    unknown = sorted(set(settings.models) - set(fleet.gateway.models))
    if unknown:
        raise FleetError(f"{fleet.path}: launch.kubernetes.models names no model under models: {', '.join(unknown)}")
    return deployments


def gateway_config_documents(raw: dict[str, Any], deployments: list[ModelDeployment]) -> tuple[dict, dict]:
    """The fleet file split in two: the gateway config of the ConfigMap (replicas discovered, the fleet's
    credential their key, no `launch:`) and the Secret's overlay (admin digest and inline keys)."""
    config = {key: value for key, value in raw.items() if key not in ("launch", "admin_key_sha256")}
    keys = dict(config.get("keys") or {})
    if keys.get("store") is not None:
        raise FleetError("keys.store: a SQLite key store needs a persistent volume; use keys.inline on Kubernetes")
    secret_overlay: dict[str, Any] = {}
    if raw.get("admin_key_sha256") is not None:
        secret_overlay["admin_key_sha256"] = raw["admin_key_sha256"]
    if keys.get("inline"):
        secret_overlay["keys"] = {"inline": keys.pop("inline")}
    if keys:
        config["keys"] = keys
    else:
        config.pop("keys", None)
    by_deployment = {(item.model, item.deployment): item for item in deployments}
    models = {}
    for model_name, model in raw["models"].items():
        rendered = []
        for deployment in model["deployments"]:
            item = by_deployment[(model_name, deployment.get("name", "default"))]
            if any("api_key" in r or "api_key_env" in r for r in deployment.get("replicas", [])) or (
                "api_key" in deployment or "api_key_env" in deployment
            ):
                raise FleetError(f"models.{model_name}: the replicas' key is the fleet credential on Kubernetes; remove api_key")
            # No namespace: the gateway's own, where its replicas' Services are too.
            discovery = {"service": item.name, "port": "http", "capacity": item.capacity}
            if item.region is not None:
                discovery["region"] = item.region
            rendered.append(
                {**{k: v for k, v in deployment.items() if k != "replicas"},
                 "api_key_env": FLEET_CREDENTIAL_ENV, "discovery": {"kubernetes": discovery}}
            )  # fmt: skip
        models[model_name] = {**model, "deployments": rendered}
    config["models"] = models
    return config, secret_overlay


def _labels(instance: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "ember", "app.kubernetes.io/instance": instance,
            "app.kubernetes.io/component": component, "app.kubernetes.io/part-of": PART_OF}  # fmt: skip


def _selector(instance: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "ember", "app.kubernetes.io/instance": instance}


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _resources(resources: Resources) -> dict[str, Any]:
    return {key: value for key, value in resources.model_dump().items() if value}


def _http_probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "failureThreshold": failures}


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT), "prometheus.io/path": "/metrics"}


def _deployment(
    name: str, namespace: str, component: str, replicas: int, container: dict[str, Any], grace_s: int,
    settings: KubernetesLaunch, pod_extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    labels = _labels(name, component)
    container = {"name": component, "image": settings.image, "imagePullPolicy": settings.image_pull_policy,
                 "ports": [{"name": "http", "containerPort": HTTP_PORT}],
                 "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.prestop_sleep_s)]}}},
                 "securityContext": CONTAINER_SECURITY, **container}  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _selector(name)},
            # A new pod serves before an old one leaves: a rollout never lowers capacity.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": SCRAPE_ANNOTATIONS},
                "spec": {"terminationGracePeriodSeconds": grace_s, "securityContext": POD_SECURITY,
                         "containers": [container], **pod_extra},  # fmt: skip
            },
        },
    }


def _service(name: str, namespace: str, component: str, service_type: str = "ClusterIP") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, _labels(name, component)),
        "spec": {"type": service_type, "selector": _selector(name),
                 "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]},  # fmt: skip
    }


def _disruption_budget(name: str, namespace: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, namespace, _labels(name, component)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(name)}},
    }


def replica_objects(item: ModelDeployment, settings: KubernetesLaunch) -> list[dict[str, Any]]:
    namespace = settings.namespace
    container: dict[str, Any] = {
        "args": item.argv,
        "env": [_secret_env(API_KEY_ENV, CREDENTIAL_SECRET, "credential")],
        "resources": _resources(item.settings.resources),
        # The model loads before /health answers: the startup probe gives it up to 10 minutes.
        "startupProbe": _http_probe("/health", 5, 120),
        "readinessProbe": _http_probe("/ready", 2, 1),
        "livenessProbe": _http_probe("/health", 10, 3),
    }
    pod_extra: dict[str, Any] = {}
    if item.settings.volume is not None:
        volume = item.settings.volume
        container["volumeMounts"] = [{"name": "models", "mountPath": volume.mount_path, "readOnly": True}]
        pod_extra["volumes"] = [{"name": "models", "persistentVolumeClaim": {"claimName": volume.claim, "readOnly": True}}]
    if item.settings.node_selector:
        pod_extra["nodeSelector"] = dict(item.settings.node_selector)
    grace_s = settings.prestop_sleep_s + item.drain_timeout_s + GRACE_MARGIN_S
    deployment = _deployment(item.name, namespace, "replica", item.replicas, container, grace_s, settings, pod_extra)
    deployment["metadata"]["labels"]["ember.dev/model"] = dns_label(item.model)
    return [deployment, _service(item.name, namespace, "replica"), _disruption_budget(item.name, namespace, "replica")]


def gateway_objects(
    settings: KubernetesLaunch, config: dict, secret_overlay: dict, credential: str, autoscaled: bool
) -> list[dict]:
    namespace = settings.namespace
    labels = _labels(GATEWAY_NAME, "gateway")
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(GATEWAY_NAME, namespace, labels),
                  "data": {"gateway.yaml": yaml.safe_dump(config, sort_keys=False)}}  # fmt: skip
    keys_secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(KEYS_SECRET, namespace, labels),
                   "stringData": {"keys.yaml": yaml.safe_dump(secret_overlay, sort_keys=False)}}  # fmt: skip
    credential_secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                         "metadata": _meta(CREDENTIAL_SECRET, namespace, _labels(CREDENTIAL_SECRET, "credential")),
                         "stringData": {"credential": credential}}  # fmt: skip
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(GATEWAY_NAME, namespace, labels)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(GATEWAY_NAME, namespace, labels),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]}  # fmt: skip
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(GATEWAY_NAME, namespace, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY_NAME},
               "subjects": [{"kind": "ServiceAccount", "name": GATEWAY_NAME, "namespace": namespace}]}  # fmt: skip
    container = {
        "args": ["gateway", "--config", f"{CONFIG_DIR}/gateway.yaml", "--config-overlay", f"{KEYS_DIR}/keys.yaml",
                 "--host", "0.0.0.0", "--port", str(HTTP_PORT)],  # fmt: skip
        "env": [_secret_env(FLEET_CREDENTIAL_ENV, CREDENTIAL_SECRET, "credential")]
        # The token the autoscaler drains pods with, accepted by the admin API (ember.gateway.admin).
        + ([_secret_env(CONTROL_TOKEN_ENV, CONTROL_TOKEN_SECRET, "token")] if autoscaled else []),
        "resources": _resources(settings.gateway.resources),
        # /health, not /ready: a gateway with one model down still serves the others (and answers 503 for it).
        "readinessProbe": _http_probe("/health", 2, 1),
        "livenessProbe": _http_probe("/health", 10, 3),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}],  # fmt: skip
    }
    pod_extra = {"serviceAccountName": GATEWAY_NAME,
                 "volumes": [{"name": "config", "configMap": {"name": GATEWAY_NAME}},
                             {"name": "keys", "secret": {"secretName": KEYS_SECRET}}]}  # fmt: skip
    grace_s = settings.prestop_sleep_s + GATEWAY_SHUTDOWN_S + GRACE_MARGIN_S
    deployment = _deployment(GATEWAY_NAME, namespace, "gateway", settings.gateway.replicas, container, grace_s, settings, pod_extra)
    service = _service(GATEWAY_NAME, namespace, "gateway", settings.gateway.service_type)
    budget = _disruption_budget(GATEWAY_NAME, namespace, "gateway")
    return [config_map, keys_secret, credential_secret, account, role, binding, deployment, service, budget]


def autoscaler_fleet(config: dict, raw: dict, autoscaled: list[str]) -> dict[str, Any]:
    """The fleet file `ember autoscale` reads in its pod: the autoscaled models as the gateway discovers
    them (no keys, no credential: it sends no request) and the launch section without local processes."""
    models = {
        name: {**config["models"][name],
               "deployments": [{k: v for k, v in d.items() if k != "api_key_env"} for d in config["models"][name]["deployments"]]}
        for name in autoscaled
    }  # fmt: skip
    return {"models": models, "launch": {k: v for k, v in raw["launch"].items() if k not in ("replicas", "gateway")}}


def autoscaler_objects(settings: KubernetesLaunch, fleet_document: dict, control_token: str) -> list[dict]:
    """`ember autoscale` as a one-pod Deployment, allowed to scale the Deployments and choose their pods."""
    namespace = settings.namespace
    labels = _labels(AUTOSCALER_NAME, "autoscaler")
    token_secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": _meta(CONTROL_TOKEN_SECRET, namespace, _labels(CONTROL_TOKEN_SECRET, "credential")),
                    "stringData": {"token": control_token}}  # fmt: skip
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(AUTOSCALER_NAME, namespace, labels),
                  "data": {"fleet.yaml": yaml.safe_dump(fleet_document, sort_keys=False)}}  # fmt: skip
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(AUTOSCALER_NAME, namespace, labels)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(AUTOSCALER_NAME, namespace, labels),
            "rules": [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]},
                      {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}]}  # fmt: skip
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(AUTOSCALER_NAME, namespace, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": AUTOSCALER_NAME},
               "subjects": [{"kind": "ServiceAccount", "name": AUTOSCALER_NAME, "namespace": namespace}]}  # fmt: skip
    container = {
        "args": ["autoscale", f"{AUTOSCALER_DIR}/fleet.yaml"],
        "env": [_secret_env(CONTROL_TOKEN_ENV, CONTROL_TOKEN_SECRET, "token")],
        "resources": _resources(Resources(requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "512Mi"})),
        "volumeMounts": [{"name": "fleet", "mountPath": AUTOSCALER_DIR, "readOnly": True}],
    }
    pod_extra = {"serviceAccountName": AUTOSCALER_NAME, "volumes": [{"name": "fleet", "configMap": {"name": AUTOSCALER_NAME}}]}
    deployment = _deployment(AUTOSCALER_NAME, namespace, "autoscaler", 1, container, GRACE_MARGIN_S, settings, pod_extra)
    del deployment["spec"]["template"]["spec"]["containers"][0]["lifecycle"]  # nothing routes to it: no preStop
    # Two autoscalers would both scale: the old pod goes before the new one starts.
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    return [token_secret, config_map, account, role, binding, deployment]


def service_monitor(settings: KubernetesLaunch) -> dict[str, Any]:
    """Prometheus Operator's ServiceMonitor: every ember Service's /metrics (the gateway's and the replicas')."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta("ember", settings.namespace, {"app.kubernetes.io/name": "ember", "app.kubernetes.io/part-of": PART_OF}),
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/part-of": PART_OF}},
                 "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]},  # fmt: skip
    }


def render(
    fleet: Fleet, credential: str | None = None, control_token: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """File name -> the Kubernetes objects it holds, for `kubectl apply -f DIR`. The fleet credential and,
    with autoscaled models, the autoscaler's control token are generated unless given."""
    settings = fleet.launch.kubernetes or KubernetesLaunch()
    raw = yaml.safe_load(fleet.path.read_text(encoding="utf-8"))
    deployments = model_deployments(fleet, settings)
    try:
        config, secret_overlay = gateway_config_documents(raw, deployments)
    except FleetError as exc:
        raise FleetError(f"{fleet.path}: {exc}") from None
    files: dict[str, list[dict[str, Any]]] = {}
    if settings.namespace != "default":
        files["00-namespace.yaml"] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": settings.namespace}}]
    autoscaled = list(fleet.autoscaled)
    files["10-gateway.yaml"] = gateway_objects(
        settings, config, secret_overlay, credential or secrets.token_urlsafe(32), bool(autoscaled)
    )
    for item in deployments:
        files[f"20-{item.name}.yaml"] = replica_objects(item, settings)
    if autoscaled:
        files["25-autoscaler.yaml"] = autoscaler_objects(
            settings, autoscaler_fleet(config, raw, autoscaled), control_token or secrets.token_urlsafe(32)
        )
    if settings.service_monitor:
        files["30-servicemonitor.yaml"] = [service_monitor(settings)]
    return files


class ManifestDumper(yaml.SafeDumper):
    """YAML as people write manifests: no anchors for repeated label maps, multi-line strings as blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


ManifestDumper.add_representer(str, _represent_str)


def dump_objects(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=ManifestDumper, sort_keys=False)


def write_manifests(files: dict[str, list[dict[str, Any]]], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in files.items():
        path = directory / name
        path.write_text(dump_objects(objects), encoding="utf-8")
        written.append(path)
    return written
