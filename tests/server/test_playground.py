"""The web playground in a real browser (headless Debian chromium driven by Playwright): load the page,
upload a schema and see its layout (scaffolds drawn, nested modules coloured by tier), run a prompt and
see streamed text and the prompt drawn as spans by origin (their text is the prompt the tokenizer
decodes; a repeat shows prefix blocks), see a bad PML error at its line, run two chat turns with reuse
reported; plus the page's HTTP contract. The default model's run is the README's screenshot."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch

from tests.model_factories import make_tiny_loaded
from tests.server.conftest import LiveServer, settings_for
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


def test_every_playground_file_is_sent_with_csp_nosniff_and_no_framing(live_server):
    server = live_server()
    for path in ("/playground/", "/playground/static/app.js", "/playground/static/style.css"):
        headers = httpx.get(server.url + path, timeout=30).headers
        policy = dict(part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";"))
        assert policy["frame-ancestors"] == "'none'" and policy["script-src"] == "'self'", policy
        assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"


@pytest.fixture
def browser_page():
    playwright_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        refused: list[str] = []  # the browser reports what the page's CSP blocked on the console
        page.on("console", lambda message: refused.append(message.text)
                if "Content Security Policy" in message.text else None)
        yield page
        browser.close()
        assert not refused, refused


NESTED_SCHEMA = ('<schema name="nest"><module name="outer">Cats are curious.<module name="inner"> Kittens nap a lot.'
                 '</module></module></schema>')


def _spans(page) -> list[tuple[str, str]]:
    """(origin, text) of each span drawn in the run's prompt view, in order."""
    return page.eval_on_selector_all("#spans span", "els => els.map(e => [e.dataset.origin, e.textContent])")


def _prompt_text(server, prompt: str) -> str:
    """The oracle: the prompt's tokens, as the server plans them, decoded by the model's tokenizer in one go."""
    service = server.app.state.service
    return service.runtime.model.loaded.tokenizer.decode(service.plan(prompt).token_ids())


def _run(page) -> list[tuple[str, str]]:
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#stats').textContent.includes('TTFT')")
    return _spans(page)


