"""The ember.v1.Inference gRPC service with a real grpcio client: token streaming against a real
`ember serve` replica, and every mapped error status (auth, permissions, limits, deadlines, input,
unknown model, unavailable replicas)."""

from __future__ import annotations

import json

import grpc
import pytest
from gateway_harness import FakeReplica, free_port, sha256, wait_until
from protocols_support import (
    KEY,
    ProtocolGateway,
    protocol_config,
    real_replica,  # noqa: F401 - fixture
    replica_metric,
)

from ember.gateway.proto.ember.v1 import inference_pb2 as pb
from ember.gateway.proto.ember.v1 import inference_pb2_grpc as pb_grpc

LIMITED_KEY = "sk-test-limited"
SLOW_KEY = "sk-test-slow"


def metadata(key: str = KEY) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def start_gateway(replica_url: str, tmp_path, **extra) -> ProtocolGateway:
    config = protocol_config([replica_url], **extra)
    config["keys"]["inline"] += [
        {"name": "limited", "sha256": sha256(LIMITED_KEY), "models": ["another-model"]},
        {"name": "slow", "sha256": sha256(SLOW_KEY), "rpm": 1},
    ]
    return ProtocolGateway(config, tmp_path, grpc_port=free_port()).start()


@pytest.fixture
def gateway(real_replica, tmp_path):  # noqa: F811
    gateway = start_gateway(real_replica, tmp_path)
    yield gateway
    gateway.stop()


