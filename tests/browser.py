"""Headless Chromium for the chat page's tests, driven by Playwright.

Playwright's own browser download is not reachable everywhere, so the tests
launch the distribution's ``chromium`` (``scripts/setup.sh`` installs it
where apt exists). Where it or Playwright is missing, the tests fail under
``CI=true`` with what to install, and skip with the same message elsewhere.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

INSTALL = "install them with: apt-get install -y chromium && .venv/bin/pip install playwright (or ./scripts/setup.sh)"


def _missing(what: str) -> None:
    message = f"the chat page's browser tests need {what}; {INSTALL}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def chromium_path() -> str:
    """The Chromium binary: ``$TRIOSERVE_CHROMIUM``, else ``chromium`` or ``chromium-browser`` on the PATH."""
    for candidate in (os.environ.get("TRIOSERVE_CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (path := shutil.which(candidate)):
            return path
    _missing("a Chromium binary (none of $TRIOSERVE_CHROMIUM, chromium, chromium-browser found)")
    raise AssertionError("unreachable")


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium browser (Playwright's sync API), closed at the end."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package")
    executable = chromium_path()
    with sync_playwright() as playwright:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


# What the page shows, read through the DOM.
LAST_ANSWER = "[...document.querySelectorAll('.msg.assistant')].at(-1)"


def answer_state(page: Any) -> str | None:
    return page.evaluate(f"{LAST_ANSWER} && {LAST_ANSWER}.dataset.state")


def answer_text(page: Any) -> str:
    return page.evaluate(f"{LAST_ANSWER} ? {LAST_ANSWER}.querySelector('.content').textContent : ''")