@pytest.mark.timeout(240)
def test_playground_in_a_real_browser(live_server, browser_page, tmp_path):
    server = live_server(prefix_block_size=8)
    page = browser_page
    page.goto(server.url + "/playground/")
    page.fill("#api-key", "unused")

    # A bad schema: the error names its line, and the editor selects that line.
    page.fill("#pml-editor", '<schema name="bad">\n  <module name="x">ok</module>\n  <module>no name</module>\n</schema>')  # noqa: E501 (PML text: whitespace matters)
    page.click("#upload")
    page.wait_for_selector("#upload-error:not([hidden])")
    assert "line 3" in page.inner_text("#upload-error")
    assert page.get_attribute("#upload-error", "data-line") == "3"

    # Upload, layout drawn with one block per module, coloured by tier, and the scaffold under them.
    page.fill("#pml-editor", SCHEMA)
    page.click("#upload")
    page.wait_for_selector('.block[data-path="d2"]')
    classes = [page.get_attribute(f'.block[data-path="{m}"]', "class") for m in ("d1", "d2")]
    assert all("tier-device" in c for c in classes)  # just encoded: on the device tier
    scaffold = page.locator('.block.scaffold[data-scaffold="d1 d2"]')
    assert "d1 + d2" in scaffold.inner_text() and "tier-device" in scaffold.get_attribute("class")
    box, d1, d2 = (page.locator(sel).bounding_box() for sel in (
        '.block.scaffold', '.block[data-path="d1"]', '.block[data-path="d2"]'))
    assert box["y"] > d1["y"] and abs(box["x"] - d1["x"]) < 2
    assert abs(box["x"] + box["width"] - d2["x"] - d2["width"]) < 2
    assert "docs" in page.inner_text("#schema-list")
    info = httpx.get(server.url + "/v1/schemas/docs", headers={"Authorization": "Bearer unused"}).json()
    always = page.locator(".block.always")  # the text every prompt includes, drawn to scale beside the modules
    assert always.count() == len(info["always_included"]) >= 1
    first = min(info["always_included"])
    assert page.get_attribute(".block.always", "data-always") == f"{first[0]}-{first[1]}"

    # Compose, explain, run: streamed text, the prompt drawn as spans by origin whose text is the prompt's.
    prompt = page.input_value("#pml-prompt")  # a chat turn: the modules of the user section, the question, an open turn
    assert prompt.startswith('<prompt schema="docs"><user><d1/><d2/>')
    assert prompt.endswith("</user><assistant/></prompt>")
    page.click("#explain")
    page.wait_for_function("() => document.querySelector('#explanation').textContent.includes('cached')")
    spans = _run(page)
    assert page.inner_text("#output").strip()
    assert "".join(text for _, text in spans) == _prompt_text(server, prompt)
    assert {origin for origin, _ in spans} == {"module", "computed"}
    assert page.locator('#spans span[data-module="d1"].tier-device').count() == 1
    assert "module from device" in page.inner_text("#span-legend") and "computed now" in page.inner_text("#span-legend")
    assert "TTFT" in page.inner_text("#stats") and "tokens/s" in page.inner_text("#stats")
    assert "layout positions" in page.inner_text("#stats")  # d1 d2 in their scaffold: exact, nothing moved
    # The same prompt again: its new text now comes from prefix blocks.
    again = _run(page)
    assert "".join(text for _, text in again) == _prompt_text(server, prompt)
    assert "prefix" in {origin for origin, _ in again}
    assert page.locator("#spans span.tier-prefix").count() >= 1
    page.screenshot(path=str(tmp_path / "prompt.png"), full_page=True)

    # A nested module: coloured by its tier, imported inside its parent, its spans named by its path.
    page.fill("#pml-editor", NESTED_SCHEMA)
    page.click("#upload")
    page.wait_for_selector('.block[data-path="outer.inner"]')
    assert "tier-device" in page.get_attribute('.block[data-path="outer.inner"]', "class")
    page.check('#module-picks input[value="outer.inner"]')
    prompt = page.input_value("#pml-prompt")
    assert prompt.startswith('<prompt schema="nest"><outer><inner/></outer>')
    spans = _run(page)
    assert "".join(text for _, text in spans) == _prompt_text(server, prompt)
    assert page.locator('#spans span[data-module="outer.inner"][data-origin="module"]').count() == 1

    # A schema with a parameter: its slot is drawn, and the composer passes the argument.
    page.fill("#pml-editor", '<schema name="trip"><module name="plan">Plan a trip of <param name="days" len="3"/> days.'
                             '</module></schema>')
    page.click("#upload")
    page.wait_for_selector('.block.param[data-param="plan.days"]')
    page.fill('.param-value[data-param="days"]', "5")
    assert page.input_value("#pml-prompt").startswith('<prompt schema="trip"><plan days="5"/>')
    spans = _run(page)
    assert "trip" in page.inner_text("#layout-name")
    assert page.locator('#spans span[data-module="plan"][data-origin="computed"]').count() == 1  # the argument

    # Two chat turns: the second reports reused tokens.
    page.click("nav button[data-tab=chat]")
    for text in ("Hello there, tell me about cats and their long naps.", "And dogs?"):
        before = page.locator("#chat-log .reuse").count()
        page.fill("#chat-input", text)
        page.click("#chat-send")
        page.wait_for_function(f"() => document.querySelectorAll('#chat-log .reuse').length > {before}")
    notes = page.locator("#chat-log .reuse").all_inner_texts()
    assert notes[0].startswith("turn 1: 0 of") and not notes[1].startswith("turn 2: 0 of")
    page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
    page.click("nav button[data-tab=schemas]")
    page.wait_for_function("() => document.querySelectorAll('#metrics tr').length > 2")
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)


