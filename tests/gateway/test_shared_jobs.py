"""`state: {backend: shared}`: two gateways share one PostgreSQL job store. Two real `ember gateway`
processes, one SIGKILLed while its workers run jobs: its leases lapse, the other gateway runs those
jobs again, and every accepted job succeeds with its webhook delivered under its own id. A batch
uploaded and created through either gateway runs on both and is read through either."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest
import yaml
from gateway_harness import FakeReplica, GatewayProcess, sha256, wait_until
from protocols_support import KEY, ProtocolGateway, WebhookReceiver, auth, protocol_config

from ember.gateway.jobs.webhooks import verify

JOBS = 50  # the figure: queued and running when one gateway is killed
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


def test_batch_uploaded_on_one_gateway_runs_and_is_read_on_the_other(shared_state, tmp_path):
    replica = FakeReplica("r").start()
    config = protocol_config([replica.url], state=shared_state)
    first = ProtocolGateway(config, tmp_path).start()
    second = ProtocolGateway(config, tmp_path).start()
    try:
        lines = [
            {"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
            for name, model in (("a", "tiny"), ("b", "tiny"), ("missing", "nope"), ("c", "tiny"), ("d", "tiny"), ("e", "tiny"))
        ]  # fmt: skip
        content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        uploader = openai.OpenAI(base_url=first.url + "/v1", api_key=KEY, max_retries=0)
        reader = openai.OpenAI(base_url=second.url + "/v1", api_key=KEY, max_retries=0)
        uploaded = uploader.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
        assert reader.files.content(uploaded.id).content == content
        batch = reader.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert [b.id for b in uploader.batches.list().data] == [batch.id]

        def completed() -> bool:
            return uploader.batches.retrieve(batch.id).status == "completed"

        wait_until(completed, timeout_s=30, what="the batch to complete")
        done = uploader.batches.retrieve(batch.id)
        output = [json.loads(line) for line in reader.files.content(done.output_file_id).content.splitlines()]
        errors = [
            json.loads(line) for line in uploader.files.content(done.error_file_id).content.splitlines()
        ]
    finally:
        first.stop()
        second.stop()
        replica.stop()
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
    assert sorted(line["custom_id"] for line in output) == ["a", "b", "c", "d", "e"]
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert [(line["custom_id"], line["response"]["status_code"]) for line in errors] == [("missing", 404)]
    assert len(replica.requests) == 5
