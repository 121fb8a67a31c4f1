"""The OpenAI Batch API through the real gateway, driven by the official `openai` SDK: a real
`ember serve` replica for the workflow, a scripted upstream that holds requests for cancellation."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest
from gateway_harness import wait_until
from protocols_support import (
    KEY,
    OTHER_KEY,
    ProtocolGateway,
    auth,
    protocol_config,
    real_replica,  # noqa: F401 - fixture
)


def jsonl(*items: dict) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def chat_line(custom_id: str, model: str = "tiny", content: str = "Hello") -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3},
    }


def wait_for_batch(
    client: openai.OpenAI, batch_id: str, statuses=("completed", "expired", "cancelled", "failed")
):
    batch = None

    def done() -> bool:
        nonlocal batch
        batch = client.batches.retrieve(batch_id)
        return batch.status in statuses

    wait_until(done, timeout_s=90, what=f"batch {batch_id}")
    return batch


@pytest.fixture
def gateway(real_replica, tmp_path):  # noqa: F811
    gateway = ProtocolGateway(protocol_config([real_replica]), tmp_path).start()
    yield gateway
    gateway.stop()


def sdk(gateway: ProtocolGateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def test_openai_sdk_batch_workflow_end_to_end(gateway):
    client = sdk(gateway)
    content = jsonl(
        chat_line("a"),
        chat_line("b", content="Bye"),
        chat_line("missing-model", model="nope"),
        chat_line("c"),
    )
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "file",
        "batch",
        len(content),
        "requests.jsonl",
    )
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == content

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 4
    assert batch.metadata == {"job": "nightly"}
    assert batch.expires_at - batch.created_at == 24 * 3600

    batch = wait_for_batch(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        4,
        3,
        1,
    )
    assert batch.completed_at is not None and batch.finalizing_at is not None

    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == ["a", "b", "c"]
    for line in output:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        assert line["response"]["request_id"] == line["id"]
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3

    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == 1
    assert errors[0]["custom_id"] == "missing-model"
    assert errors[0]["response"]["status_code"] == 404
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    assert gateway.metric("ember_gateway_jobs_submitted_total", kind="batch") == 4
    assert gateway.metric("ember_gateway_jobs_finished_total", kind="batch", status="succeeded") == 3
    assert gateway.metric("ember_gateway_jobs_finished_total", kind="batch", status="failed") == 1

    listed = client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    # Another key sees none of it.
    other = sdk(gateway, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.output_file_id)
    assert other.batches.list().data == []


def test_invalid_uploads_and_batches_are_refused_with_reasons(gateway):
    client = sdk(gateway)
    cases = [
        (jsonl(chat_line("a")) + b"not json\n", "Line 2 of the batch file: not valid JSON"),
        (jsonl(chat_line("a"), chat_line("a")), "Line 2 of the batch file: custom_id 'a' is used more than once"),
        (jsonl({**chat_line("a"), "method": "GET"}), "Line 1 of the batch file: 'method' must be \"POST\""),
        (jsonl({**chat_line("a"), "url": "/v1/embeddings"}), "Line 1 of the batch file: 'url' must be one of"),
        (jsonl({**chat_line("a"), "url": ["/v1/completions"]}), "Line 1 of the batch file: 'url' must be one of"),
        (jsonl({**chat_line("a"), "body": {"messages": []}}), "in 'body', You must provide a model parameter."),
        (b"\n\n", "The batch file holds no requests."),
        (b"\xff\xfe", "The file is not UTF-8 text."),
    ]  # fmt: skip
    for content, message in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
        assert message in caught.value.body["message"], caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("x.jsonl", io.BytesIO(jsonl(chat_line("a")))), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"

    uploaded = client.files.create(file=("ok.jsonl", io.BytesIO(jsonl(chat_line("a")))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert "batch endpoint is '/v1/completions'" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1 day"
        )
    assert caught.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as caught:  # a list is unhashable: this was a 500
        client.batches.create(input_file_id=uploaded.id, endpoint=["/v1/chat/completions"], completion_window="24h")
    assert caught.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        sdk(gateway, OTHER_KEY).batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.AuthenticationError):
        sdk(gateway, "sk-wrong").files.list()
    not_multipart = httpx.post(gateway.url + "/v1/files", headers=auth(), json={"purpose": "batch"})
    assert (
        not_multipart.status_code == 400 and "multipart/form-data" in not_multipart.json()["error"]["message"]
    )
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_cancel_batch_and_list_pagination(held_gateway):
    gateway, replica = held_gateway
    replica.hold()
    client = sdk(gateway)
    uploaded = client.files.create(
        file=("r.jsonl", io.BytesIO(jsonl(chat_line("x"), chat_line("y"), chat_line("z")))), purpose="batch"
    )
    first = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    wait_until(lambda: replica.in_flight == 1, what="the first batch request to reach the replica")
    second = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="2h"
    )

    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    page = client.batches.list(limit=1, after=second.id)
    assert [b.id for b in page.data] == [first.id] and not page.has_more

    cancelled = client.batches.cancel(first.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.output_file_id is None
    errors = [json.loads(line) for line in client.files.content(cancelled.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        ("x", None, "batch_cancelled"),
        ("y", None, "batch_cancelled"),
        ("z", None, "batch_cancelled"),
    ]
    assert client.batches.cancel(first.id).status == "cancelled"  # idempotent
    assert gateway.metric("ember_gateway_jobs_finished_total", kind="batch", status="cancelled") == 3

    replica.release()
    done = wait_for_batch(client, second.id)
    assert done.status == "completed" and done.request_counts.completed == 3
    assert [json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
            for line in client.files.content(done.output_file_id).text.splitlines()] == ["Hello from held"] * 3  # fmt: skip
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)
