"""The web chat page in a real headless Chromium (Debian's, driven by playwright): a message gets a streamed
answer, Stop ends it (and the server aborts the request), a finished answer shows its tokens/s, Markdown renders
safely, New chat clears the conversation. A screenshot is saved in the test's tmp dir."""

from __future__ import annotations

import os
import shutil

import pytest

from live_server import start_server

CHROMIUM = "/usr/bin/chromium"
# what this machine's chromium needs headless as root, offline (no background connections to Google's hosts)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

if not shutil.which(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError(f"the chat page test needs Debian's chromium at {CHROMIUM}: apt-get install -y chromium")
    pytest.skip(f"no {CHROMIUM} (apt-get install -y chromium)", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def server(smollm2_path, server_log_dir):
    with start_server(smollm2_path, server_log_dir, "--n-ctx", "1024", "--max-seqs", "2") as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        page.goto(server.url)
        yield page
        browser.close()


def aborted(server) -> float:
    return server.metrics().get('quanta_sequences_finished_total{reason="abort"}', 0.0)


def test_stream_stop_and_new_chat(server, page, tmp_path):
    sync_api.expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct.Q4_1")
    page.fill("#system-prompt", "You are a helpful assistant who writes long answers.")
    page.fill("#max-tokens", "600")
    before = aborted(server)

    page.fill("#prompt", "Write a long story about a lighthouse keeper.")
    page.press("#prompt", "Enter")
    answer = page.locator(".message.assistant").last
    sync_api.expect(answer).to_have_class("message assistant streaming")
    sync_api.expect(page.locator(".message.user")).to_have_text("userWrite a long story about a lighthouse keeper.")
    page.wait_for_function("document.querySelector('.message.assistant .content').textContent.length > 20",
                           timeout=120_000)
    sync_api.expect(page.locator("#stop")).to_be_enabled()
    page.click("#stop")
    sync_api.expect(answer).to_have_class("message assistant")
    sync_api.expect(answer.locator(".stats")).to_contain_text("stopped")
    assert int(answer.locator(".stats").text_content().split()[0]) < 600
    sync_api.expect(page.locator("#send")).to_be_enabled()
    server.wait_idle(timeout=30)
    assert aborted(server) == before + 1  # Stop reached the engine

    page.fill("#max-tokens", "8")
    page.fill("#prompt", "Say hello.")
    page.click("#send")
    second = page.locator(".message.assistant").nth(1)
    sync_api.expect(second.locator(".stats")).to_contain_text("tok/s", timeout=120_000)
    assert second.locator(".stats").text_content().split("·")[-1].strip() in ("length", "stop")
    assert second.locator(".content").text_content().strip()
    page.screenshot(path=str(tmp_path / "chat_page.png"), full_page=True)

    page.click("#new-chat")
    sync_api.expect(page.locator(".message")).to_have_count(0)


def test_markdown_renders_safely(page):
    html = page.evaluate("Markdown.render('# Title\\n\\n```python\\nprint(1 < 2)\\n```\\n\\n- **bold** and `x<y`\\n"
                         "- [link](https://example.org) <script>alert(1)</script> [bad](javascript:alert(1))')")
    assert "<h1>Title</h1>" in html
    assert '<pre><code class="language-python">print(1 &lt; 2)</code></pre>' in html
    assert "<li><strong>bold</strong> and <code>x&lt;y</code></li>" in html
    assert '<a href="https://example.org" target="_blank" rel="noopener noreferrer">link</a>' in html
    assert "<script>" not in html and 'href="javascript' not in html
