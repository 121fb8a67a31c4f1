"""The gateway config's `discovery:` section and `--config-overlay`: what is accepted, and the one-line
errors of what is not."""

from __future__ import annotations

import pytest
import yaml

from ember.cli import main
from ember.gateway.config import GatewayConfigError, load_config, parse_config

DISCOVERED = {"service": "ember-tiny-main", "namespace": "llm", "port": 8000, "capacity": 4}


def config_with(deployment: dict, **model) -> dict:
    return {"models": {"tiny": {"deployments": [{"name": "main", **deployment}], **model}}}


def test_a_discovered_deployment_needs_no_replica_list():
    config = parse_config(config_with({"discovery": {"kubernetes": DISCOVERED}}))
    source = config.models["tiny"].deployments[0].discovery.kubernetes
    assert (source.service, source.namespace, source.port, source.scheme, source.capacity) == (
        "ember-tiny-main", "llm", 8000, "http", 4
    )  # fmt: skip
    autoscaled = config_with(
        {"discovery": {"kubernetes": {"service": "s"}}},
        autoscaling={"max_replicas": 3, "ttft_p90_ms": 500, "itl_p90_ms": 50},
    )
    assert parse_config(autoscaled).models["tiny"].deployments[0].discovery.kubernetes.namespace is None


@pytest.mark.parametrize(
    ("deployment", "message"),
    [
        ({"replicas": [{"url": "http://10.0.0.1:8000"}], "discovery": {"kubernetes": DISCOVERED}},
         "models.tiny.deployments[0]: list replicas or set discovery, not both"),
        ({"discovery": {"kubernetes": {"namespace": "llm"}}},
         "models.tiny.deployments[0].discovery.kubernetes.service: Field required"),
        ({"discovery": {"kubernetes": {**DISCOVERED, "capacity": 0}}},
         "models.tiny.deployments[0].discovery.kubernetes.capacity: Input should be greater than 0"),
        ({"discovery": {"consul": {}}}, "models.tiny.deployments[0].discovery.consul: Extra inputs are not permitted"),
        ({}, "models.tiny.deployments[0].replicas: list at least one replica, set discovery, or give the model"),
    ],
)  # fmt: skip
def test_bad_discovery_sections_name_the_field(deployment, message):
    with pytest.raises(GatewayConfigError) as error:
        parse_config(config_with(deployment), source="fleet.yaml")
    assert message in str(error.value)


def test_an_overlay_is_merged_key_by_key_over_the_config(tmp_path):
    base = config_with({"replicas": [{"url": "http://127.0.0.1:9"}]}, routing={"policy": "round-robin"})
    base["keys"] = {"inline": []}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(base))
    digest = "0e660cf4eff39ab026fd7915157b788d06d1aa6ab43ce9afdc13241f1cf34271"
    overlay = {"admin_key_sha256": digest, "keys": {"inline": [{"name": "dev", "sha256": digest}]}}
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(overlay))
    config = load_config(tmp_path / "gateway.yaml", [tmp_path / "keys.yaml"])
    assert config.admin_key_sha256 == digest and [key.name for key in config.keys.inline] == ["dev"]
    assert config.models["tiny"].routing.policy == "round-robin"
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(GatewayConfigError, match="bad.yaml: an overlay and the config it extends must both be mappings"):
        load_config(tmp_path / "gateway.yaml", [tmp_path / "bad.yaml"])


def test_ember_gateway_reports_a_bad_overlay_in_one_line(tmp_path, capsys):
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config_with({"replicas": [{"url": "http://127.0.0.1:9"}]})))
    (tmp_path / "keys.yaml").write_text("admin_key_sha256: not-hex\n")
    argv = ["gateway", "--config", str(tmp_path / "gateway.yaml"), "--config-overlay", str(tmp_path / "keys.yaml")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"ember gateway: error: {tmp_path / 'gateway.yaml'} + {tmp_path / 'keys.yaml'}: admin_key_sha256: must be a "
        "64-character hex SHA-256 digest (`ember keys hash` prints one)\n"
    )
