"""Prompts shaped as the Prompt Cache reference implementation's README and demo write them, over the real
server with the default SmolLM2 model: each answers non-empty text, because the server opens the
assistant turn after a last user turn (or imports, or text) as the chat template does, and says so on
every route. The schemas are written here in the reference's dialect (they are not its files)."""

from __future__ import annotations

import httpx
import pytest
import torch

from promptcache.clients import Client
from promptcache.model_runtime.baseline import full_prefill_logits
from tests.server.conftest import LiveServer, settings_for

GAME = """<schema name="code-generation-game">
    <system>
        You are a programming assistant. Read the source files, then follow the instruction.
    </system>
    <user>
        Please read the given source files.
    <module name="grid.py">
class Grid:
    def __init__(self, size):
        self.size = size

    def inside(self, position):
        return (0 <= position[0] < self.size and
                0 <= position[1] < self.size)
    </module>
    <module name="unit.py">
class Unit:
    def __init__(self, name, position):
        self.name = name
        self.position = position
    </module>
    </user>
    <assistant>
        I have read the source files. Give me the instruction.
    </assistant>
</schema>"""
PERSONA = """<schema name="persona">
    <system>You are role-playing a character described by the user.</system>
    <user>
        Create a character with these traits.
        <module name="age">
            <union scaffold="default">
                <module name="default"></module>
                <module name="young-adult">The character is between 20 and 34 years old.</module>
                <module name="senior">The character is over 65 years old.</module>
            </union>
        </module>
        <module name="residence">
            <union scaffold="default">
                <module name="default"></module>
                <module name="seaside">The character lives in a town by the sea.</module>
            </union>
        </module>
    </user>
    <assistant>I have created the character. Ask me anything.</assistant>
</schema>"""
LAB = """<schema name="default">
    <module name="preface">
        Just some text with parameter:
        <parameter name="param-name" length="5" scaffold="[to be filled later]"/>
        <module name="nested">Nested</module>
        <system>
            <union scaffold="system1">
                <module name="system1">You control a robot arm.</module>
                <module name="system2" cache="false">You control a rover.</module>
            </union>
        </system>
    </module>
    <module name="task">
        <union>
            <module name="task-robot-control">The robot moves at speed <parameter name="speed" length="5"/></module>
            <module name="task-random">Pick any task.</module>
        </union>
    </module>
</schema>"""
MBTI = """<schema name="mbti">
    <system>You are a helpful assistant.</system>
    <user>
        Create a character based on MBTI. This character has:
        <union scaffold="EI">
            <module name="EI"> </module>
            <module name="E">E (energized by social interactions)</module>
            <module name="I">I (energized by solitude)</module>
        </union>
        <union scaffold="TF">
            <module name="TF"> </module>
            <module name="T">T (decides with logic)</module>
            <module name="F">F (decides with feelings)</module>
        </union>
    </user>
    <assistant>A character named Alex is created. Ask anything about him.</assistant>
</schema>"""
PROMPTS = {
    "readme-demo": """<prompt schema='code-generation-game'>
    <grid.py/>
    <unit.py/>
    <user>Create a main entry for the game:</user>
</prompt>""",
    "demo.py": """
        <prompt schema='code-generation-game'>
        <grid.py/>
        <unit.py/>
        <user>
            Create a main entry for the game:
        </user>
        </prompt>
        """.strip(),
    "readme-persona": """<prompt schema='persona'>
    <age>
        <young-adult/>
    </age>
    <residence>
        <seaside/>
    </residence>
    <user>
        Introduce about yourself.
    </user>
</prompt>""",
    "readme-default": """<prompt schema="default">
    <preface param-name="test">
        <!-- Only subset of modules can be selected -->
        <nested/>
        <system1/>
    </preface>
    <task>
        <task-robot-control speed="fast"/>
    </task>
    <user>What will be the next movement of the robot?</user>
    <assistant>It will move forward.</assistant>
    <user>What would be the speed then?</user>
</prompt>""",
    "prompt-mbti": '<prompt schema="mbti">\n    <E/><T/>\n</prompt>',
}
DOC = """<schema name="doc">
    <system>You are a helpful assistant. Answer in one short sentence.</system>
    <user><module name="amazon">The Amazon river flows east across South America into the Atlantic Ocean.</module></user>
</schema>"""  # noqa: E501  (a module's text is whitespace-exact: its line stays whole)
QUESTION = '<prompt schema="doc"><user><amazon/>Into which ocean does the Amazon flow?</user></prompt>'