@pytest.fixture
def stub(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        yield pb_grpc.InferenceStub(channel)


LONG_TOKENS = 16000


def chat_request(max_tokens: int = 6, **fields) -> pb.GenerateRequest:
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Write a poem")])
    fields = {"temperature": 0.0, "ignore_eos": True, **fields}
    return pb.GenerateRequest(model="tiny", chat=chat, max_tokens=max_tokens, **fields)


def test_generate_streams_tokens_and_matches_complete(stub):
    chunks = list(stub.Generate(chat_request(), metadata=metadata(), timeout=60))
    assert len(chunks) >= 3
    *tokens, last = chunks
    assert all(chunk.text and not chunk.finish_reason for chunk in tokens)
    assert last.text == "" and last.finish_reason == "length"
    assert (last.usage.completion_tokens, last.usage.total_tokens) == (6, last.usage.prompt_tokens + 6)
    assert {chunk.id for chunk in chunks} == {last.id} and last.id.startswith("chatcmpl-")

    # Greedy decoding: the unary call returns exactly the streamed text.
    complete = stub.Complete(chat_request(), metadata=metadata(), timeout=60)
    assert complete.text == "".join(chunk.text for chunk in tokens)
    assert (complete.model, complete.finish_reason, complete.usage.completion_tokens) == ("tiny", "length", 6)

    prompt = stub.Complete(
        pb.GenerateRequest(model="tiny", prompt="Hello", max_tokens=3, ignore_eos=True),
        metadata=metadata(),
        timeout=60,
    )
    assert prompt.id.startswith("cmpl-") and prompt.usage.completion_tokens == 3

    models = stub.ListModels(pb.ListModelsRequest(), metadata=metadata(), timeout=10)
    assert [(m.id, m.owned_by) for m in models.models] == [("tiny", "ember-gateway")]
    assert stub.ListModels(pb.ListModelsRequest(), metadata=metadata(LIMITED_KEY), timeout=10).models == []
    health = stub.Health(pb.HealthRequest(), timeout=10)
    assert (health.status, dict(health.healthy_replicas)) == (pb.HealthResponse.SERVING, {"tiny": 1})


def code_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_error_statuses(stub):
    request = chat_request(max_tokens=2)
    error = code_of(lambda: stub.Complete(request, timeout=10))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in error.details()
    error = code_of(lambda: list(stub.Generate(request, metadata=metadata("sk-wrong"), timeout=10)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=10)).code() == (
        grpc.StatusCode.UNAUTHENTICATED
    )

    error = code_of(lambda: stub.Complete(request, metadata=metadata(LIMITED_KEY), timeout=10))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "may not use model" in error.details()

    unknown = pb.GenerateRequest(model="nope", prompt="x")
    error = code_of(lambda: list(stub.Generate(unknown, metadata=metadata(), timeout=10)))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "does not exist" in error.details()

    error = code_of(lambda: stub.Complete(pb.GenerateRequest(model="tiny"), metadata=metadata(), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in error.details()
    # Rejected by the replica itself (its 400 passes through the gateway).
    bad_sampling = chat_request(temperature=-1.0)
    error = code_of(lambda: list(stub.Generate(bad_sampling, metadata=metadata(), timeout=30)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.details()

    assert stub.Complete(request, metadata=metadata(SLOW_KEY), timeout=30).usage.completion_tokens == 2
    error = code_of(lambda: stub.Complete(request, metadata=metadata(SLOW_KEY), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(error.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1


@pytest.fixture
def held(tmp_path):
    replica = FakeReplica("held").start()
    gateway = start_gateway(replica.url, tmp_path / "gw", capacity=1)
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}")
    yield gateway, replica, pb_grpc.InferenceStub(channel)
    channel.close()
    replica.release()
    gateway.stop()
    replica.stop()


def test_deadline_and_unavailable(held):
    gateway, replica, stub = held
    replica.hold()
    first = stub.Complete.future(chat_request(), metadata=metadata(), timeout=60)
    wait_until(lambda: replica.in_flight == 1, what="the first request to occupy the only slot")
    # The second waits in the gateway's queue for the slot; the client's deadline bounds that wait.
    error = code_of(lambda: stub.Complete(chat_request(), metadata=metadata(), timeout=0.5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: gateway.app.dispatcher.queue.depth("tiny") == 0, what="the queue to drop the request")
    replica.release()
    assert first.result().text == "Hello from held"

    replica.fail_status = 503
    error = code_of(lambda: list(stub.Generate(chat_request(), metadata=metadata(), timeout=30)))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_deadline_mid_stream_aborts_the_generation(stub, real_replica):  # noqa: F811
    # Far more tokens than the tiny model can generate in the 2 s deadline, however fast the machine.
    long_request = chat_request(max_tokens=LONG_TOKENS)
    generated_before = replica_metric(real_replica, "vllm:generation_tokens_total")
    chunks = []
    with pytest.raises(grpc.RpcError) as caught:
        for chunk in stub.Generate(long_request, metadata=metadata(), timeout=2.0):
            chunks.append(chunk)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(chunks) < LONG_TOKENS
    # The gateway dropped the call and the replica aborted the generation instead of finishing it.
    running = "vllm:num_requests_running"
    wait_until(lambda: replica_metric(real_replica, running) == 0, timeout_s=60, what="the replica to stop")
    assert replica_metric(real_replica, "vllm:generation_tokens_total") - generated_before < LONG_TOKENS


PICK_TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}


def test_structured_output_and_tool_calls_pass_through(stub):
    """The JSON-text fields reach the replica: a named tool_choice gives a call (whole in Complete, on the
    last chunk of Generate) whose arguments follow the tool's schema, even from the random tiny model."""
    request = chat_request(max_tokens=20, ignore_eos=False, tools_json=json.dumps([PICK_TOOL]),
                           tool_choice_json=json.dumps({"type": "function", "function": {"name": "pick"}}))
    complete = stub.Complete(request, metadata=metadata(), timeout=60)
    assert complete.finish_reason == "tool_calls" and complete.text == ""
    (call,) = complete.tool_calls
    assert call.name == "pick" and call.id.startswith("call_")
    assert json.loads(call.arguments) in ({"unit": "c"}, {"unit": "f"})
    *_, last = stub.Generate(request, metadata=metadata(), timeout=60)
    assert last.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in last.tool_calls] == [(call.name, call.arguments)]

    choice = chat_request(max_tokens=10, ignore_eos=False, structured_outputs_json='{"choice": ["yes", "no"]}')
    assert stub.Complete(choice, metadata=metadata(), timeout=60).text in ("yes", "no")

    error = code_of(lambda: stub.Complete(chat_request(tools_json="[{"), metadata=metadata(), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools_json" in error.details()
