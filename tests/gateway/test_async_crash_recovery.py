"""Durability: a real `ember gateway` process is SIGKILLed with 20 async jobs queued or running; after
a restart on the same job store every job completes and every webhook is delivered exactly once."""

from __future__ import annotations

import grpc
import httpx
import pytest
import yaml
from gateway_harness import FakeReplica, GatewayProcess, sha256, wait_until
from protocols_support import KEY, WebhookReceiver, auth

from ember.gateway.jobs.webhooks import verify
from ember.gateway.proto.ember.v1 import inference_pb2 as pb
from ember.gateway.proto.ember.v1 import inference_pb2_grpc as pb_grpc

JOBS = 20


@pytest.mark.slow
def test_sigkill_with_queued_jobs_loses_nothing(tmp_path):
    replica = FakeReplica("r").start()
    config = {
        "models": {"tiny": {"deployments": [{"replicas": [{"url": replica.url, "capacity": 4}]}]}},
        "keys": {"inline": [{"name": "alpha", "sha256": sha256(KEY)}]},
        "health": {"interval_s": 0.5},
        "async": {
            "store": "jobs.db",
            "jobs": {"concurrency": 2, "poll_interval_s": 0.05},
            "webhooks": {"allow": ["127.0.0.0/8"], "backoff_initial_s": 0.05, "backoff_max_s": 0.2},
        },
    }
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    processes: list[GatewayProcess] = []
    try:
        with WebhookReceiver() as receiver:
            replica.hold()
            gateway = GatewayProcess(config_path, tmp_path / "gateway.log")
            processes.append(gateway)
            with httpx.Client(base_url=gateway.url, headers=auth()) as client:
                ids = [
                    client.post(
                        "/v1/async/completions",
                        json={
                            "model": "tiny",
                            "prompt": f"job {n}",
                            "max_tokens": 3,
                            "webhook_url": receiver.url,
                        },
                    ).json()["id"]
                    for n in range(JOBS)
                ]
                wait_until(lambda: replica.in_flight == 2, what="two jobs to reach the held replica")
                statuses = [client.get(f"/v1/async/jobs/{job_id}").json()["status"] for job_id in ids]
            assert sorted(statuses) == ["queued"] * (JOBS - 2) + ["running"] * 2

            gateway.kill()
            assert (tmp_path / "jobs.db").exists()
            replica.release()

            gateway = GatewayProcess(config_path, tmp_path / "gateway.log")
            processes.append(gateway)
            with httpx.Client(base_url=gateway.url, headers=auth()) as client:

                def all_delivered() -> bool:
                    jobs = [client.get(f"/v1/async/jobs/{job_id}").json() for job_id in ids]
                    return all(job["webhook"]["status"] == "delivered" for job in jobs)

                wait_until(all_delivered, timeout_s=120, what="every job to finish and its webhook to arrive")
                jobs = [client.get(f"/v1/async/jobs/{job_id}").json() for job_id in ids]
                secret = client.get("/v1/async/webhook-secret").json()["secret"]

            with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
                health = pb_grpc.InferenceStub(channel).Health(pb.HealthRequest(), timeout=10)
            assert health.status == pb.HealthResponse.SERVING
    finally:
        for process in processes:
            process.stop()
        replica.stop()

    assert all(job["status"] == "succeeded" for job in jobs)
    assert all(job["result"]["choices"][0]["text"] == "Hello from r" for job in jobs)
    # The two jobs the crash interrupted ran again; the rest ran once.
    assert sorted(job["attempts"] for job in jobs) == [1] * (JOBS - 2) + [2] * 2
    assert all(len(job["webhook"]["attempts"]) == 1 for job in jobs)
    delivered_ids = [headers["webhook-id"] for headers, _ in receiver.deliveries]
    assert sorted(delivered_ids) == sorted(f"msg_{job_id}" for job_id in ids)
    assert all(verify(secret, headers, body) for headers, body in receiver.deliveries)
