"""`launch.ray` in the fleet file: it selects the Ray provider for the autoscaled models, sets each
replica's Ray resource request (and with it --num-threads), and a bad field fails before anything
starts, named by its dotted path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ember.control.fleet import FleetError, load_fleet


def fleet_data(ray: dict | None, autoscaled: bool = True) -> dict:
    replicas = [] if autoscaled else [{"url": "http://127.0.0.1:18701", "id": "s1"}]
    model = {"deployments": [{"model": "tiny-v1", "replicas": replicas}]}
    if autoscaled:
        model["autoscaling"] = {"min_replicas": 1, "max_replicas": 2, "ttft_p90_ms": 800, "itl_p90_ms": 120}
    launch = {"gateway": {"port": 18700}, "ray": ray}
    if not autoscaled:
        launch["replicas"] = [{"port": 18701, "model": "tiny-model"}]
    return {"models": {"tiny": model}, "keys": {"inline": [{"name": "t", "sha256": "0" * 64}]}, "launch": launch}


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_ray_section_loads_with_every_field_and_sets_the_replica_threads(tmp_path):
    ray = {"address": "local", "namespace": "ember-test", "head": {"num_cpus": 2, "object_store_memory_mb": 100},
           "replica": {"num_cpus": 1.5, "num_gpus": 0.5, "memory_mb": 1024}, "health_interval_s": 0.5}  # fmt: skip
    fleet = load_fleet(write(tmp_path, fleet_data(ray)))
    assert fleet.launch.ray.model_dump() == {
        "address": "local", "namespace": "ember-test",
        "head": {"num_cpus": 2, "num_gpus": None, "object_store_memory_mb": 100},
        "replica": {"num_cpus": 1.5, "num_gpus": 0.5, "memory_mb": 1024}, "health_interval_s": 0.5,
    }  # fmt: skip
    args = fleet.autoscaled["tiny"].serve_args
    assert args[args.index("--num-threads") + 1] == "2"  # 1.5 CPUs granted by Ray, rounded up


@pytest.mark.parametrize("address", ["auto", "local", "ray://head.example:10001", "10.0.0.5:6379"])
def test_every_kind_of_address_is_accepted(tmp_path, address):
    assert load_fleet(write(tmp_path, fleet_data({"address": address}))).launch.ray.address == address


@pytest.mark.parametrize(
    ("ray", "message"),
    [
        ({"address": "http://head:8265"}, r'launch\.ray: address must be "local", "auto", ray://host:port or host:port'),
        ({"address": "auto", "head": {"num_cpus": 2}}, r'launch\.ray: head: only for address "local"'),
        ({"replica": {"num_gpus": -1}}, r"launch\.ray\.replica\.num_gpus: Input should be greater than or equal to 0"),
        ({"replica": {"memory_mb": 0}}, r"launch\.ray\.replica\.memory_mb: Input should be greater than 0"),
        ({"replica": {"cpus": 1}}, r"launch\.ray\.replica\.cpus: Extra inputs are not permitted"),
        ({"address": "local", "head": {"object_store_memory_mb": 10}},
         r"launch\.ray\.head\.object_store_memory_mb: Input should be greater than or equal to 80"),
        ({"health_interval_s": 0}, r"launch\.ray\.health_interval_s: Input should be greater than 0"),
    ],
)
def test_a_bad_ray_field_is_named_by_its_dotted_path(tmp_path, ray, message):
    with pytest.raises(FleetError, match=message):
        load_fleet(write(tmp_path, fleet_data(ray)))


def test_a_host_for_ray_replicas_is_refused(tmp_path):
    data = fleet_data({"address": "auto"})
    data["launch"]["autoscaled"] = {"tiny": {"host": "0.0.0.0"}}
    with pytest.raises(FleetError, match=r"launch\.autoscaled\.tiny\.host: replicas on Ray listen on their node's address"):
        load_fleet(write(tmp_path, data))


def test_ray_without_an_autoscaled_model_is_refused(tmp_path):
    (tmp_path / "tiny-model").mkdir()
    with pytest.raises(FleetError, match=r"launch\.ray: Ray runs the replicas of models with an autoscaling section"):
        load_fleet(write(tmp_path, fleet_data({"address": "auto"}, autoscaled=False)))


def test_print_commands_says_the_replicas_run_as_ray_actors(tmp_path):
    path = write(tmp_path, fleet_data({"address": "ray://head:10001", "replica": {"num_cpus": 2, "num_gpus": 1}}))
    result = subprocess.run([sys.executable, "-m", "ember.cli", "up", str(path), "--print-commands"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = result.stdout.splitlines()[-1]
    assert line.startswith("tiny (autoscaled, 1..2 replicas): ")
    assert "--num-threads 2" in line
    assert line.endswith("--host <its node> --port <a free port>  (a Ray actor, address ray://head:10001, "
                         "num_cpus 2, num_gpus 1)")  # fmt: skip


def test_ember_up_without_ray_installed_names_the_extra(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n\n\nclass NoRay:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'ray':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n\n\n"
        "sys.meta_path.insert(0, NoRay())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).resolve().parents[2])])}
    path = write(tmp_path, fleet_data({"address": "local"}))
    result = subprocess.run([sys.executable, "-m", "ember.cli", "up", str(path)], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == "ember up: error: No module named 'ray'; install it with: pip install 'ember[ray]'"
