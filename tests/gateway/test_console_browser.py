"""The web consoles in a real, headless Chromium driven by Playwright: the gateway's (log in with the
admin key, the fleet table following a replica that stops and comes back, charts after traffic,
a key created and revoked from the page and used with the openai SDK, the playground showing a
stream's first token before the rest and answering from a tiny-model replica) and `ember serve`'s
(status and playground).

Chromium comes from the system's package manager (`make test` installs Debian's `chromium`);
Playwright's own browser download is not used. Set EMBER_CHROMIUM to use another binary, and
EMBER_CONSOLE_SCREENSHOT to a path to save a screenshot of the gateway console (docs/console.png).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator

import openai
import pytest
from gateway_harness import EmberServe, FakeReplica, GatewayServer, gateway_config, http, model_config, sha256

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-admin"
USER_KEY = "sk-test-alice"
# Replica state changes reach the page within one health interval, one fleet refresh (2 s) and the
# browser's own time on a loaded 2-core machine.
STATE_CHANGE_TIMEOUT_MS = 10_000


def chromium_path() -> str:
    path = os.environ.get("EMBER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is not installed: `apt-get install -y chromium` (or `make test`, which installs it)")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: `pip install -e '.[dev]'` (or `make test`)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def tiny_replica(tiny_model_dir) -> Iterator[EmberServe]:
    replica = EmberServe(tiny_model_dir, "tiny-1").start()
    yield replica
    replica.kill()


@pytest.fixture
def console(tmp_path, tiny_replica) -> Iterator[tuple[GatewayServer, list[FakeReplica]]]:
    """A gateway with model `tiny` on a real `ember serve` and model `fake` on two fake replicas."""
    fakes = [FakeReplica("a").start(), FakeReplica("b").start()]
    tiny = {"deployments": [{"name": "main", "replicas": [{"url": tiny_replica.url, "id": "tiny-1"}]}]}
    config = gateway_config(
        {"tiny": tiny, "fake": model_config(*fakes)},
        [{"name": "alice", "secret": USER_KEY}],
        admin_key_sha256=sha256(ADMIN_KEY),
    )
    config["keys"]["store"] = str(tmp_path / "keys.db")
    gateway = GatewayServer(config, tmp_path)
    gateway.server.start()
    yield gateway, fakes
    gateway.server.stop()
    for fake in fakes:
        fake.stop()


def log_in(browser, gateway: GatewayServer):
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(gateway.url + "/console")
    page.fill("#admin-key", ADMIN_KEY)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#replicas tr[data-replica='a']")
    return page


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
    page.wait_for_selector("#replicas tr[data-replica='b'][data-state='ejected']", timeout=STATE_CHANGE_TIMEOUT_MS)
    assert replica_state(page, "a") == "ready"
    assert page.text_content("#models tr[data-model='fake'] td:nth-child(3)") == "1 / 2"

    fakes[1] = FakeReplica("b", port=port).start()
    page.wait_for_selector("#replicas tr[data-replica='b'][data-state='ready']", timeout=STATE_CHANGE_TIMEOUT_MS)


def test_charts_have_data_after_traffic(browser, console):
    gateway, _ = console
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=USER_KEY)
    for _ in range(3):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
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
    screenshot = os.environ.get("EMBER_CONSOLE_SCREENSHOT")
    if screenshot:
        page.screenshot(path=screenshot, full_page=True)


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
    reply = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.choices[0].message.content == "Hello from a" or reply.choices[0].message.content == "Hello from b"

    page.on("dialog", lambda dialog: dialog.accept())
    page.click(f"{row} button[data-revoke]")
    page.wait_for_selector(f"{row} td:nth-child(9):text('revoked')")
    # The revoked key's row keeps its usage: one request of 7 prompt + 3 completion tokens.
    assert (page.text_content(f"{row} td:nth-child(6)"), page.text_content(f"{row} td:nth-child(7)")) == ("1", "10")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3)


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
    stats = re.fullmatch(r"TTFT ([\d.]+) s · (\d+) tokens · ([\d.–]+) tokens/s", page.text_content("#chat-stats"))
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
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24, "temperature": 0},
    ).json()["choices"][0]["message"]["content"]
    assert reply == expected


def test_ember_serve_console_shows_status_and_streams(browser, tiny_replica):
    page = browser.new_page()
    page.goto(tiny_replica.url + "/console")
    page.wait_for_selector("#status tr[data-status='Ready'] td:text('yes')")
    connect_playground(page, "no-key-needed", "tiny")
    assert chat_in_playground(page)
