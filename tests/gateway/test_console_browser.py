"""The web consoles in a real, headless Chromium driven by Playwright: the gateway's (log in with the
admin key, the fleet table following a replica that stops and comes back, charts after traffic,
async jobs and a batch with their status, progress and webhook deliveries, a key created and revoked
from the page and used with the openai SDK, the playground showing a stream's first token before the
rest and answering from a tiny-model replica, in JSON mode and with tools) and `ember serve`'s
(status and playground). The autoscaler's part of the fleet view: test_console_autoscaler_browser.py.

Chromium comes from the system's package manager (console_browser.py). EMBER_CONSOLE_SCREENSHOTS=<folder>
saves a screenshot of each page there (docs/console/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
from console_browser import ADMIN_KEY, screenshot
from console_browser import log_in as log_in_at
from gateway_harness import EmberServe, FakeReplica, gateway_config, http, model_config, sha256
from protocols_support import ProtocolGateway, WebhookReceiver, create_chat_batch

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow

USER_KEY = "sk-test-alice"
# Replica state changes reach the page within one health interval, one fleet refresh (2 s) and the
# browser's own time on a loaded 2-core machine.
STATE_CHANGE_TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def tiny_replica(tiny_model_dir) -> Iterator[EmberServe]:
    replica = EmberServe(tiny_model_dir, "tiny-1").start()
    yield replica
    replica.kill()


@pytest.fixture
def console(tmp_path, tiny_replica) -> Iterator[tuple[ProtocolGateway, list[FakeReplica]]]:
    """A gateway (with async jobs and batches) with model `tiny` on a real `ember serve` and model `fake`
    on two fake replicas."""
    fakes = [FakeReplica("a").start(), FakeReplica("b").start()]
    tiny = {"deployments": [{"name": "main", "replicas": [{"url": tiny_replica.url, "id": "tiny-1"}]}]}
    config = gateway_config(
        {"tiny": tiny, "fake": model_config(*fakes)},
        [{"name": "alice", "secret": USER_KEY}],
        admin_key_sha256=sha256(ADMIN_KEY),
    )
    config["keys"]["store"] = str(tmp_path / "keys.db")
    config["async"] = {
        "store": str(tmp_path / "jobs.db"),
        "jobs": {"poll_interval_s": 0.05},
        "webhooks": {"allow": ["127.0.0.0/8"], "backoff_initial_s": 0.05, "backoff_max_s": 0.2},
    }
    gateway = ProtocolGateway(config, tmp_path).start()
    yield gateway, fakes
    gateway.stop()
    for fake in fakes:
        fake.stop()


def log_in(browser, gateway: ProtocolGateway):
    return log_in_at(browser, gateway.url, "#replicas tr[data-replica='a']")


def replica_state(page, replica_id: str) -> str:
    return page.get_attribute(f"#replicas tr[data-replica='{replica_id}']", "data-state")


def test_a_wrong_admin_key_stays_on_the_login_form(browser, console):
    gateway, _ = console
    page = browser.new_page()
    page.goto(gateway.url + "/console")
    page.fill("#admin-key", "sk-wrong")
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#login-error:not(:empty)")
    assert page.text_content("#login-error") == "This endpoint needs the admin key."
    assert page.is_hidden("#main")


def test_the_fleet_table_follows_a_replica_that_stops_and_comes_back(browser, console):
    gateway, fakes = console
    page = log_in(browser, gateway)
    page.wait_for_function("() => document.querySelectorAll('#replicas tr[data-state=ready]').length === 3")
    assert page.text_content("#models tr[data-model='fake'] td:nth-child(3)") == "2 / 2"

    port = fakes[1].server.port
    fakes[1].stop()
    page.wait_for_selector(
        "#replicas tr[data-replica='b'][data-state='ejected']", timeout=STATE_CHANGE_TIMEOUT_MS
    )
    assert replica_state(page, "a") == "ready"
    assert page.text_content("#models tr[data-model='fake'] td:nth-child(3)") == "1 / 2"

    fakes[1] = FakeReplica("b", port=port).start()
    page.wait_for_selector(
        "#replicas tr[data-replica='b'][data-state='ready']", timeout=STATE_CHANGE_TIMEOUT_MS
    )
    screenshot(page, "gateway-fleet", "#fleet-section")


def test_jobs_and_batches_show_their_status_progress_and_webhook_deliveries(browser, console):
    gateway, fakes = console
    for fake in fakes:  # every request waits at the replica until released
        fake.hold()
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"authorization": f"Bearer {USER_KEY}"}
    with WebhookReceiver([500, 200]) as receiver:
        submit = http.post(
            gateway.url + "/v1/async/chat/completions",
            headers=headers,
            json={**chat, "webhook_url": receiver.url},
        )
        hooked = submit.json()["id"]
        batch = create_chat_batch(gateway.url, USER_KEY, ["x", "y"], model="fake")
        page = log_in(browser, gateway)
        job_row, batch_row = f"#jobs tr[data-job='{hooked}']", f"#batches tr[data-batch='{batch}']"
        page.wait_for_selector(f"{job_row}[data-status='running']")
        page.wait_for_selector(f"{batch_row}[data-status='in_progress'] progress[value='0'][max='2']")
        assert page.text_content(f"{job_row} td:nth-child(2)") == "alice"

        for fake in fakes:
            fake.release()
        page.wait_for_selector(f"{batch_row}[data-status='completed'] progress[value='2'][max='2']")
        # The webhook's first delivery gets a 500, the retry a 200.
        page.wait_for_selector(f"{job_row}[data-status='succeeded'] td:nth-child(8):text-is('delivered')")
    page.click(f"{job_row} td:nth-child(1) a")
    page.wait_for_selector(f"#job-detail h3[data-job='{hooked}']")
    # Every job in the store: the async one and the batch's two.
    page.wait_for_selector("#job-counts:text-is('All jobs: succeeded 3')")
    attempts = page.locator("#webhook-attempts tbody tr td:nth-child(3)").all_text_contents()
    assert attempts == ["500", "200"]
    screenshot(page, "gateway-jobs", "#jobs-section")

    page.select_option("#job-kind", "batch")  # the batch's own jobs, one per line
    page.wait_for_selector("#jobs tr[data-kind=batch]")
    assert page.locator("#jobs tbody tr").evaluate_all("rows => rows.map((row) => row.dataset.kind + ' ' + row.dataset.status)") == [
        "batch succeeded", "batch succeeded",
    ]  # fmt: skip


def test_charts_have_data_after_traffic(browser, console):
    gateway, _ = console
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=USER_KEY)
    for _ in range(3):
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    page = log_in(browser, gateway)
    page.wait_for_selector("figure[data-chart='Requests'] g[data-series='200'] circle")
    page.wait_for_selector("figure[data-chart='Time to first token'] g[data-series='p90'] circle")
    page.wait_for_selector("figure[data-chart='Output tokens'] g[data-series='tokens/s'] circle")
    # 3 requests of 3 output tokens each, all in the last hour: the dots sum to 9 tokens over 5 s buckets.
    tokens = page.evaluate(
        """() => fetch('/admin/console/series', {headers: {authorization: 'Bearer sk-admin'}})
            .then((r) => r.json()).then((s) => s.points.reduce((sum, p) => sum + p.output_tokens_per_s * s.bucket_s, 0))"""
    )
    assert tokens == 9


def test_a_key_created_on_the_page_works_until_revoked_there(browser, console):
    gateway, _ = console
    page = log_in(browser, gateway)
    page.fill("#key-form input[name=name]", "from-the-console")
    page.fill("#key-form input[name=rpm]", "100")
    page.click("#key-form button[type=submit]")
    key = page.text_content("#new-key-value", timeout=10_000)
    assert key.startswith("sk-")
    row = "#keys tr[data-key='from-the-console']"
    page.wait_for_selector(row)
    assert page.text_content(f"{row} td:nth-child(4)") == "100"

    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert (
        reply.choices[0].message.content == "Hello from a"
        or reply.choices[0].message.content == "Hello from b"
    )

    page.on("dialog", lambda dialog: dialog.accept())
    page.click(f"{row} button[data-revoke]")
    page.wait_for_selector(f"{row} td:nth-child(9):text('revoked')")
    # The revoked key's row keeps its usage: one request of 7 prompt + 3 completion tokens.
    assert (page.text_content(f"{row} td:nth-child(6)"), page.text_content(f"{row} td:nth-child(7)")) == (
        "1",
        "10",
    )
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    screenshot(page, "gateway-keys", "#keys-section")


def connect_playground(page, user_key: str, model: str) -> None:
    page.fill("#user-key", user_key)
    page.click("#user-key-form button[type=submit]")
    page.wait_for_selector(f"#playground select[name=model] option[value='{model}']", state="attached")
    page.select_option("#playground select[name=model]", model)


def chat_in_playground(page, prompt: str = "Hello", max_tokens: int = 24) -> str:
    """Sends one greedy message from the playground and returns the reply once its stream has ended."""
    page.fill("#playground input[name=max_tokens]", str(max_tokens))
    page.fill("#playground input[name=temperature]", "0")
    page.fill("#playground textarea[name=prompt]", prompt)
    page.click("#chat-send")
    page.wait_for_selector(".message.assistant[data-streaming='false']", timeout=60_000)
    stats = re.fullmatch(
        r"TTFT ([\d.]+) s · (\d+) tokens · ([\d.–]+) tokens/s", page.text_content("#chat-stats")
    )
    assert stats is not None and int(stats[2]) > 1, page.text_content("#chat-stats")
    return page.text_content(".message.assistant")


def test_the_playground_shows_tokens_as_they_arrive(browser, console):
    gateway, fakes = console
    for fake in fakes:  # each stream stops after its first chunk until released
        fake.pause_after_first_chunk = True
    page = browser.new_page()
    page.goto(gateway.url + "/console")
    connect_playground(page, USER_KEY, "fake")
    page.fill("#playground textarea[name=prompt]", "Hello")
    page.click("#chat-send")
    page.wait_for_selector(".message.assistant[data-streaming='true']:text-is('Hello')")
    for fake in fakes:
        fake.release()
    page.wait_for_selector(".message.assistant[data-streaming='false']")
    assert page.text_content(".message.assistant") in ("Hello from a", "Hello from b")
    screenshot(page, "gateway-playground", "#playground-section")


def test_the_playground_streams_a_reply_from_the_tiny_model(browser, console):
    gateway, _ = console
    page = browser.new_page()
    page.goto(gateway.url + "/console")
    connect_playground(page, USER_KEY, "tiny")
    reply = chat_in_playground(page)
    # The same request through the API, greedy: the page showed the model's exact reply.
    expected = http.post(
        gateway.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {USER_KEY}"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    ).json()["choices"][0]["message"]["content"]
    assert reply == expected


def test_ember_serve_console_shows_status_and_streams(browser, tiny_replica):
    page = browser.new_page()
    page.goto(tiny_replica.url + "/console")
    page.wait_for_selector("#status tr[data-status='Ready'] td:text('yes')")
    connect_playground(page, "no-key-needed", "tiny")
    assert chat_in_playground(page)


@pytest.fixture(scope="module")
def smollm2_replica(smollm2_gguf_path, tmp_path_factory) -> Iterator[ServerProcess]:
    """`ember serve` of SmolLM2 (served as `tiny`): JSON mode and tool calls need a model that answers. Without
    prefix caching: the tests compare the page's answer with the same request's through the API, which must
    compute the same steps (a cached prompt runs fewer, and with --quantization auto, steps of other sizes may
    take other kernels and numerics)."""
    process = ServerProcess(smollm2_gguf_path, tmp_path_factory.mktemp("smollm2") / "serve.log",
                            "--no-enable-prefix-caching")
    yield process
    process.stop()


def test_the_playground_answers_in_json_mode(browser, smollm2_replica):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(smollm2_replica.url + "/console")
    connect_playground(page, "no-key-needed", "tiny")
    page.check("#playground input[name=json_mode]")
    reply = chat_in_playground(
        page, "Describe a cat as a JSON object with its name and color.", max_tokens=96
    )
    assert isinstance(json.loads(reply), dict), reply
    screenshot(page, "playground-json-mode", "#playground-section")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_the_playground_shows_the_tool_calls_of_a_reply(browser, smollm2_replica):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(smollm2_replica.url + "/console")
    connect_playground(page, "no-key-needed", "tiny")
    page.fill("#playground textarea[name=tools]", "[not json")
    page.fill("#playground textarea[name=prompt]", "What is the weather in Paris?")
    page.click("#chat-send")
    page.wait_for_selector("#playground-error:text-matches('^Tools: not valid JSON')")
    assert page.locator(".message").count() == 0  # nothing sent

    call = call_the_weather_tool(page)
    # The reply is only a tool call: the assistant's bubble shows it, rather than being empty.
    assert page.text_content(".message.assistant") == f"get_weather({call['function']['arguments']})"
    screenshot(page, "serve-console")


def call_the_weather_tool(page) -> dict:
    """Asks the playground for the weather with get_weather required; returns the call the page shows."""
    page.fill("#playground textarea[name=tools]", json.dumps([WEATHER_TOOL]))
    page.select_option("#playground select[name=tool_choice]", "required")
    with page.expect_request(chat_request) as sent:
        chat_in_playground(page, "What is the weather in Paris?", max_tokens=64)
    assert page.text_content("#playground-error") == ""
    shown = page.text_content(".message.assistant pre[data-tool-call='get_weather']")
    arguments = json.loads(re.fullmatch(r"get_weather\((.*)\)", shown, re.DOTALL)[1])
    assert isinstance(arguments["city"], str) and arguments["city"], shown
    question = {"role": "user", "content": "What is the weather in Paris?"}
    assert sent.value.post_data_json["messages"] == [question]
    (field,) = page.locator("textarea[data-tool-result]").all()
    return {"id": field.get_attribute("data-tool-result"), "type": "function",
            "function": {"name": "get_weather", "arguments": shown[len("get_weather("):-1]}}  # fmt: skip


def chat_request(request) -> bool:
    return request.method == "POST" and request.url.endswith("/v1/chat/completions")


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_the_playground_sends_tool_results_back_and_shows_the_answer(browser, smollm2_replica, tool_choice):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(smollm2_replica.url + "/console")
    connect_playground(page, "no-key-needed", "tiny")
    call = call_the_weather_tool(page)

    page.click("#tool-results-send")  # no result entered yet: nothing is sent
    page.wait_for_selector("#playground-error:text-matches('^Tool results: enter the result of get_weather')")
    assert page.locator(".message.assistant").count() == 1

    result = json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})
    page.fill(f"textarea[data-tool-result='{call['id']}']", result)
    page.select_option("#playground select[name=tool_choice]", tool_choice)
    with page.expect_request(chat_request) as sent:
        page.click("#tool-results-send")
    page.wait_for_selector(".message.assistant[data-streaming='false'] >> nth=1", timeout=60_000)
    body = sent.value.post_data_json
    # The conversation continues: the question, the assistant's tool call, and the tool's result for it.
    assert body["messages"] == [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]
    assert body["tool_choice"] == tool_choice
    assert page.text_content(f".message.tool[data-tool-call-id='{call['id']}']") == f"get_weather → {result}"

    # The same request through the API, not streamed and greedy: the page showed the model's exact answer.
    request = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    answered = http.post(smollm2_replica.url + "/v1/chat/completions", json=request).json()
    answer = answered["choices"][0]["message"]
    expected = (answer["content"] or "") + "".join(
        f"{c['function']['name']}({c['function']['arguments']})" for c in answer.get("tool_calls") or []
    )
    assert expected and page.locator(".message.assistant").nth(1).text_content() == expected
    if tool_choice == "none":
        assert answer["content"] and not answer.get("tool_calls"), answer
        screenshot(page, "playground-tool-results", "#playground-section")


def test_tool_results_the_server_refuses_can_be_sent_again(browser, smollm2_replica):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(smollm2_replica.url + "/console")
    connect_playground(page, "no-key-needed", "tiny")
    call = call_the_weather_tool(page)
    result_field = f"textarea[data-tool-result='{call['id']}']"
    page.fill(result_field, "sunny, 21 C")
    page.select_option("#playground select[name=tool_choice]", "none")

    page.fill("#playground input[name=max_tokens]", "0")  # the server refuses it with a 400
    page.click("#tool-results-send")
    page.wait_for_selector(".message.assistant[data-streaming='false'] >> nth=1")
    refusal = page.locator(".message.assistant").nth(1).text_content()
    assert refusal.startswith("Error: ") and "max_tokens" in refusal, refusal
    # The results are back on the page, as typed, and were taken out of the conversation.
    assert page.input_value(result_field) == "sunny, 21 C"
    assert page.locator(".message.tool").count() == 0

    page.fill("#playground input[name=max_tokens]", "32")
    with page.expect_request(chat_request) as sent:
        page.click("#tool-results-send")
    page.wait_for_selector(".message.assistant[data-streaming='false'] >> nth=2", timeout=60_000)
    roles = [message["role"] for message in sent.value.post_data_json["messages"]]
    assert roles == ["user", "assistant", "tool"]  # the refused try's tool message is not sent twice
    assert page.locator(".message.assistant").nth(2).text_content()
