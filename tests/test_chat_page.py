"""The chat page (web/static/chat.html) in a real headless Chromium against a
real loopback server: streaming, Stop freeing the request, the conversation
kept in the page, the API key, the Markdown renderer's safety, and the narrow
layout.

``TRIOSERVE_UPDATE_SCREENSHOT=1`` makes the default-model test also write
docs/images/chat.png (the screenshot the docs show); otherwise it writes
only under the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from trioserve import testing
from trioserve.bench.scrape import wait_idle_sync
from trioserve.web.app import create_app
from trioserve.web.settings import ServerConfig

from browser import LAST_ANSWER, answer_state, answer_text, chromium
from server_fixtures import MODEL, server_config, server_in_thread

DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 390, "height": 780}
# Playwright waits, in milliseconds: a prefill and some tokens on a busy 2-core machine.
WAIT_MS = 120_000


def _content_longer_than(chars: int) -> str:
    return f"() => {LAST_ANSWER}.querySelector('.content').textContent.length > {chars}"


@pytest.mark.slow
def test_chat_page_streams_stops_and_keeps_the_conversation(default_loaded, tmp_path):
    app = create_app(server_config(), loaded=default_loaded)
    with server_in_thread(app) as server, chromium() as browser:
        page = browser.new_page(viewport=WIDE)
        page.set_default_timeout(WAIT_MS)
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
        page.goto(server.url + "/")
        page.wait_for_function("() => document.querySelector('#model').options.length > 0")
        assert page.input_value("#model") == MODEL

        # A short answer that runs to its end.
        page.fill("#system", "You are a helpful assistant. Answer briefly.")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "64")
        page.fill("#seed", "7")
        page.fill("#input", "Write a Python function that adds two numbers.")
        page.press("#input", "Enter")
        page.wait_for_function(f"() => {LAST_ANSWER}.dataset.state === 'done'")
        first_answer = page.evaluate("state.conversation.at(-1).content")  # the Markdown, as the model wrote it
        assert first_answer.strip() and answer_text(page).strip()
        stats = page.text_content(".msg.assistant .stats")
        assert "TTFT" in stats and "tok/s" in stats and "finish: " in stats, stats
        assert page.get_attribute(".msg.assistant", "data-request-id")

        # A long one, stopped while it streams.
        page.fill("#max_tokens", "400")
        page.fill("#input", "Write a long story about a dragon who learns to bake bread.")
        page.click("#send")
        page.wait_for_function(_content_longer_than(0))
        grown_from = len(answer_text(page))
        page.wait_for_function(_content_longer_than(grown_from + 40))  # the answer grows as it streams
        assert answer_state(page) == "streaming"
        assert page.is_enabled("#stop") and not page.is_enabled("#send")
        page.click("#stop")
        page.wait_for_function(f"() => {LAST_ANSWER}.dataset.state === 'stopped'")
        stopped_stats = page.text_content(".msg.assistant:nth-last-child(1) .stats")
        assert "stopped" in stopped_stats and "\u2265" in stopped_stats  # no usage chunk: counts are lower bounds
        assert page.is_enabled("#send") and not page.is_enabled("#stop")

        # The server saw the disconnect: the request was aborted and its blocks freed.
        values = wait_idle_sync(server.url, MODEL, timeout=30, blocks_free=True)
        # It ended well short of its 400 tokens (the first answer had at most 64).
        assert values["trioserve:generation_tokens_total"] < 64 + 400 - 50, values

        # The conversation lives in the page: the second request carried the first exchange.
        assert len(sent) == 2
        assert sent[1]["messages"] == [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "Write a Python function that adds two numbers."},
            {"role": "assistant", "content": first_answer},
            {"role": "user", "content": "Write a long story about a dragon who learns to bake bread."},
        ]
        assert {k: sent[1][k] for k in ("model", "temperature", "max_tokens", "seed", "stream")} == {
            "model": MODEL, "temperature": 0, "max_tokens": 400, "seed": 7, "stream": True,
        }

        shot = tmp_path / "chat.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        update_docs = bool(os.environ.get("TRIOSERVE_UPDATE_SCREENSHOT"))
        if update_docs:
            DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, DOCS_IMAGES / "chat.png")

        # A narrow window: one column, settings folded under a button, nothing wider than the window.
        page.set_viewport_size(NARROW)
        assert not page.is_visible("#settings") and page.is_visible("#settings-toggle")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert page.is_visible("#input") and page.is_visible("#send")
        assert page.evaluate("document.querySelector('#model').getBoundingClientRect().width") > NARROW["width"] / 2
        page.click("#settings-toggle")
        assert page.is_visible("#max_tokens")
        page.screenshot(path=str(tmp_path / "chat-narrow.png"))
        if update_docs:
            shutil.copyfile(tmp_path / "chat-narrow.png", DOCS_IMAGES / "chat-narrow.png")


HOSTILE = (
    "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">\n"
    "**bold** and `x < y`\n\n"
    "[ok](https://example.org/a?b=1&c=2) [bad](javascript:alert(1)) [q](https://e.org/\" onmouseover=\"x)\n\n"
    "```python\nif a < b:\n    print('<b>')\n```\n"
    "- one\n- two\n"
)


def test_chat_page_api_key_and_safe_markdown(tmp_path):
    config = ServerConfig(engine=testing.engine_config(), api_key="sekret", shutdown_timeout=5.0)
    app = create_app(config, loaded=testing.tiny_loaded())
    with server_in_thread(app) as server:
        for path in ("/", "/chat"):  # open without the key: the page asks for it
            response = httpx.get(server.url + path)
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/html; charset=utf-8"
            assert "connect-src 'self'" in response.headers["content-security-policy"]
            assert "<script>" in response.text and "src=\"http" not in response.text
        assert httpx.get(server.url + "/v1/models").status_code == 401

        with chromium() as browser:
            page = browser.new_page(viewport=WIDE)
            page.set_default_timeout(WAIT_MS)
            page.goto(server.url + "/chat")
            page.wait_for_selector("#key-box", state="visible")
            assert page.evaluate("document.querySelector('#model').options.length") == 0
            page.fill("#api-key", "sekret")
            page.dispatch_event("#api-key", "change")
            page.wait_for_function("() => document.querySelector('#model').options.length > 0")
            page.fill("#max_tokens", "8")
            page.fill("#input", "hello")
            page.click("#send")
            page.wait_for_function(f"() => {LAST_ANSWER}.dataset.state === 'done'")
            stats = page.text_content(".msg.assistant .stats")
            assert "8 tokens" in stats and "\u2265" not in stats  # exact, from the usage chunk

            # The renderer escapes everything before adding markup.
            html = page.evaluate("text => renderMarkdown(text)", HOSTILE)
            page.evaluate("html => { const d = document.createElement('div'); d.id = 'probe'; d.innerHTML = html; document.body.append(d); }", html)
            assert page.evaluate("document.querySelectorAll('#probe script, #probe img').length") == 0
            assert page.evaluate("window.pwned") is None
            assert page.text_content("#probe strong") == "bold"
            assert page.text_content("#probe p code") == "x < y"
            assert page.text_content("#probe pre code") == "if a < b:\n    print('<b>')"
            assert page.get_attribute("#probe pre", "data-lang") == "python"
            links = page.evaluate("[...document.querySelectorAll('#probe a')].map(a => [a.textContent, a.getAttribute('href')])")
            assert links == [["ok", "https://example.org/a?b=1&c=2"]]
            assert page.evaluate("document.querySelectorAll('#probe [onmouseover], #probe [onerror]').length") == 0
            assert page.evaluate("document.querySelectorAll('#probe ul li').length") == 2
