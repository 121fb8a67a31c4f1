"""The `autoscaling:` section of a model and `launch.autoscaled` in the fleet file: a good file loads,
a bad one fails before anything starts, naming the dotted path of the bad field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from ember.control.fleet import FleetError, load_fleet
from ember.gateway.config import GatewayConfigError, load_config

AUTOSCALING = {
    "min_replicas": 0,
    "max_replicas": 3,
    "ttft_p90_ms": 800,
    "itl_p90_ms": 120,
    "queue_wait_p90_ms": 300,
    "scale_up_delay_s": 2,
    "scale_down_delay_s": 30,
    "scale_to_zero_after_s": 120,
    "cost_per_replica_hour": 0.25,
}


def fleet_data(**autoscaling) -> dict:
    return {
        "models": {
            "tiny": {
                "deployments": [{"model": "tiny-v1", "replicas": []}],
                "autoscaling": {**AUTOSCALING, **autoscaling},
            },
            "static": {"deployments": [{"replicas": [{"url": "http://127.0.0.1:18601", "id": "s1"}]}]},
        },
        "keys": {"inline": [{"name": "t", "sha256": "0" * 64}]},
        "launch": {
            "gateway": {"port": 18600},
            "replicas": [{"port": 18601, "model": "static-model"}],
            "autoscaled": {"tiny": {"model": "tiny-model", "args": ["--dtype", "float32"], "capacity": 4}},
            "autoscaler": {"interval_s": 0.5, "port": 18690},
        },
    }


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_autoscaled_model_loads_with_every_field_and_its_replica_command(tmp_path):
    (tmp_path / "tiny-model").mkdir()
    path = write(tmp_path, fleet_data())
    config = load_config(path)
    autoscaling = config.models["tiny"].autoscaling
    assert autoscaling.model_dump() == {
        **AUTOSCALING, "stable_window_s": 30.0, "panic_window_s": 6.0, "hold_limit": 64,
    }  # fmt: skip
    assert config.models["static"].autoscaling is None
    fleet = load_fleet(path)
    tiny = fleet.autoscaled["tiny"]
    assert list(fleet.autoscaled) == ["tiny"] and tiny.capacity == 4 and tiny.host == "127.0.0.1"
    assert tiny.serve_args[:6] == ["serve", "--model", str(tmp_path / "tiny-model"), "--served-model-name", "tiny-v1",
                                   "--num-threads"]  # fmt: skip
    assert tiny.serve_args[-2:] == ["--dtype", "float32"]
    assert fleet.launch.autoscaler.interval_s == 0.5 and fleet.launch.autoscaler.port == 18690
    # Only the gateway and the static replica start with the fleet; autoscaled ones start on demand.
    assert [child.name for child in fleet.children] == ["gateway", "replica-18601"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"min_replicas": -1}, r"models\.tiny\.autoscaling\.min_replicas: Input should be greater than or equal to 0"),
        ({"max_replicas": 0}, r"models\.tiny\.autoscaling\.max_replicas: Input should be greater than or equal to 1"),
        ({"ttft_p90_ms": 0}, r"models\.tiny\.autoscaling\.ttft_p90_ms: Input should be greater than 0"),
        ({"itl_p90_ms": "fast"}, r"models\.tiny\.autoscaling\.itl_p90_ms: Input should be a valid number"),
        ({"scale_down_delay_s": -5}, r"models\.tiny\.autoscaling\.scale_down_delay_s: Input should be greater than or equal"),
        ({"min_replicas": 4}, r"models\.tiny\.autoscaling: max_replicas \(3\) is below min_replicas \(4\)"),
        ({"panic_window_s": 60}, r"models\.tiny\.autoscaling: panic_window_s \(60\.0\) is longer than stable_window_s"),
        ({"target": 3}, r"models\.tiny\.autoscaling\.target: Extra inputs are not permitted"),
    ],
)
def test_a_bad_autoscaling_field_is_named_by_its_dotted_path(tmp_path, change, message):
    with pytest.raises(GatewayConfigError, match=message):
        load_config(write(tmp_path, fleet_data(**change)))


def test_max_replicas_and_the_objectives_are_required(tmp_path):
    data = fleet_data()
    for field in ("max_replicas", "ttft_p90_ms", "itl_p90_ms"):
        del data["models"]["tiny"]["autoscaling"][field]
    with pytest.raises(GatewayConfigError) as info:
        load_config(write(tmp_path, data))
    for field in ("max_replicas", "ttft_p90_ms", "itl_p90_ms"):
        assert f"models.tiny.autoscaling.{field}: Field required" in str(info.value)


def test_replicas_are_either_listed_or_autoscaled(tmp_path):
    data = fleet_data()
    data["models"]["tiny"]["deployments"][0]["replicas"] = [{"url": "http://127.0.0.1:18602"}]
    with pytest.raises(GatewayConfigError, match=r"models\.tiny\.deployments\[0\]\.replicas: must be empty for an autoscaled"):
        load_config(write(tmp_path, data))
    data = fleet_data()
    data["models"]["static"]["deployments"][0]["replicas"] = []
    with pytest.raises(GatewayConfigError, match=r"models\.static\.deployments\[0\]\.replicas: list at least one replica"):
        load_config(write(tmp_path, data))
    data = fleet_data()
    data["models"]["tiny"]["deployments"].append({"name": "canary", "replicas": []})
    with pytest.raises(GatewayConfigError, match=r"models\.tiny\.deployments: an autoscaled model has exactly one"):
        load_config(write(tmp_path, data))


def test_launch_autoscaled_names_only_autoscaled_models(tmp_path):
    data = fleet_data()
    data["launch"]["autoscaled"]["static"] = {"model": "x"}
    with pytest.raises(FleetError, match=r"launch\.autoscaled\.static: names no model with an autoscaling section"):
        load_fleet(write(tmp_path, data))
    data = fleet_data()
    data["launch"]["autoscaled"]["tiny"]["capacity"] = 0
    with pytest.raises(FleetError, match=r"launch\.autoscaled\.tiny\.capacity: Input should be greater than 0"):
        load_fleet(write(tmp_path, data))
    data = fleet_data()
    data["launch"]["autoscaler"]["interval_s"] = 0
    with pytest.raises(FleetError, match=r"launch\.autoscaler\.interval_s: Input should be greater than 0"):
        load_fleet(write(tmp_path, data))


def test_print_commands_shows_the_autoscaled_replica_command_and_fleet_status_needs_the_port(tmp_path, capsys):
    from ember.cli import main

    (tmp_path / "tiny-model").mkdir()
    data = fleet_data()
    path = write(tmp_path, data)
    assert main(["up", str(path), "--print-commands"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"tiny (autoscaled, 0..3 replicas): {sys.executable} -m ember.cli serve --model ")
    assert last.endswith("--dtype float32 --host 127.0.0.1 --port <a free port>")
    del data["launch"]["autoscaler"]["port"]
    assert main(["fleet", "status", str(write(tmp_path, data))]) == 2
    assert "launch.autoscaler.port" in capsys.readouterr().err


def test_a_profile_gives_the_capacity_unless_capacity_is_set_and_the_policy_its_step_model(tmp_path):
    (tmp_path / "tiny-model").mkdir()
    (tmp_path / "tiny.json").write_text(
        '{"prefill_tokens_per_s": 900, "decode_step_s": 0.01, "decode_step_per_seq_s": 0.001, "max_batch": 12,'
        ' "cold_start_s": 5}'
    )
    data = fleet_data()
    data["launch"]["autoscaled"]["tiny"] = {"model": "tiny-model", "profile": "tiny.json"}
    assert load_fleet(write(tmp_path, data)).autoscaled["tiny"].capacity == 12
    data["launch"]["autoscaled"]["tiny"]["capacity"] = 4
    model = load_fleet(write(tmp_path, data)).autoscaled["tiny"]
    assert model.capacity == 4
    # The policy gets the profile either way: its step-time model checks every scale down.
    assert model.profile is not None and model.profile.step_s(3) == 0.012
    data["launch"]["autoscaled"]["tiny"] = {"model": "tiny-model", "profile": "missing.json"}
    with pytest.raises(FleetError, match=r"launch\.autoscaled\.tiny\.profile: cannot read .*missing\.json: No such file"):
        load_fleet(write(tmp_path, data))
    (tmp_path / "bad.json").write_text('{"max_batch": 0}')
    data["launch"]["autoscaled"]["tiny"] = {"model": "tiny-model", "profile": "bad.json"}
    with pytest.raises(FleetError, match=r"launch\.autoscaled\.tiny\.profile: .*bad\.json is not a profile"):
        load_fleet(write(tmp_path, data))
