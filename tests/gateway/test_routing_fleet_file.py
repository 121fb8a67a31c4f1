"""`ember up`'s fleet file: the launch section, its checks against `models:`, the commands it yields.
The supervisor itself runs for real in test_routing_fleet_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ember.control.fleet import FleetError, load_fleet


def write_fleet(tmp_path: Path, model_dir: Path, gateway_port: int, replica_port: int, **launch) -> Path:
    fleet = {
        "models": {
            "tiny": {
                "deployments": [{"model": "tiny-v1", "replicas": [{"url": f"http://127.0.0.1:{replica_port}", "id": "r1"}]}]
            }
        },
        "keys": {"inline": [{"name": "t", "sha256": "0" * 64}]},
        "launch": {
            "gateway": {"port": gateway_port},
            "replicas": [
                {"port": replica_port, "model": str(model_dir), "args": ["--dtype", "float32", "--kv-cache-memory", "0.02"]}
            ],
            "restart": {"initial_backoff_s": 0.1, "max_backoff_s": 1.0},
            "shutdown_timeout_s": 60,
            **launch,
        },
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return path


def test_fleet_file_derives_each_replica_command_from_the_models_section(tmp_path):
    path = write_fleet(tmp_path, tmp_path / "model", 18500, 18501)
    fleet = load_fleet(path)
    gateway, replica = fleet.children
    assert gateway.argv[3:] == ["gateway", "--config", str(path.resolve()), "--host", "127.0.0.1", "--port", "18500",
                                "--fleet-replicas", "r1"]  # fmt: skip
    assert replica.name == "replica-18501" and replica.health_url == "http://127.0.0.1:18501/health"
    assert replica.argv[3:11] == ["serve", "--model", str(tmp_path / "model"), "--host", "127.0.0.1", "--port", "18501",
                                  "--served-model-name"]  # fmt: skip
    assert replica.argv[11] == "tiny-v1"  # what the gateway sends upstream as `model`
    assert replica.argv[-4:] == ["--dtype", "float32", "--kv-cache-memory", "0.02"]


def test_each_fleet_gets_its_own_service_credential_through_the_environment_only(tmp_path):
    path = write_fleet(tmp_path, tmp_path / "model", 18500, 18501)
    gateway, replica = load_fleet(path).children
    credential = gateway.env["EMBER_FLEET_CREDENTIAL"]
    assert len(credential) >= 40
    assert replica.env == {"EMBER_API_KEY": credential}  # `ember serve --api-key`'s default
    assert not any(credential in arg for arg in gateway.argv + replica.argv)  # argv is public (ps)
    assert load_fleet(path).children[0].env["EMBER_FLEET_CREDENTIAL"] != credential


def test_a_launched_replica_takes_no_key_but_the_fleet_credential(tmp_path):
    path = write_fleet(tmp_path, tmp_path / "model", 18500, 18501)
    data = yaml.safe_load(path.read_text())
    data["models"]["tiny"]["deployments"][0]["replicas"][0]["api_key"] = "sk-mine"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FleetError, match=r"launch\.replicas\[0\]: .* remove the api key of models\.tiny\.deployments\[0\]\.replicas\[0\]"):
        load_fleet(path)
    del data["models"]["tiny"]["deployments"][0]["replicas"][0]["api_key"]
    for flag in (["--api-key", "sk-mine"], ["--api-key=sk-mine"]):
        data["launch"]["replicas"][0]["args"] = flag
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(FleetError, match=r"launch\.replicas\[0\]\.args: .* remove --api-key"):
            load_fleet(path)


def test_fleet_file_errors_name_the_bad_field(tmp_path):
    path = write_fleet(tmp_path, tmp_path / "model", 18500, 18501, restart={"initial_backoff_s": 0})
    with pytest.raises(FleetError, match=r"launch\.restart\.initial_backoff_s: Input should be greater than 0"):
        load_fleet(path)
    data = yaml.safe_load(path.read_text())
    data["launch"]["restart"] = {}
    data["launch"]["replicas"][0]["port"] = 18599
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FleetError, match=r"launch\.replicas\[0\]\.port: no replica under models .* port 18599"):
        load_fleet(path)
    data["launch"]["replicas"][0]["port"] = 18500
    data["models"]["tiny"]["deployments"][0]["replicas"][0]["url"] = "http://127.0.0.1:18500"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FleetError, match=r"launch\.replicas\[0\]\.port: 18500 is already used by launch\.gateway"):
        load_fleet(path)


def test_the_packaged_default_fleet_is_valid_for_ember_up_and_ember_gateway():
    from ember.commands.up import default_fleet_path
    from ember.gateway.config import load_config

    fleet = load_fleet(default_fleet_path())
    assert fleet.gateway_url == "http://127.0.0.1:8000"
    assert [child.name for child in fleet.children] == ["gateway", "replica-8001", "replica-8002"]
    assert load_config(default_fleet_path()).models["smollm2-135m-instruct"].routing.policy == "prefix-cache"


def test_bad_routing_options_fail_before_anything_starts(tmp_path):
    path = write_fleet(tmp_path, tmp_path / "model", 18500, 18501)
    data = yaml.safe_load(path.read_text())
    data["models"]["tiny"]["routing"] = {"policy": "load-aware", "options": {"kv_weight": 2}}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FleetError, match=r"fleet\.yaml: models\.tiny\.routing\.options: kv_weight: Extra inputs"):
        load_fleet(path)
