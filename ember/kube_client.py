"""The official `kubernetes` client, configured the way kubectl would be: in a pod, from its service
account; elsewhere, from $KUBECONFIG or ~/.kube/config (how the tests point it at their fake API server).
Used by the gateway's EndpointSlice discovery and the Kubernetes replica provider."""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes import client, config

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """From `kubeconfig` when given; else in a pod its service account, elsewhere $KUBECONFIG."""
    if kubeconfig is not None:
        return config.new_client_from_config(config_file=os.path.expanduser(kubeconfig))
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:  # not in a pod
        # KUBECONFIG read now: the client reads it once, when it is imported.
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))


def current_namespace() -> str:
    """The pod's own namespace, else the kubeconfig context's, else `default`."""
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    try:
        _, context = config.list_kube_config_contexts(config_file=os.environ.get("KUBECONFIG"))
    except config.ConfigException:
        return "default"
    return context["context"].get("namespace") or "default"
