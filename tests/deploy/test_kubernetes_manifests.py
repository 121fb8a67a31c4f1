"""`ember deploy k8s` and the Helm chart: every object validates against Kubernetes' OpenAPI schema
(kubernetes-validate, strict: unknown fields are errors), and says what the fleet file says."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helm_renderer import helm_template

from ember.cli import main
from ember.commands.autoscale import gateway_url
from ember.commands.up import default_fleet_path
from ember.control.autoscaling.kubernetes_provider import fleet_targets
from ember.control.fleet import FleetError, load_fleet
from ember.deploy.helm import chart_files, write_chart
from ember.deploy.kubernetes import render
from ember.gateway.config import FLEET_CREDENTIAL_ENV, merge_mappings, parse_config

KUBERNETES_VERSION = "1.35"
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "ember"
CREDENTIAL = "fleet-credential-for-tests"
CONTROL_TOKEN = "control-token-for-tests"

AUTOSCALED_FLEET = """
admin_key_sha256: 0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271
models:
  tiny:
    autoscaling: {min_replicas: 1, max_replicas: 4, ttft_p90_ms: 800, itl_p90_ms: 80}
    deployments: [{name: main, model: tiny-v1}]
launch:
  autoscaled:
    tiny: {model: smollm2-135m-instruct, args: [--drain-timeout, "60", --max-queued-requests, "32"], capacity: 4}
  kubernetes:
    namespace: llm
    image: registry.example/ember:0.1.0-cuda
    gateway: {replicas: 2, service_type: LoadBalancer}
    service_monitor: false
    models:
      tiny:
        model: /models/tiny.gguf
        volume: {claim: tiny-weights}
        resources: {requests: {cpu: 500m, memory: 1Gi}, limits: {memory: 2Gi, nvidia.com/gpu: "1"}}
        node_selector: {accelerator: h100}
