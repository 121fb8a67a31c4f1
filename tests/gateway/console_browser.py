"""The headless Chromium the console's browser tests drive with Playwright: the system's package
(`make test` installs Debian's `chromium`), since Playwright cannot download its own browser here.
EMBER_CHROMIUM names another binary. Missing Chromium or Playwright fails the tests, saying what to
install; they never skip."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

ADMIN_KEY = "sk-admin"
# Where EMBER_CONSOLE_SCREENSHOTS=<folder> makes the tests save each console page (docs/console/).
SCREENSHOTS_ENV = "EMBER_CONSOLE_SCREENSHOTS"


def chromium_path() -> str:
    path = os.environ.get("EMBER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "Chromium is not installed: `apt-get install -y chromium` (or `make test`, which installs it)"
        )
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


def log_in(browser, gateway_url: str, wait_for: str):
    """A new page of the gateway console, logged in with the admin key, once `wait_for` is shown."""
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(gateway_url + "/console")
    page.fill("#admin-key", ADMIN_KEY)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector(wait_for)
    return page


def screenshot(page, name: str, selector: str | None = None) -> None:
    """Saves `name`.png (the element `selector`, or the whole page) when EMBER_CONSOLE_SCREENSHOTS is set."""
    folder = os.environ.get(SCREENSHOTS_ENV)
    if not folder:
        return
    path = os.path.join(folder, name + ".png")
    if selector is None:
        page.screenshot(path=path, full_page=True)
    else:
        page.locator(selector).screenshot(path=path)