def _always_eos(loaded):
    """The tiny model, made to end every answer at once: its LM head puts all the mass on end-of-sequence."""
    eos = loaded.tokenizer.eos_token_id

    def only_eos(module, inputs, logits):
        forced = torch.full_like(logits, -1e4)
        forced[..., eos] = 0.0
        return forced

    loaded.model.get_output_embeddings().register_forward_hook(only_eos)
    return loaded


@pytest.mark.timeout(240)
def test_a_run_that_generates_nothing_shows_a_hint(live_server, browser_page):
    server = live_server(loader=lambda: _always_eos(make_tiny_loaded("llama")))
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    page = browser_page
    page.goto(server.url + "/playground/")
    page.wait_for_selector('.block[data-path="d2"]')
    _run(page)
    assert page.inner_text("#output").strip() == ""
    hint = page.locator("#output-hint")
    assert hint.is_visible() and "generated no text" in hint.inner_text() and "finish reason: stop" in hint.inner_text()
    assert "<assistant/>" not in hint.inner_text()  # the composed prompt has its open turn: no advice about it
    # A prompt without an open assistant turn: the hint says how to ask.
    page.fill("#pml-prompt", '<prompt schema="docs"><d1/>Who sleeps?</prompt>')
    _run(page)
    assert hint.is_visible() and "<user>…</user>" in hint.inner_text() and "<assistant/>" in hint.inner_text()


@pytest.mark.timeout(240)
def test_typing_the_api_key_reloads_the_schemas_and_clears_the_401(live_server, browser_page):
    server = live_server(api_keys=["sk-play"])
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, headers={"Authorization": "Bearer sk-play"},
               timeout=60).raise_for_status()
    page = browser_page
    page.goto(server.url + "/playground/")
    error = page.locator("#schema-error")
    error.wait_for(state="visible")
    assert "API key" in error.inner_text() and page.locator("#schema-list li").count() == 0
    page.fill("#api-key", "sk-play")
    page.wait_for_selector('.block[data-path="d2"]')  # the list reloaded and its first schema is drawn
    assert "docs" in page.inner_text("#schema-list") and error.is_hidden()
    assert page.evaluate("() => sessionStorage.getItem('promptcache-api-key')") == "sk-play"


@pytest.mark.timeout(600)
def test_the_first_run_on_the_preloaded_library_answers(smollm2, browser_page):
    """A new user's first click: the default model, the preloaded examples, the composer's defaults."""
    server = LiveServer(settings_for(preload_examples=True, fidelity="exact"), lambda: smollm2).start()
    try:
        page = browser_page
        page.goto(server.url + "/playground/")
        page.wait_for_selector('.block[data-path="doc-honey"]')
        assert page.input_value("#pml-prompt") == (
            '<prompt schema="library"><user><doc-amazon/><doc-everest/><doc-honey/>'
            "Into which ocean does the Amazon flow?</user><assistant/></prompt>")
        _run(page)
        assert "Atlantic" in page.inner_text("#output") and page.locator("#output-hint").is_hidden()
        # trip-planner: one member of its union ticked (two would be refused), a question for it.
        page.click("#schema-list button.schema-open >> text=trip-planner")
        page.wait_for_selector('.block[data-path="paris"]')
        ticked = page.eval_on_selector_all("#module-picks input[type=checkbox]:checked", "els => els.map(e => e.value)")
        assert ticked == ["trip-plan", "miami"]
        page.fill('.param-value[data-param="duration"]', "3")
        assert page.input_value("#pml-prompt") == (
            '<prompt schema="trip-planner"><user><trip-plan duration="3"/><miami/>'
            "Plan the days and highlight the food.</user><assistant/></prompt>")
        _run(page)
        assert page.inner_text("#output").strip() and page.locator("#output-hint").is_hidden()
    finally:
        server.stop()


