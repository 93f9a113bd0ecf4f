"""The server loads its model on a thread that is gone once it serves (no OpenMP team of the loader's
outlives it) and confines the event loop's thread: torch's parallel work is the engine thread's."""

from __future__ import annotations

import threading

import httpx
import torch

from tests.model_factories import make_tiny_loaded


def test_model_loads_on_a_passing_thread_with_every_intraop_thread(live_server):
    seen: dict[str, object] = {}

    def loader():
        seen["thread"], seen["num_threads"] = threading.current_thread(), torch.get_num_threads()
        return make_tiny_loaded("llama")

    server = live_server(loader=loader)
    fresh: list[int] = []
    probe = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    assert seen["num_threads"] == fresh[0]  # not confined: loading uses every core
    loader_thread = seen["thread"]
    assert isinstance(loader_thread, threading.Thread)
    loader_thread.join(5)
    assert not loader_thread.is_alive()
    assert loader_thread is not server.thread
    body = {"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
