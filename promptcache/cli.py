"""Command line: `promptcache serve | encode | build-kernels`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="promptcache", description="LLM serving with prompt-module KV caching")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP server")
    _model_flags(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--api-key", action="append", dest="api_keys", help="a default-tenant Bearer key (repeatable)")
    serve.add_argument("--api-keys-file", help="JSON mapping API keys to tenant names (docs/security.md)")
    serve.add_argument("--metrics-key", help="Bearer key /metrics asks for (default: /metrics is open)")
    serve.add_argument("--tenant-max-schemas", type=int, help="schemas each tenant may hold (default: unlimited)")
    serve.add_argument("--tenant-max-schema-tokens", type=int, help="schema tokens each tenant may hold, summed")
    serve.add_argument("--tenant-rate-limit", help="samples (prompts x n) per tenant, e.g. 10/second")
    serve.add_argument("--tenant-cache-share", type=float, help="most of each KV tier's bytes one tenant may hold, "
                       "e.g. 0.25; a tenant at its share evicts only its own entries (default: no limit)")
    serve.add_argument("--no-examples", action="store_true", help="do not preload the bundled example schemas")
    serve.add_argument("--no-prefix-caching", action="store_true", help="turn off automatic prefix reuse")
    serve.add_argument("--no-cuda-graphs", action="store_true", help="a GPU runs every step eagerly (default: "
                       "all-decode steps and lone prefills replayed from CUDA graphs)")
    serve.add_argument("--prefix-block-size", type=int, help="tokens per automatic prefix block (default 32)")
    serve.add_argument("--max-prefill-tokens", type=int, help="most prompt/encoding tokens a step while others decode "
                       "(default 256)")
    serve.add_argument("--min-prefill-tokens", type=int, help="least prompt/encoding tokens a step while others decode "
                       "(default 8)")
    serve.add_argument("--max-step-slowdown", type=float, help="while sequences decode, a step with prompt tokens "
                       "costs at most this many decode steps (learned; default 1.6; 0: --max-prefill-tokens)")
    serve.add_argument("--ttft-target-ms", type=float, help="while sequences decode, a step also feeds the prompts "
                       "that would get their first token later than this many ms (default 0: off)")
    serve.add_argument("--max-prefill-tokens-alone", type=int, help="prompt tokens a step alone (default 4096)")
    serve.add_argument("--fidelity", choices=["fast", "balanced", "exact"], help="the default fidelity mode")
    serve.add_argument("--fidelity-positions", choices=["contiguous", "layout"],
                       help="fast/balanced: reused keys re-aligned to contiguous positions (default) or the layout's")
    serve.add_argument("--fidelity-context", choices=["schema", "predecessor"], help="fast/balanced: reuse modules as "
                       "encoded after the module before them too (predecessor, default) or their schema context only")
    serve.add_argument("--second-encodings-at-upload", action="store_true",
                       help="encode each module's second encoding (predecessor) at upload, not on its first use")
    serve.add_argument("--replicas", type=int, help="run N replicas on a local Ray cluster behind a cache-affinity "
                       "router (N > 1 needs --redis-url; pip install 'promptcache[cluster]'; docs/scaling.md)")
    serve.add_argument("--max-replicas", type=int, help="with --replicas: autoscale up to this many on queue length")
    serve.add_argument("--router", choices=["affinity", "default"], default="affinity",
                       help="with --replicas: cache-affinity routing (default) or Ray's power-of-two-choices")
    serve.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: CPUs per replica (default 1)")
    serve.add_argument("--replica-gpus", type=float, default=0.0, help="with --replicas: GPUs per replica (default 0)")
    serve.add_argument("--log-level", default="info")

    encode = commands.add_parser("encode", help="encode a schema's modules into the store (e.g. a shared Redis)")
    _model_flags(encode)
    encode.add_argument("schema", type=Path, help="a .pml schema file")

    kernels = commands.add_parser("build-kernels", help="compile the CPU kernels: bf16 attention and layers for "
                                  "AVX512-BF16 CPUs, the batch-invariant ones of --deterministic, fp32 decode ones for "
                                  "AVX2 CPUs (needs g++)")
    kernels.add_argument("--dir", type=Path, help="output folder (default: $PROMPTCACHE_KERNEL_DIR, else "
                         "~/.cache/promptcache/kernels)")
    kernels.add_argument("--force", action="store_true", help="rebuild even if this torch's library exists")
    kernels.add_argument("--verbose", action="store_true", help="show the compiler's output")
    kernels.add_argument("--this-cpu", action="store_true", help="only the libraries this CPU can run (an image "
                         "built on one machine for others builds all)")

    args = parser.parse_args(argv)
    return {"serve": _serve, "encode": _encode, "build-kernels": _build_kernels}[args.command](args)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory or hub id, a .gguf file (converted once into the model "
                        "cache), or a short name: smollm2-135m, gemma3-270m (default: built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default for serve): bf16 where the hardware computes it natively, else fp32")
    parser.add_argument("--device", help="cpu | cuda | cuda:N")
    parser.add_argument("--no-weight-packing", action="store_true", help="no weights prepacked for oneDNN on CPU")
    parser.add_argument("--no-layer-fusion", action="store_true", help="the HF decoder modules, not fused layers")
    parser.add_argument("--weights", choices=["auto", "native", "int8", "int4"], help="CPU: decoder linear weights "
                        "as loaded (native), int8 per channel or int4 per 32-group (faster decode); auto (default): "
                        "int4 for a GGUF stored in 4 bits (the built-in model), else native; see docs/api.md")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant kernels: the same request and "
                        "seed give the same tokens whatever the cache state and the batch (docs/api.md)")
    parser.add_argument("--redis-url", help="redis://host:port/db for the shared KV tier and schema registry")


_SWITCHES = {"no_examples": ("preload_examples", False), "no_prefix_caching": ("prefix_caching", False),
             "no_cuda_graphs": ("cuda_graphs", False),
             "no_weight_packing": ("pack_weights", False), "no_layer_fusion": ("fuse_layers", False),
             "second_encodings_at_upload": ("second_encodings_at_upload", True),
             "deterministic": ("deterministic", True)}


def _overrides(args: argparse.Namespace) -> dict:
    """The settings given as flags (they win over PROMPTCACHE_* variables): a switch sets its `_SWITCHES` value,
    any other flag the setting of its name; a flag not given (None) leaves it unset."""
    from promptcache.server.settings import ServerSettings

    given = {name: value for name, value in vars(args).items()
             if name in ServerSettings.model_fields and name not in _SWITCHES and value is not None}
    given.update({setting: value for flag, (setting, value) in _SWITCHES.items() if getattr(args, flag, False)})
    return given


def _build_kernels(args: argparse.Namespace) -> int:
    """Install-time step: the server only loads what this builds (model_runtime/attention/kernel_build.py)."""
    from promptcache.model_runtime import avx2, deterministic
    from promptcache.model_runtime.attention import bf16_kernel
    from promptcache.model_runtime.attention.kernel_build import KernelBuildError, bf16_library, build

    failed = False
    for label, library, runs_here in (("bf16", bf16_library(), bf16_kernel.supported()),
                                      ("batch-invariant", deterministic.LIBRARY, deterministic.supported()),
                                      ("AVX2 fp32", avx2.LIBRARY, avx2.KERNELS.supported())):
        if args.this_cpu and not runs_here:
            continue
        try:
            print(build(args.dir, force=args.force, verbose=args.verbose, library=library))
        except KernelBuildError as error:
            print(f"promptcache: {label} kernels not built: {error}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from promptcache.server import ServerSettings, create_app

    settings = ServerSettings(**_overrides(args))
    if args.replicas is not None:
        return _serve_cluster(args, settings)
    try:
        config = settings.load_config()
    except ValueError as exc:  # a combination the model config refuses (e.g. --deterministic on a GPU)
        print(f"promptcache: {exc}", file=sys.stderr)
        return 2
    if settings.deterministic:
        from promptcache.model_runtime import deterministic

        if deterministic.prepare() is None:
            print(f"promptcache: --deterministic needs the batch-invariant kernels: "
                  f"{deterministic.unavailable_reason()}", file=sys.stderr)
            return 2
    dtype = str(config.torch_dtype).removeprefix("torch.")
    if settings.weights != "native":  # auto: the log's "promptcache ready" line and /health name the outcome
        dtype += f", {settings.weights} weights"
    if settings.deterministic:
        dtype += ", deterministic"
    print(f"promptcache: serving {settings.model or 'SmolLM2-135M-Instruct (built-in)'} ({dtype}) "
          f"on http://{settings.host}:{settings.port} (GET /health turns 200 when the model is loaded)", flush=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0


def _serve_cluster(args: argparse.Namespace, settings) -> int:
    if args.replicas > 1 and not settings.redis_url:
        print("promptcache: --replicas > 1 needs --redis-url (or PROMPTCACHE_REDIS_URL): the replicas share "
              "schemas and KV through one Redis", file=sys.stderr)
        return 2
    try:
        import ray.serve  # noqa: F401  (the optional extra)

        from promptcache.cluster.app import serve_cluster
        from promptcache.cluster.errors import ClusterConfigError
        from promptcache.cluster.options import ClusterOptions
    except ImportError as exc:
        print(f"promptcache: --replicas needs Ray Serve (pip install 'promptcache[cluster]'): {exc}", file=sys.stderr)
        return 2
    try:
        options = ClusterOptions(num_replicas=args.replicas, max_replicas=args.max_replicas, router=args.router,
                                 num_cpus_per_replica=args.replica_cpus, num_gpus_per_replica=args.replica_gpus)
        return serve_cluster(_overrides(args), options, host=settings.host, port=settings.port,
                             log_level=args.log_level)
    except ClusterConfigError as exc:
        print(f"promptcache: {exc}", file=sys.stderr)
        return 2


def _encode(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from promptcache.cache_store import build_store
    from promptcache.model_runtime import ModelRuntime, load_model
    from promptcache.server.settings import ServerSettings

    settings = ServerSettings(**_overrides(args))
    loaded = load_model(settings.load_config())
    # The server's own store settings (namespace, blob key, ...): a server configured alike reads what this writes.
    store = build_store(settings.store_config(), device=settings.device)
    runtime = ModelRuntime(loaded, store)
    schema = runtime.parse_schema(args.schema.read_text())
    with tqdm(total=len(schema.segments), desc=f"encoding {schema.name}", unit="segment") as bar:
        def progress(done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.refresh()

        report = runtime.add_schema(schema, progress=progress)
    assert report is not None, "an encoding add_schema reports"
    is_written = store.close(timeout_s=max(60.0, settings.redis_timeout_s * 60))  # shared writes are write-behind
    print(json.dumps({"schema": schema.name, "num_tokens": schema.num_positions, "segments": report.num_segments,
                      "encoded": report.num_encoded, "encode_ms": round(report.encode_ms, 1),
                      "stored_in": [t.name for t in store.tiers]}))
    if not settings.redis_url:
        print("note: without --redis-url the encoded KV lives only in this process", file=sys.stderr)
    if not is_written:
        print("promptcache: some encoded KV was not written to the shared tiers in time", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
