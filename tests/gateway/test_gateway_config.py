"""The gateway's YAML config: a good file loads; a bad one fails at start naming the field and why."""

from __future__ import annotations

import textwrap

import pytest

from ember.cli import main as ember_main
from ember.gateway.config import GatewayConfigError, load_config

GOOD = """
listener_region: us-east
admin_key_sha256: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
regions:
  us-east: {latency_ms: {us-west: 70}}
  us-west: {}
models:
  tiny:
    routing: {policy: prefix-cache}
    deployments:
      - name: stable
        model: tiny-v1
        version: v1
        weight: 90
        replicas:
          - {url: "http://127.0.0.1:8001/", region: us-east, labels: {hw: cpu}, capacity: 4}
      - name: canary
        version: v2
        weight: 10
        replicas:
          - {url: "http://127.0.0.1:8002", id: canary-1, region: us-west}
keys:
  store: state/keys.db
  inline:
    - {name: ci, sha256: "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", models: [tiny], rpm: 60}
queue: {max_size: 10, default_deadline_ms: 5000}
failover: {max_attempts: 2}
"""


def write(tmp_path, text: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path, text: str) -> str:
    with pytest.raises(GatewayConfigError) as info:
        load_config(write(tmp_path, text))
    return str(info.value)


def test_a_good_file_loads(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    stable, canary = config.models["tiny"].deployments
    assert stable.replicas[0].url == "http://127.0.0.1:8001"
    assert stable.replicas[0].replica_id == "http://127.0.0.1:8001" and canary.replicas[0].replica_id == "canary-1"
    assert (stable.weight, canary.weight, canary.model) == (90, 10, None)
    assert config.models["tiny"].routing.policy == "prefix-cache"
    assert config.admin_key_sha256 == "a" * 64
    assert config.keys.store == (tmp_path / "state" / "keys.db").resolve()
    assert config.latency_ms("us-west", "us-east") == 70 and config.latency_ms("us-east", "us-east") == 0
    assert config.base_dir == tmp_path
    assert (config.queue.max_size, config.failover.max_attempts, config.health.unhealthy_threshold) == (10, 2, 3)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("capacity: 4", "capacity: 0"), "models.tiny.deployments[0].replicas[0].capacity: Input should be greater than 0"),
        (('url: "http://127.0.0.1:8002"', "url: ftp://x"), "models.tiny.deployments[1].replicas[0].url: must be an http:// or https:// URL, got 'ftp://x'"),
        (("policy: prefix-cache", "policy: fastest"), "models.tiny.routing.policy: Input should be 'round-robin', 'least-outstanding', 'load-aware', 'prefix-cache' or 'session-affinity'"),
        (("name: canary", "name: stable"), "models.tiny: deployment names must be unique, repeated: stable"),
        (("region: us-west}", "region: eu}"), "models.tiny.deployments[1].replicas[0].region 'eu' is not declared under regions"),
        (("rpm: 60", "rpm: many"), "keys.inline[0].rpm: Input should be a valid integer"),
        (('sha256: "bbbb', 'sha256: "zzzz'), "keys.inline[0].sha256: must be a 64-character hex SHA-256 digest"),
        (("queue:", "queues:"), "queues: Extra inputs are not permitted"),
        (("{latency_ms: {us-west: 70}}", "{latency_ms: {us-west: -1}}"), "regions.us-east.latency_ms: latency to 'us-west' must be >= 0"),
    ],
)  # fmt: skip
def test_bad_fields_are_named_with_their_dotted_path(tmp_path, edit, message):
    old, new = edit
    assert old in GOOD
    assert message in error_of(tmp_path, GOOD.replace(old, new, 1))


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(GatewayConfigError, match="cannot read gateway config .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    assert "not valid YAML" in error_of(tmp_path, "models: [")
    assert "the top level must be a mapping, got list" in error_of(tmp_path, "- a\n- b\n")
    assert "models: Field required" in error_of(tmp_path, "queue: {max_size: 1}\n")


def test_ember_gateway_refuses_a_bad_file_with_one_line(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("capacity: 4", "capacity: -2"))
    assert ember_main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ember gateway: error: {path}: models.tiny.deployments[0].replicas[0].capacity: Input should be greater than 0"
    )
