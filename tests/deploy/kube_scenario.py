"""The names the Kubernetes tests share: one Deployment, its Service, the pods the fake API creates."""

DEPLOYMENT = "ember-tiny-main"  # the Deployment and its Service
PODS = [f"{DEPLOYMENT}-0000{n}" for n in (1, 2, 3)]  # the fake's pod names, in creation order
IDS = [f"ember/{DEPLOYMENT}/{pod}" for pod in PODS]  # their replica ids in the gateway
KEY = "sk-test"  # a client key of the gateway
AUTH = {"authorization": f"Bearer {KEY}"}
CONTROL_TOKEN = "control-token-for-tests"  # what the provider's GatewayAdmin calls /admin/replicas with
