"""`promptcache encode` fills a shared Redis that a server then serves from without encoding."""

from __future__ import annotations

import json
import subprocess
import sys

from promptcache.cache_store import StoreConfig, build_store
from promptcache.model_runtime import ModelConfig, ModelRuntime, load_model
from tests.model_factories import make_test_tokenizer, make_tiny_model

SCHEMA = ('<schema name="cli"><system>Be brief.</system><module name="doc">A document for the CLI test.</module>'
          '</schema>')


def test_encode_cli_writes_kv_to_redis(tmp_path, redis_server):
    tokenizer = make_test_tokenizer()
    make_tiny_model("gpt2", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "cli.pml").write_text(SCHEMA)
    result = subprocess.run([sys.executable, "-m", "promptcache.cli", "encode", str(tmp_path / "cli.pml"),
                             "--model", str(tmp_path / "model"), "--redis-url", redis_server.url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["schema"] == "cli" and report["encoded"] == report["segments"] > 0
    assert "encoding cli" in result.stderr  # the progress bar
    # A fresh runtime over the same Redis finds every segment there: nothing to encode.
    runtime = ModelRuntime(load_model(ModelConfig(str(tmp_path / "model"))),
                           build_store(StoreConfig(redis_url=redis_server.url), device="cpu"))
    again = runtime.add_schema(runtime.parse_schema(SCHEMA))
    assert again.num_encoded == 0
