"""`state: {backend: shared}`: two real `ember gateway` processes share one PostgreSQL job store. One is
SIGKILLed while its workers run jobs; its leases lapse, the other gateway runs those jobs again, and
every accepted job succeeds with its webhook delivered under its own id."""

from __future__ import annotations

import httpx
import pytest
import yaml
from gateway_harness import FakeReplica, sha256, wait_until
from protocols_support import KEY, WebhookReceiver, auth
from test_async_crash_recovery import GatewayProcess

from ember.gateway.jobs.webhooks import verify

JOBS = 30
CONCURRENCY = 4  # jobs each gateway runs at once


@pytest.mark.slow
def test_sigkill_of_one_gateway_loses_no_job(shared_state, tmp_path):
    replica = FakeReplica("r").start()
    config = {
        "models": {"tiny": {"deployments": [{"replicas": [{"url": replica.url, "capacity": CONCURRENCY}]}]}},
        "keys": {"inline": [{"name": "alpha", "sha256": sha256(KEY)}]},
        "health": {"interval_s": 0.5},
        "async": {
            "jobs": {"concurrency": CONCURRENCY, "poll_interval_s": 0.05},
            "webhooks": {"allow": ["127.0.0.0/8"], "backoff_initial_s": 0.05, "backoff_max_s": 0.2},
        },
        "state": {**shared_state, "postgres": {**shared_state["postgres"], "job_lease_s": 1.5}},
    }
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    processes: list[GatewayProcess] = []
    try:
        with WebhookReceiver() as receiver:
            replica.hold()
            doomed = GatewayProcess(config_path, tmp_path / "doomed.log")
            survivor = GatewayProcess(config_path, tmp_path / "survivor.log")
            processes += [doomed, survivor]
            ids = []
            for n in range(JOBS):
                gateway = (doomed, survivor)[n % 2]
                body = {"model": "tiny", "prompt": f"job {n}", "max_tokens": 3, "webhook_url": receiver.url}
                response = httpx.post(gateway.url + "/v1/async/completions", json=body, headers=auth())
                assert response.status_code == 202, response.text
                ids.append(response.json()["id"])
            # Both gateways' workers busy at the held replica, the rest queued.
            wait_until(
                lambda: replica.in_flight == 2 * CONCURRENCY, what="both gateways' jobs at the replica"
            )

            doomed.kill()
            replica.release()

            with httpx.Client(base_url=survivor.url, headers=auth()) as client:

                def all_delivered() -> bool:
                    jobs = [client.get(f"/v1/async/jobs/{job_id}").json() for job_id in ids]
                    return all(job["webhook"]["status"] == "delivered" for job in jobs)

                wait_until(all_delivered, timeout_s=60, what="every job to finish and its webhook to arrive")
                jobs = [client.get(f"/v1/async/jobs/{job_id}").json() for job_id in ids]
                secret = client.get("/v1/async/webhook-secret").json()["secret"]
            unknown = httpx.get(survivor.url + "/v1/batches", headers=auth())
    finally:
        for process in processes:
            process.stop()
        replica.stop()

    assert all(job["status"] == "succeeded" for job in jobs)
    assert all(job["result"]["choices"][0]["text"] == "Hello from r" for job in jobs)
    # The dead gateway's running jobs ran again on the survivor; every other job ran once.
    assert sorted(job["attempts"] for job in jobs) == [1] * (JOBS - CONCURRENCY) + [2] * CONCURRENCY
    assert len(replica.requests) == JOBS + CONCURRENCY
    delivered_ids = [headers["webhook-id"] for headers, _ in receiver.deliveries]
    assert sorted(delivered_ids) == sorted(f"msg_{job_id}" for job_id in ids)  # one id per job, each once
    assert all(verify(secret, headers, body) for headers, body in receiver.deliveries)
    assert unknown.status_code == 501 and unknown.json()["error"]["code"] == "batch_api_unavailable"
