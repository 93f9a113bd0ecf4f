"""One replica's view of the scale-out workload, on one server (no Ray): what fills its device tier.

    python -m benchmarks.replica_view [--share 0.3]

Runs `promptcache serve` (default model, bf16 where the CPU has it, one thread) on a fresh Redis with a
device tier of `share` x the workload's KV (benchmarks/scaleout.py's workload and sizing) and a 1 MiB host
tier, uploads the 4 schemas, then sends, one at a time, either every request (what a replica behind a
cache-blind router sees) or the half one affinity replica owns (schemas kb0 and kb1, every other chat
session) — each with the schema uploads' module KV kept in the server's own tiers (`upload_kv_local`
true, the single-server default) and in Redis only (false, the cluster default). Reports the device-tier
hit rate (prompt tokens whose KV came from the device tier, as each response reports) and the device
tier's bytes by kind at the end (`promptcache:cache_usage_by_kind_bytes`). JSON lines under
benchmarks/results/replica_view.jsonl.
"""

from __future__ import annotations

import argparse
import tempfile

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import start_promptcache
from benchmarks.scaleout import KV_VALUES_PER_TOKEN, Call, Client, build_workload
from benchmarks.store import start_redis

OUT = RESULTS / "replica_view.jsonl"


def owned_half(tasks: list[list[Call]]) -> list[list[Call]]:
    """The tasks one of two affinity replicas would own with the schema key: kb0, kb1, every other chat."""
    kept, chats = [], 0
    for task in tasks:
        if task[0].kind == "pml":
            if any(f'schema="kb{s}"' in task[0].body["prompt"] for s in (0, 1)):
                kept.append(task)
        else:
            chats += 1
            if chats % 2:
                kept.append(task)
    return kept


def run(share: float, view: str, upload_kv_local: bool) -> dict:
    schemas, tasks, working_tokens = build_workload(48, 8, 5, 3)
    tasks = owned_half(tasks) if view == "owned" else tasks
    device_bytes = int(share * working_tokens * KV_VALUES_PER_TOKEN * 2)  # bf16
    with tempfile.TemporaryDirectory() as directory:
        redis_process, redis_url = start_redis(directory)
        env = {"PROMPTCACHE_UPLOAD_KV_LOCAL": str(upload_kv_local).lower(), "OMP_NUM_THREADS": "1",
               "PROMPTCACHE_DEVICE_MAX_BYTES": str(device_bytes), "PROMPTCACHE_HOST_MAX_BYTES": str(1 << 20)}
        server, url = start_promptcache(["--redis-url", redis_url, "--dtype", "bfloat16"], env=env)
        try:
            client = Client(url)
            for pml in schemas:
                client.http.post(url + "/v1/schemas", json={"pml": pml}).raise_for_status()
            samples = [s for task in tasks for s in client.run_task(task)]
            families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
            by_kind = next(f for f in families if f.name == "promptcache:cache_usage_by_kind_bytes")
        finally:
            server.terminate()
            server.wait(timeout=30)
            redis_process.kill()
    device = {s.labels["kind"]: int(s.value) for s in by_kind.samples if s.labels["tier"] == "device"}
    prompt_tokens = sum(s.prompt_tokens for s in samples)
    record = {"bench": "replica_view", "share": share, "view": view, "upload_kv_local": upload_kv_local,
              "num_requests": len(samples), "device_max_bytes": device_bytes,
              "device_hit_rate": round(sum(s.device_tokens for s in samples) / prompt_tokens, 4),
              "redis_rate": round(sum(s.redis_tokens for s in samples) / prompt_tokens, 4),
              "device_module_bytes": device.get("module", 0), "device_prefix_bytes": device.get("prefix", 0)}
    emit(record, OUT)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--share", type=float, default=0.3)
    args = parser.parse_args()
    for upload_kv_local in (True, False):
        for view in ("owned", "all"):
            record = run(args.share, view, upload_kv_local)
            log(f"{view} upload_kv_local={upload_kv_local}: hit rate {record['device_hit_rate']}, device tier "
                f"{record['device_module_bytes'] / 2**20:.0f} MiB module / {record['device_prefix_bytes'] / 2**20:.0f} MiB prefix")


if __name__ == "__main__":
    main()