PETS_SCHEMA = """<schema name="pets">
  <system>You answer questions about pets in one short sentence.</system>
  <user>
    <module name="cats">Cats sleep twelve to sixteen hours a day.<module name="kittens"> Kittens sleep even more, up to twenty hours.</module></module>
    <module name="dogs"> Dogs sleep about twelve hours a day.</module>
    <module name="fish"> Fish rest without closing their eyes.</module>
  </user>
  <scaffold modules="cats dogs"/>
</schema>"""  # noqa: E501 (PML text: whitespace matters)
PETS_PROMPT = '<prompt schema="pets"><user><cats><kittens/></cats><dogs/>How long do kittens sleep?{}</user><assistant/></prompt>'  # noqa: E501 (PML text: whitespace matters)


@pytest.mark.timeout(600)
def test_default_model_in_a_real_browser_for_the_readme(smollm2, browser_page, tmp_path):
    """SmolLM2 with its own tokenizer and chat template, exact fidelity: the spans' text is the prompt it
    decodes; a follow-up question reuses the first one's computed tokens (dogs, recomputed in context, and
    the question) from prefix blocks. Its screenshot is the README's."""
    server = LiveServer(settings_for(prefix_block_size=16), lambda: smollm2).start()
    try:
        page = browser_page
        page.goto(server.url + "/playground/")
        page.fill("#pml-editor", PETS_SCHEMA)
        page.click("#upload")
        page.wait_for_selector('.block.scaffold[data-scaffold="cats dogs"]')
        page.wait_for_selector('.block.tier-device[data-path="cats.kittens"]')
        page.select_option("#fidelity", "exact")  # dogs after kittens is out of context: computed, then reused
        page.check('#module-picks input[value="cats.kittens"]')
        page.uncheck('#module-picks input[value="fish"]')
        page.fill("#free-text", "")
        for question in ("", " Answer in one sentence."):
            prompt = PETS_PROMPT.format(question)
            page.fill("#pml-prompt", prompt)
            spans = _run(page)
            assert "".join(text for _, text in spans) == _prompt_text(server, prompt)
        assert {origin for origin, _ in spans} == {"module", "prefix", "computed"}
        assert page.locator('#spans span[data-origin="prefix"][data-module="dogs"]').count() == 1
        page.wait_for_function("() => document.querySelector('#metrics').textContent.includes('%')")
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        if not DOCS_IMG.exists():
            DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tmp_path / "playground.png", DOCS_IMG)
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_the_fidelity_panel_shows_the_schemas_report(live_server, browser_page):
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    page = browser_page
    page.goto(server.url + "/playground/")
    page.wait_for_selector('.block[data-path="d2"]')
    page.fill("#fidelity-samples", "3")
    page.fill("#free-text", "Who sleeps?")
    page.click("#fidelity-run")
    page.wait_for_selector("#fidelity-table tr[data-mode=fast]")
    # The report the page asked for, from the server's cache: the panel shows its numbers.
    report = httpx.get(server.url + "/v1/schemas/docs/fidelity", params={"num_samples": 3, "question": "Who sleeps?"},
                       timeout=60).json()
    assert report["cached"]
    for mode, stats in report["modes"].items():
        cells = page.eval_on_selector_all(f"#fidelity-table tr[data-mode={mode}] td",
                                          "els => els.map(e => e.textContent)")
        low, high = stats["agreement_ci95"]
        assert cells == [mode, f"{100 * stats['top1_agreement']:.0f}%", f"{100 * low:.0f}%-{100 * high:.0f}%",
                         f"{stats['mean_kl']:.4f}", f"{stats['max_kl']:.4f}", str(stats["num_samples"])]
    assert "computed in" in page.inner_text("#fidelity-status")
    assert page.locator("#fidelity-samples-list li").count() == report["num_samples"]
    page.click("#fidelity-run")
    page.wait_for_function("() => document.querySelector('#fidelity-status').textContent.includes('report cache')")
