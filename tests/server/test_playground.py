"""The web playground in a real browser (headless Debian chromium driven by Playwright): load the page,
upload a schema and see its layout, run a prompt and see streamed text and coloured spans, see a bad PML
error at its line, run two chat turns with reuse reported; plus the page's HTTP contract."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.test_api import SCHEMA

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img" / "playground.png"


def test_page_and_assets_load_without_a_key_and_api_calls_still_need_one(live_server, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-a": "alpha"}')
    server = live_server(api_keys_file=str(keys))
    page = httpx.get(server.url + "/playground/", timeout=30)
    assert page.status_code == 200 and "promptcache playground" in page.text
    assert httpx.get(server.url + "/playground/static/app.js", timeout=30).status_code == 200
    assert httpx.get(server.url + "/playground", follow_redirects=False).status_code in (307, 308)
    assert httpx.get(server.url + "/v1/schemas").status_code == 401


@pytest.fixture
def browser_page():
    playwright_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        yield page
        browser.close()


@pytest.mark.timeout(180)
def test_playground_in_a_real_browser(live_server, browser_page, tmp_path):
    server = live_server(prefix_block_size=8)
    page = browser_page
    page.goto(server.url + "/playground/")
    page.fill("#api-key", "unused")

    # A bad schema: the error names its line, and the editor selects that line.
    page.fill("#pml-editor", '<schema name="bad">\n  <module name="x">ok</module>\n  <module>no name</module>\n</schema>')
    page.click("#upload")
    page.wait_for_selector("#upload-error:not([hidden])")
    assert "line 3" in page.inner_text("#upload-error")
    assert page.get_attribute("#upload-error", "data-line") == "3"

    # Upload, layout drawn with one block per module, coloured by tier.
    page.fill("#pml-editor", SCHEMA)
    page.click("#upload")
    page.wait_for_selector('.block[data-path="d2"]')
    classes = [page.get_attribute(f'.block[data-path="{m}"]', "class") for m in ("d1", "d2")]
    assert all("tier-device" in c for c in classes)  # just encoded: on the device tier
    assert "docs" in page.inner_text("#schema-list")

    # Compose, explain, run: streamed text, spans by origin, stats.
    assert page.input_value("#pml-prompt").startswith('<prompt schema="docs"><d1/><d2/>')
    page.click("#explain")
    page.wait_for_function("document.querySelector('#explanation').textContent.includes('cached')")
    page.click("#run")
    page.wait_for_selector("#spans .tier-computed")
    assert page.inner_text("#output").strip()
    spans = page.inner_text("#spans")
    assert "d1" in spans and "device" in spans and "computed now" in spans
    assert "TTFT" in page.inner_text("#stats")
    page.screenshot(path=str(tmp_path / "prompt.png"), full_page=True)

    # A schema with a parameter: its slot is drawn, and the composer passes the argument.
    page.fill("#pml-editor", '<schema name="trip"><module name="plan">Plan a trip of <param name="days" len="3"/> days.'
                             '</module></schema>')
    page.click("#upload")
    page.wait_for_selector('.block.param[data-param="plan.days"]')
    page.fill('.param-value[data-param="days"]', "5")
    assert page.input_value("#pml-prompt").startswith('<prompt schema="trip"><plan days="5"/>')
    page.click("#run")
    page.wait_for_function("document.querySelector('#stats').textContent.includes('TTFT')")
    assert "trip" in page.inner_text("#layout-name")

    # Two chat turns: the second reports reused tokens.
    page.click("nav button[data-tab=chat]")
    for text in ("Hello there, tell me about cats and their long naps.", "And dogs?"):
        before = page.locator("#chat-log .reuse").count()
        page.fill("#chat-input", text)
        page.click("#chat-send")
        page.wait_for_function(f"document.querySelectorAll('#chat-log .reuse').length > {before}")
    notes = page.locator("#chat-log .reuse").all_inner_texts()
    assert notes[0].startswith("turn 1: 0 of") and not notes[1].startswith("turn 2: 0 of")
    page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
    page.click("nav button[data-tab=schemas]")
    page.wait_for_function("document.querySelectorAll('#metrics tr').length > 2")
    DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    if not DOCS_IMG.exists():
        shutil.copy(tmp_path / "playground.png", DOCS_IMG)
