"""Scale-out benchmark: 2 local Ray Serve replicas of the default model on one Redis, cache-affinity
routing against Ray's default (power-of-two-choices) router, in the same run.

    python -m benchmarks.scaleout [--prompts-per-schema 48] [--sessions 8] [--concurrency 2] [--fidelity fast]

Workload (the same requests, in the same order, for every router): 4 PML schemas of 4 modules each
(~600 tokens a module: 3 generated documents); each prompt imports 2 of its schema's modules (6 module
sets per schema, ~1.3K-token prompts) and asks a new question; plus chat sessions of 5 turns opening with
a ~600-token text (each turn's history includes the replies the server sent). Server defaults otherwise:
fidelity `exact` (module KV where its context is exact, i.e. a prompt's first module; prefix blocks for the
rest) unless `--fidelity` sends another with every PML prompt (`fast`: every module reused as encoded, the
module-caching workload). Routers: `default` (Ray's), `affinity` (the default load guard and balance
bound), `affinity_schema` (PML keyed on the schema alone: a schema's modules and the prefix chains built
on them on one replica), `affinity_eager_spill` (the guard at abs 0 / rel 1: the key's replica unless
another is less loaded). Each gets a fresh application (empty device tiers) and a flushed
Redis; every replica has 1 CPU (torch threads 1), a device tier that holds a given share of the workload's
KV (`--device-shares`, computed in the replicas' dtype) and a 1 MiB host tier that no block fits (on a CPU
the host tier is the same memory as the device tier): what a replica's device tier lacks comes from Redis
or is recomputed. With a share s per replica, routing that ignores the cache hits about s (every replica
sees the whole working set) and affinity about min(1, N*s) (each replica sees the 1/N it owns): the ratio
is about N for s <= 1/N and falls towards 1 as s nears 1 (both less the first use of every key). TTFT is
the client's: from sending a streamed request to its first token, over HTTP through Ray's proxy and the
gateway. The device-tier hit rate is prompt tokens whose KV came from the serving replica's device tier
(modules and prefix blocks, as each response reports) over all prompt tokens. Targets (affinity vs
default): hit rate >= 1.8x, p50 TTFT <= 0.6x, max/mean requests per replica <= 1.3. Before that, the
routing simulator (same policy code, no model) runs 16 and 64 replicas on a Zipf schema popularity. JSON
lines and a PNG under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import redis
import torch

from benchmarks.evalset.data import FACTS, make_documents
from benchmarks.harness import RESULTS, emit, log
from benchmarks.live_server import RedisServer, free_port, stream_completion
from promptcache.cluster.simulator import POLICIES, SimulationConfig, simulate
from promptcache.model_runtime import ModelConfig

OUT = RESULTS / "scaleout.jsonl"
NUM_SCHEMAS, DOCS_PER_SCHEMA, DOCS_PER_PROMPT = 4, 4, 2
KV_VALUES_PER_TOKEN = 2 * 30 * 3 * 64  # SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64
SYSTEM = "You are a helpful assistant. Answer the question with a short phrase, using only the documents."
CHAT_SYSTEM = ("You are a friendly travel guide for a region of small towns. Keep every answer short and "
               "concrete, and mention the town by name.")
# Router variants: Ray's default; cache affinity with the default load guard; cache affinity whose guard
# spills as soon as the owner is busier than another replica (abs 0, rel 1: least loaded, ties by affinity).
ROUTERS = {"default": {"router": "default"}, "affinity": {"router": "affinity"},
           "affinity_schema": {"router": "affinity", "pml_key": "schema"},
           "affinity_eager_spill": {"router": "affinity", "abs_threshold": 0, "rel_threshold": 1.0}}
CHAT_TURNS = ["Which dish should I try there?", "Who could I ask about the history?", "What river is nearby?",
              "Is it worth a second day?", "Thank you. What should I pack?"]


@dataclass(frozen=True)
class Call:
    path: str
    body: dict
    kind: str  # pml | chat


@dataclass
class Sample:
    kind: str
    ttft_ms: float
    replica: str
    prompt_tokens: int
    device_tokens: int
    redis_tokens: int

    @property
    def source(self) -> str:
        """Where the prompt's KV came from: device or redis (at least half of it), mixed (from both, neither
        half), computed (most of it)."""
        if self.device_tokens >= 0.5 * self.prompt_tokens:
            return "device"
        if self.redis_tokens >= 0.5 * self.prompt_tokens:
            return "redis"
        return "mixed" if self.device_tokens + self.redis_tokens >= 0.5 * self.prompt_tokens else "computed"


def build_workload(prompts_per_schema: int, num_sessions: int, num_turns: int, docs_per_module: int,
                   seed: int = 0, fidelity: str | None = None) -> tuple[list[str], list[list[Call]], int]:
    """(schemas, tasks, estimated working-set tokens). A task is a list of calls one client runs in order
    (a chat session's turns depend on the replies before them); PML calls carry `fidelity` when given. The
    working set (~5 characters a token) is what a replica serving everything would keep: every session's
    history, plus for PML under `exact` (the server default) the prompt tokens of every distinct module
    set (a prompt's first module as encoded, the rest as prefix blocks after it), under `fast`/`balanced`
    every module once (each reused as encoded wherever it sits)."""
    rng = random.Random(seed)
    docs = make_documents((NUM_SCHEMAS * DOCS_PER_SCHEMA + num_sessions) * docs_per_module, seed)
    texts = [" ".join(d.text for d in docs[i:i + docs_per_module]) for i in range(0, len(docs), docs_per_module)]
    towns = [docs[i].town for i in range(0, len(docs), docs_per_module)]
    schemas, tasks, working_chars = [], [], 0
    for s in range(NUM_SCHEMAS):
        mine = range(s * DOCS_PER_SCHEMA, (s + 1) * DOCS_PER_SCHEMA)
        modules = "".join(f'<module name="doc{i}">{texts[i]}</module>' for i in mine)
        schemas.append(f'<schema name="kb{s}"><system>{SYSTEM}</system><user>{modules}</user></schema>')
        pairs = list(itertools.combinations(mine, DOCS_PER_PROMPT))
        if fidelity in (None, "exact"):
            working_chars += sum(len(SYSTEM) + sum(len(texts[i]) for i in pair) for pair in pairs)
        else:
            working_chars += len(SYSTEM) + sum(len(texts[i]) for i in mine)
        for n in range(prompts_per_schema):
            chosen = pairs[n % len(pairs)]
            _, _, question = rng.choice(FACTS)
            imports = "".join(f"<doc{i}/>" for i in chosen)
            prompt = (f'<prompt schema="kb{s}"><user>{imports}{question.format(town=towns[rng.choice(chosen)])} '
                      f"(case {rng.randrange(10**6)})</user><assistant/></prompt>")
            body = {"prompt": prompt, "max_tokens": 8} | ({"fidelity": fidelity} if fidelity else {})
            tasks.append([Call("/v1/generate", body, "pml")])
    for k in range(num_sessions):
        index = NUM_SCHEMAS * DOCS_PER_SCHEMA + k
        opening = f"I am planning a visit to {towns[index]}. Here is what I know: {texts[index]}"
        turns = [opening, *CHAT_TURNS[:num_turns - 1]]
        working_chars += len(CHAT_SYSTEM) + sum(len(t) + 80 for t in turns)  # + the replies
        tasks.append([Call("/v1/chat/completions", {"turn": t}, "chat") for t in turns])
    rng.shuffle(tasks)
    return schemas, tasks, working_chars // 5


class Client:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(timeout=600)

    def stream(self, path: str, body: dict, kind: str) -> tuple[Sample, str]:
        streamed = stream_completion(self.http, self.url + path, {**body, "temperature": 0})
        replica, text, final = streamed.headers.get("x-promptcache-replica", "?"), streamed.text, streamed.final
        report = final.get("cache") or final.get("promptcache") or {}
        tiers = dict.fromkeys(("device", "redis"), 0)
        for module in report.get("modules") or []:
            if module.get("tier") in tiers:
                tiers[module["tier"]] += module["num_tokens"]
        for tier, num_tokens in ((report.get("prefix") or {}).get("tiers") or {}).items():
            if tier in tiers:
                tiers[tier] += num_tokens
        sample = Sample(kind, streamed.ttft_ms, replica,
                        final.get("usage", {}).get("prompt_tokens", 0), tiers["device"], tiers["redis"])
        return sample, text

    def run_task(self, task: list[Call]) -> list[Sample]:
        samples, messages = [], [{"role": "system", "content": CHAT_SYSTEM}]
        for call in task:
            if call.kind == "chat":
                messages.append({"role": "user", "content": call.body["turn"]})
                sample, reply = self.stream(call.path, {"model": "m", "messages": messages, "max_tokens": 16}, "chat")
                messages.append({"role": "assistant", "content": reply})
            else:
                sample, _ = self.stream(call.path, call.body, call.kind)
            samples.append(sample)
        return samples


def run_router(router: str, url: str, settings: dict, schemas: list[str], tasks: list, concurrency: int,
               redis_url: str, device_share: float, out: Path = OUT, fidelity: str | None = None) -> dict:
    from ray import serve

    from promptcache.cluster import ClusterOptions
    from promptcache.cluster.app import build_application

    redis.Redis.from_url(redis_url).flushall()
    options = ClusterOptions(num_replicas=2, num_cpus_per_replica=1, **ROUTERS[router])
    started = time.perf_counter()
    serve.run(build_application(settings, options), name=f"scaleout-{router.replace('_', '-')}", route_prefix="/")
    log(f"{router}: application up in {time.perf_counter() - started:.0f} s")
    client = Client(url)
    for pml in schemas:
        response = client.http.post(url + "/v1/schemas", json={"pml": pml})
        if response.status_code != 201:
            raise RuntimeError(f"schema upload: {response.status_code} {response.text[:300]}")
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        samples = [s for task_samples in pool.map(client.run_task, tasks) for s in task_samples]
    elapsed = time.perf_counter() - started
    serve.delete(f"scaleout-{router.replace('_', '-')}")
    per_replica = {r: sum(1 for s in samples if s.replica == r) for r in sorted({s.replica for s in samples})}
    ttfts = [s.ttft_ms for s in samples]
    summary = {
        "bench": "scaleout", "router": router, "options": ROUTERS[router], "device_share": device_share,
        "dtype": settings["dtype"], "concurrency": concurrency, "pml_fidelity": fidelity or "server default",
        "num_requests": len(samples),
        "elapsed_s": round(elapsed, 1),
        "device_hit_rate": round(sum(s.device_tokens for s in samples) / sum(s.prompt_tokens for s in samples), 4),
        "p50_ttft_ms": round(statistics.median(ttfts), 1),
        "p90_ttft_ms": round(statistics.quantiles(ttfts, n=10)[8], 1),
        "requests_per_replica": per_replica,
        "max_over_mean_requests": round(max(per_replica.values()) / statistics.mean(per_replica.values()), 3),
        "by_kind": {kind: {"n": len(group), "p50_ttft_ms": round(statistics.median(s.ttft_ms for s in group), 1),
                           "device_hit_rate": round(sum(s.device_tokens for s in group)
                                                    / max(1, sum(s.prompt_tokens for s in group)), 4)}
                    for kind in ("pml", "chat") for group in [[s for s in samples if s.kind == kind]] if group},
        # Requests by where most of their prompt's KV came from: what a device miss costs here.
        "by_source": {source: {"n": len(group), "p50_ttft_ms": round(statistics.median(s.ttft_ms for s in group), 1)}
                      for source in ("device", "redis", "mixed", "computed")
                      for group in [[s for s in samples if s.source == source]] if group},
    }
    emit(summary, out)
    return summary


def run_simulator(out: Path = OUT) -> list[dict]:
    records = []
    for num_replicas in (16, 64):
        config = SimulationConfig(num_replicas=num_replicas)
        for policy in POLICIES:
            record = {"bench": "scaleout_sim", **asdict(simulate(config, policy)), "config": asdict(config)}
            emit(record, out)
            records.append(record)
    return records


def draw(runs: dict[float, dict[str, dict]], simulated: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = list(runs)
    routers = list(next(iter(runs.values())))
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    colors = dict(zip(ROUTERS, ["#999999", "#2a7ab9", "#1b9e77", "#7fb3d9"]))
    width = 0.8 / len(routers)
    for ax, metric, title in [(axes[0], "device_hit_rate", "device-tier hit rate"),
                              (axes[1], "p50_ttft_ms", "p50 TTFT (ms, client)")]:
        for i, router in enumerate(routers):
            ax.bar([j + i * width for j in range(len(shares))], [runs[share][router][metric] for share in shares],
                   width, label=router, color=colors[router])
        ax.set_xticks([j + width * (len(routers) - 1) / 2 for j in range(len(shares))],
                      [f"device tier {share:.0%}\nof working set" for share in shares], fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    for i, router in enumerate(routers):
        counts = list(runs[shares[0]][router]["requests_per_replica"].values())
        axes[2].bar([j + i * width for j in range(len(counts))], counts, width, label=router, color=colors[router])
    axes[2].set_title(f"requests per replica (device tier {shares[0]:.0%})")
    axes[2].set_xticks([j + width * (len(routers) - 1) / 2 for j in range(2)], ["replica 1", "replica 2"])
    for policy, marker in zip(POLICIES, "o^sd"):
        rows = [r for r in simulated if r["policy"] == policy]
        axes[3].plot([r["num_replicas"] for r in rows], [r["device_hit_rate"] for r in rows], marker=marker,
                     label=policy)
    axes[3].set_title("simulated hit rate (Zipf schemas)")
    axes[3].set_xlabel("replicas")
    axes[3].set_xscale("log", base=2)
    axes[3].legend(fontsize=8)
    fig.suptitle("2 Ray Serve replicas of SmolLM2-135M, 1 CPU each, one Redis: affinity vs Ray's default router")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def replot(out: Path) -> None:
    """Redraw from `out`: the application runs already there, the simulator run again (it is cheap)."""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kept = [r for r in rows if r["bench"] != "scaleout_sim"]
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    simulated = run_simulator(out)
    runs: dict[float, dict[str, dict]] = {}
    for row in kept:
        if row["bench"] == "scaleout":
            runs.setdefault(row["device_share"], {})[row["router"]] = row
    draw(runs, simulated, out.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-per-schema", type=int, default=48)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--docs-per-module", type=int, default=3, help="~200-token documents joined per module")
    parser.add_argument("--device-shares", type=float, nargs="+", default=[0.4, 0.55],
                        help="each replica's device tier, as shares of the workload's KV (one run of every "
                             "router per share)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the replicas' dtype (auto: what `promptcache serve` picks here); sizes the tiers")
    parser.add_argument("--fidelity", choices=["fast", "balanced", "exact"],
                        help="sent with every PML prompt (default: none, the server's `exact`); sizes the working set")
    parser.add_argument("--routers", nargs="+", choices=list(ROUTERS), default=list(ROUTERS))
    parser.add_argument("--out", type=Path, default=OUT, help="JSON lines (and the PNG beside them)")
    parser.add_argument("--replot", action="store_true",
                        help="only run the simulator again and redraw the PNG from the results file")
    args = parser.parse_args()
    if args.replot:
        replot(args.out)
        return

    import ray
    from ray import serve

    simulated = run_simulator(args.out)
    schemas, tasks, working_tokens = build_workload(args.prompts_per_schema, args.sessions, args.turns,
                                                    args.docs_per_module, fidelity=args.fidelity)
    dtype = ModelConfig(dtype=args.dtype).torch_dtype
    kv_bytes_per_token = KV_VALUES_PER_TOKEN * torch.empty((), dtype=dtype).element_size()
    log(f"workload: {sum(len(t) for t in tasks)} requests, ~{working_tokens} tokens of KV in use "
        f"({working_tokens * kv_bytes_per_token / 2**20:.0f} MiB in {dtype})")
    runs: dict[float, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as directory:
        redis_server = RedisServer(directory)
        redis_server.start()
        redis_url = redis_server.url
        port = free_port()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for share in args.device_shares:
                device_bytes = int(share * working_tokens * kv_bytes_per_token)
                log(f"device tier {device_bytes / 2**20:.0f} MiB per replica ({share:.0%} of the working set)")
                settings = {"redis_url": redis_url, "preload_examples": False, "device_max_bytes": device_bytes,
                            "host_max_bytes": 1 << 20, "namespace": "scaleout",
                            "dtype": str(dtype).removeprefix("torch.")}
                runs[share] = {router: run_router(router, f"http://127.0.0.1:{port}", settings, schemas, tasks,
                                                  args.concurrency, redis_url, share, args.out, args.fidelity)
                               for router in args.routers}
        finally:
            serve.shutdown()
            ray.shutdown()
            redis_server.kill()
    for share, summaries in runs.items():
        for name in [r for r in summaries if r != "default" and "default" in summaries]:
            base, ours = summaries["default"], summaries[name]
            hit_ratio = ours["device_hit_rate"] / max(base["device_hit_rate"], 1e-9)
            ttft_ratio = ours["p50_ttft_ms"] / base["p50_ttft_ms"]
            emit({"bench": "scaleout_targets", "router": name, "device_share": share,
                  "hit_rate_ratio": round(hit_ratio, 2), "hit_rate_target": ">= 1.8", "hit_rate_met": hit_ratio >= 1.8,
                  "p50_ttft_ratio": round(ttft_ratio, 3), "p50_ttft_target": "<= 0.6",
                  "p50_ttft_met": ttft_ratio <= 0.6,
                  "max_over_mean_requests": ours["max_over_mean_requests"], "balance_target": "<= 1.3",
                  "balance_met": ours["max_over_mean_requests"] <= 1.3, "concurrency": args.concurrency,
                  "pml_fidelity": args.fidelity or "server default"}, args.out)
    draw(runs, simulated, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