@pytest.fixture(scope="module")
def server(smollm2):
    live = LiveServer(settings_for(), lambda: smollm2).start()
    for schema in (GAME, PERSONA, LAB, MBTI, DOC):
        response = httpx.post(live.url + "/v1/schemas", json={"pml": schema}, timeout=300)
        assert response.status_code == 201, response.text
    yield live
    live.stop()


def _generate(server, prompt: str, **fields) -> dict:
    response = httpx.post(server.url + "/v1/generate", timeout=300,
                          json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_reference_prompts_answer(server, name):
    body = _generate(server, PROMPTS[name])
    assert body["choices"][0]["text"].strip(), body
    assert body["cache"]["generation_prompt_added"] is True


def test_union_scaffold_import_is_exact_and_explain_says_why_another_member_is_not(server):
    exact = httpx.post(server.url + "/v1/prompts/explain", json={"prompt": '<prompt schema="mbti"><EI/><TF/></prompt>'})
    assert exact.json()["exact"] is True and exact.json()["generation_prompt_added"] is True
    other = httpx.post(server.url + "/v1/prompts/explain", json={"prompt": PROMPTS["prompt-mbti"]}).json()
    assert other["exact"] is False
    assert any("union scaffold member(s) 'EI'" in reason for reason in other["approximations"]), other
    report = _generate(server, PROMPTS["prompt-mbti"])["cache"]
    assert report["exact"] is False and any("'TF'" in reason for reason in report["approximations"])


def test_every_route_opens_the_turn_and_an_open_assistant_turn_is_continued(server):
    native = _generate(server, QUESTION)
    streamed = httpx.post(server.url + "/v1/generate", timeout=300, json={
        "prompt": QUESTION, "max_tokens": 8, "temperature": 0, "stream": True}).text
    assert '"generation_prompt_added":true' in streamed.replace(" ", "")
    completion = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": "m", "prompt": QUESTION, "max_tokens": 8, "temperature": 0}).json()
    assert completion["promptcache"]["generation_prompt_added"] is True
    assert completion["choices"][0]["text"] == native["choices"][0]["text"] != ""
    with Client(server.url, max_retries=0) as client:
        assert client.generate(QUESTION, max_tokens=8, temperature=0).cache.generation_prompt_added
        assert client.explain(QUESTION).generation_prompt_added
        opened = QUESTION.replace("</prompt>", "<assistant/></prompt>")
        explicit = client.generate(opened, max_tokens=8, temperature=0)
        assert not explicit.cache.generation_prompt_added and not client.explain(opened).generation_prompt_added
    # The explicit open turn and the one the server opens are the same tokens: the same answer.
    assert explicit.text == native["choices"][0]["text"] and explicit.usage.prompt_tokens == \
        native["usage"]["prompt_tokens"]


def test_first_token_equals_a_full_prefill_of_the_chat_template_rendering(server, smollm2):
    """Oracle: apply_chat_template(..., add_generation_prompt=True) prefilled by the model itself."""
    body = _generate(server, QUESTION, max_tokens=1, logprobs=1)
    assert body["cache"]["exact"] is True and body["cache"]["generation_prompt_added"] is True
    tokenizer = smollm2.tokenizer
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
                {"role": "user", "content": "The Amazon river flows east across South America into the Atlantic "
                                            "Ocean.Into which ocean does the Amazon flow?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    logits = full_prefill_logits(smollm2.model, ids, list(range(len(ids))))[-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token = int(torch.argmax(logprobs))
    assert body["choices"][0]["logprobs"]["token_ids"] == [token]
    assert abs(body["choices"][0]["logprobs"]["token_logprobs"][0] - float(logprobs[token])) <= 1e-3