"""


def validate_all(objects: list[dict]) -> list[str]:
    """Each object validated; the ServiceMonitor (a CRD, absent from the core schemas) by its shape."""
    kinds = []
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
            assert obj["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/part-of": "ember"}}
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        kinds.append(obj["kind"])
    return kinds


def by_kind_and_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def gateway_config_of(objects: dict[tuple[str, str], dict]):
    """The gateway config the gateway pod loads: the ConfigMap with the keys Secret merged over it."""
    config = yaml.safe_load(objects["ConfigMap", "ember-gateway"]["data"]["gateway.yaml"])
    overlay = yaml.safe_load(objects["Secret", "ember-gateway-keys"]["stringData"]["keys.yaml"])
    return parse_config(merge_mappings(config, overlay))


def test_the_validator_rejects_a_bad_manifest():
    deployment = by_kind_and_name(sum(render(load_fleet(default_fleet_path())).values(), []))
    bad = copy.deepcopy(deployment["Deployment", "ember-gateway"])
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = copy.deepcopy(deployment["Deployment", "ember-gateway"])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_default_fleet_renders_valid_manifests(tmp_path, monkeypatch, capsys):
    assert main(["deploy", "k8s", "-o", str(tmp_path)]) == 0
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == ["00-namespace.yaml", "10-gateway.yaml", "20-ember-smollm2-135m-instruct-stable.yaml",
                     "30-servicemonitor.yaml"]  # fmt: skip
    assert capsys.readouterr().out.split() == [str(tmp_path / name) for name in names]
    objects = [obj for name in names for obj in yaml.safe_load_all((tmp_path / name).read_text())]
    assert validate_all(objects) == [
        "Namespace", "ConfigMap", "Secret", "Secret", "ServiceAccount", "Role", "RoleBinding", "Deployment",
        "Service", "PodDisruptionBudget", "Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor",
    ]  # fmt: skip
    found = by_kind_and_name(objects)
    replica = found["Deployment", "ember-smollm2-135m-instruct-stable"]
    pod = replica["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert replica["spec"]["replicas"] == 2 and replica["metadata"]["namespace"] == "ember"
    assert container["args"] == ["serve", "--model", "smollm2-135m-instruct", "--served-model-name",
                                 "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000", "--drain-timeout",
                                 "30", "--num-threads", "2"]  # fmt: skip
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 5 + 30 + 5  # preStop + drain + margin
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                                              "prometheus.io/path": "/metrics"}  # fmt: skip
    assert container["env"] == [
        {"name": "EMBER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "ember-fleet-credential", "key": "credential"}}}
    ]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert found["PodDisruptionBudget", "ember-smollm2-135m-instruct-stable"]["spec"]["maxUnavailable"] == 1
    gateway = found["Deployment", "ember-gateway"]["spec"]["template"]["spec"]
    assert gateway["serviceAccountName"] == "ember-gateway"
    assert gateway["containers"][0]["env"][0]["name"] == FLEET_CREDENTIAL_ENV
    assert found["Role", "ember-gateway"]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    monkeypatch.setenv(FLEET_CREDENTIAL_ENV, CREDENTIAL)
    config = gateway_config_of(found)
    deployment = config.models["smollm2-135m-instruct"].deployments[0]
    assert deployment.replicas == [] and deployment.replica_api_key == CREDENTIAL
    assert deployment.discovery.kubernetes.model_dump() == {
        "service": "ember-smollm2-135m-instruct-stable", "namespace": None, "port": "http", "scheme": "http",
        "capacity": 8, "region": "local",
    }  # fmt: skip
    assert [key.name for key in config.keys.inline] == ["local-dev"] and config.launch is None


def test_launch_kubernetes_sets_image_volume_resources_and_drain(tmp_path, monkeypatch):
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(AUTOSCALED_FLEET)
    objects = sum(render(load_fleet(fleet_path), credential=CREDENTIAL).values(), [])
    assert "ServiceMonitor" not in validate_all(objects)
    found = by_kind_and_name(objects)
    replica = found["Deployment", "ember-tiny-main"]
    pod = replica["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert replica["spec"]["replicas"] == 1  # min_replicas; the Kubernetes provider scales it from there
    assert container["image"] == "registry.example/ember:0.1.0-cuda"
    assert container["args"] == ["serve", "--model", "/models/tiny.gguf", "--served-model-name", "tiny-v1", "--host",
                                 "0.0.0.0", "--port", "8000", "--drain-timeout", "60", "--num-threads", "1",
                                 "--max-queued-requests", "32"]  # fmt: skip
    assert pod["terminationGracePeriodSeconds"] == 5 + 60 + 5
    assert container["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
    assert pod["volumes"] == [{"name": "models", "persistentVolumeClaim": {"claimName": "tiny-weights", "readOnly": True}}]
    assert container["resources"]["limits"] == {"memory": "2Gi", "nvidia.com/gpu": "1"}
    assert pod["nodeSelector"] == {"accelerator": "h100"}
    assert found["Deployment", "ember-gateway"]["spec"]["replicas"] == 2
    assert found["Service", "ember-gateway"]["spec"]["type"] == "LoadBalancer"
    assert found["Secret", "ember-fleet-credential"]["stringData"] == {"credential": CREDENTIAL}
    assert {obj["metadata"].get("namespace") for obj in objects} == {"llm", None}  # None: the Namespace itself
    monkeypatch.setenv(FLEET_CREDENTIAL_ENV, CREDENTIAL)
    config = gateway_config_of(found)
    assert config.admin_key_sha256.startswith("0e660cf4") and config.models["tiny"].autoscaling.max_replicas == 4
    assert config.models["tiny"].deployments[0].discovery.kubernetes.capacity == 4


def test_an_autoscaled_fleet_renders_the_autoscaler_with_its_rbac_and_token(tmp_path, monkeypatch):
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(AUTOSCALED_FLEET)
    files = render(load_fleet(fleet_path), credential=CREDENTIAL, control_token=CONTROL_TOKEN)
    assert validate_all(files["25-autoscaler.yaml"]) == ["Secret", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment"]
    found = by_kind_and_name(sum(files.values(), []))
    token_env = {"name": "EMBER_GATEWAY_CONTROL_TOKEN", "valueFrom": {"secretKeyRef": {"name": "ember-control-token", "key": "token"}}}
    assert found["Secret", "ember-control-token"]["stringData"] == {"token": CONTROL_TOKEN}
    assert token_env in found["Deployment", "ember-gateway"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert found["Role", "ember-autoscaler"]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
    ]
    autoscaler = found["Deployment", "ember-autoscaler"]["spec"]
    pod = autoscaler["template"]["spec"]
    assert autoscaler["replicas"] == 1 and autoscaler["strategy"] == {"type": "Recreate"}
    assert pod["serviceAccountName"] == "ember-autoscaler"
    assert pod["containers"][0]["args"] == ["autoscale", "/etc/ember/autoscaler/fleet.yaml"]
    assert pod["containers"][0]["env"] == [token_env]
    # The fleet file in its ConfigMap loads (no keys, no credential needed) and names the rendered Deployment.
    autoscaler_fleet = tmp_path / "autoscaler-fleet.yaml"
    autoscaler_fleet.write_text(found["ConfigMap", "ember-autoscaler"]["data"]["fleet.yaml"])
    monkeypatch.delenv(FLEET_CREDENTIAL_ENV, raising=False)
    fleet = load_fleet(autoscaler_fleet)
    assert fleet.autoscaled["tiny"].autoscaling.max_replicas == 4 and fleet.autoscaled["tiny"].capacity == 4
    (target,) = fleet_targets(fleet).values()
    assert (target.namespace, target.deployment) == ("llm", "ember-tiny-main")
    assert gateway_url(fleet) == "http://ember-gateway.llm.svc:8000"


def test_a_fleet_without_autoscaled_models_renders_no_autoscaler():
    files = render(load_fleet(default_fleet_path()))
    assert "25-autoscaler.yaml" not in files
    gateway = by_kind_and_name(files["10-gateway.yaml"])["Deployment", "ember-gateway"]
    assert [env["name"] for env in gateway["spec"]["template"]["spec"]["containers"][0]["env"]] == [FLEET_CREDENTIAL_ENV]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("keys: {store: keys.db}\n", "keys.store: a SQLite key store needs a persistent volume"),
        ("launch: {kubernetes: {models: {nope: {}}}}\n", "launch.kubernetes.models names no model under models: nope"),
        ("launch: {kubernetes: {gateway: {replicas: 0}}}\n", "launch.kubernetes.gateway.replicas: Input should be greater"),
    ],
)
def test_a_fleet_that_cannot_deploy_is_one_clear_error(tmp_path, capsys, change, message):
    fleet = yaml.safe_load(Path(default_fleet_path()).read_text())
    del fleet["launch"]
    fleet.update(yaml.safe_load(change))
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    assert main(["deploy", "k8s", str(tmp_path / "fleet.yaml"), "-o", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("ember deploy: error: ") and message in error and error.count("\n") == 1
    with pytest.raises(FleetError):
        render(load_fleet(tmp_path / "fleet.yaml"))


def test_deploy_imports_no_torch(tmp_path):
    code = ("import sys; from ember.cli import main; main(['deploy', 'k8s', '-o', sys.argv[1]]); "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_the_committed_chart_is_the_renderers_output():
    committed = {str(path.relative_to(CHART)): path.read_text() for path in CHART.rglob("*") if path.is_file()}
    assert committed == chart_files(), "deploy/helm/ember is stale: run python -m ember.deploy.helm deploy/helm/ember"


@pytest.mark.parametrize("fleet", ["packaged", "autoscaled"])
def test_the_chart_with_its_default_values_renders_what_ember_deploy_renders(tmp_path, fleet):
    if fleet == "packaged":
        chart, fleet_path = CHART, Path(default_fleet_path())
    else:  # the chart of another fleet file: python -m ember.deploy.helm DIR fleet.yaml
        fleet_path, chart = tmp_path / "fleet.yaml", tmp_path / "chart"
        fleet_path.write_text(AUTOSCALED_FLEET)
        write_chart(chart, str(fleet_path))
    values = yaml.safe_load((chart / "values.yaml").read_text())
    namespace = load_fleet(fleet_path).launch.kubernetes.namespace if fleet == "autoscaled" else "ember"
    secrets = {"fleetCredential": CREDENTIAL, **({"controlToken": CONTROL_TOKEN} if fleet == "autoscaled" else {})}
    chart_objects = helm_template(chart, namespace, {**values, **secrets})
    assert validate_all(chart_objects)
    plain = [obj for obj in sum(render(load_fleet(fleet_path), credential=CREDENTIAL, control_token=CONTROL_TOKEN).values(), [])
             if obj["kind"] != "Namespace"]  # fmt: skip

    def comparable(obj: dict) -> dict:  # YAML held in strings compared as data, not as text
        obj = copy.deepcopy(obj)
        for field in ("data", "stringData"):
            for key, text in obj.get(field, {}).items():
                if key.endswith(".yaml"):
                    obj[field][key] = yaml.safe_load(text)
        return obj

    assert [comparable(obj) for obj in chart_objects] == [comparable(obj) for obj in plain]


def test_chart_values_change_what_they_document():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values["fleetCredential"] = CREDENTIAL
    values["replicas"]["ember-smollm2-135m-instruct-stable"]["replicas"] = 5
    values["image"]["tag"] = "0.2.0-cpu"
    values["serviceMonitor"]["enabled"] = False
    values["gatewayConfig"]["health"]["interval_s"] = 1.0
    objects = helm_template(CHART, "prod", values)
    found = by_kind_and_name(objects)
    assert "ServiceMonitor" not in validate_all(objects)
    replica = found["Deployment", "ember-smollm2-135m-instruct-stable"]
    assert replica["spec"]["replicas"] == 5 and replica["metadata"]["namespace"] == "prod"
    assert replica["spec"]["template"]["spec"]["containers"][0]["image"] == "ember:0.2.0-cpu"
    assert found["RoleBinding", "ember-gateway"]["subjects"][0]["namespace"] == "prod"
    assert yaml.safe_load(found["ConfigMap", "ember-gateway"]["data"]["gateway.yaml"])["health"]["interval_s"] == 1.0
    with pytest.raises(Exception, match="set fleetCredential"):
        helm_template(CHART, "prod", {**values, "fleetCredential": ""})
