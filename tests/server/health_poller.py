"""Polls a server's /health from its own process until stdin gets a line, then prints the latencies
(seconds, JSON). A poller inside the test process would share the server's GIL and time itself."""

from __future__ import annotations

import json
import select
import sys
import time

import httpx


def main(url: str) -> None:
    latencies: list[float] = []
    with httpx.Client(timeout=10) as client:
        print("ready", flush=True)
        while not select.select([sys.stdin], [], [], 0)[0]:
            began = time.perf_counter()
            client.get(url + "/health").raise_for_status()
            latencies.append(time.perf_counter() - began)
            time.sleep(0.01)
    print(json.dumps(latencies), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
