"""The Ray Serve application: a gateway in front of N promptcache replicas sharing one Redis. `serve_cluster`
runs it for `promptcache serve --replicas N`; `build` is its builder for Serve config files (deploy/ray/)."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from promptcache.cluster.errors import ClusterConfigError
from promptcache.cluster.gateway import Gateway
from promptcache.cluster.options import ClusterOptions
from promptcache.cluster.replica import PromptCacheReplica
from promptcache.cluster.router import CacheAffinityRouter
from promptcache.server.settings import ServerSettings

APP_NAME = "promptcache"
REPLICA_DEPLOYMENT = "PromptCacheReplica"
GATEWAY_DEPLOYMENT = "Gateway"


def build_application(settings: dict[str, Any], options: ClusterOptions | None = None) -> Application:
    """The application for `settings` (ServerSettings fields given explicitly; the replicas read the rest
    from their PROMPTCACHE_* environment). Raises ClusterConfigError for invalid settings."""
    options = options or ClusterOptions()
    # An upload is routed by its schema name, the schema's prompts by their module sets: the replica that
    # encodes it keeps it only in Redis, so its device tier holds the KV of the requests it serves.
    settings = {"upload_kv_local": False, **settings}
    try:
        resolved = ServerSettings(**settings)  # validate here, before Ray starts anything
    except ValidationError as exc:
        raise ClusterConfigError(f"invalid replica settings: {exc}") from None
    replica_options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT, "max_ongoing_requests": options.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": options.num_cpus_per_replica, "num_gpus": options.num_gpus_per_replica},
        "health_check_period_s": options.health_check_period_s, "graceful_shutdown_timeout_s": 5}
    if options.max_replicas is not None and options.max_replicas > options.num_replicas:
        replica_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=options.num_replicas, initial_replicas=options.num_replicas,
            max_replicas=options.max_replicas, target_ongoing_requests=options.target_ongoing_requests)
    else:
        replica_options["num_replicas"] = options.num_replicas
    if options.router == "affinity":
        replica_options["request_router_config"] = RequestRouterConfig(
            request_router_class=CacheAffinityRouter,  # type: ignore[arg-type]  # Ray types **kwargs as dicts
            request_router_kwargs={"settings": settings, "prefix_chars": options.prefix_chars,
                                   "pml_key": options.pml_key, "abs_threshold": options.abs_threshold,
                                   "rel_threshold": options.rel_threshold, "balance_factor": options.balance_factor})
    replicas = serve.deployment(**replica_options)(PromptCacheReplica).bind(settings, options.num_threads)
    gateway = serve.deployment(name=GATEWAY_DEPLOYMENT, num_replicas=options.num_gateways,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)(Gateway)
    return gateway.bind(replicas, max_request_bytes=resolved.max_request_bytes, settings=settings)


def build(args: dict[str, Any]) -> Application:
    """Application builder for Serve config files: `args` has `settings` (ServerSettings fields) and
    `cluster` (ClusterOptions fields), both optional."""
    if unknown := sorted(set(args) - {"settings", "cluster"}):
        raise ClusterConfigError(f"unknown application args {unknown}; expected 'settings' and/or 'cluster'")
    options = ClusterOptions.from_dict(dict(args.get("cluster") or {}))
    return build_application(dict(args.get("settings") or {}), options)


def serve_cluster(settings: dict[str, Any], options: ClusterOptions, *, host: str, port: int,
                  log_level: str = "info") -> int:
    """Start Ray on this machine, deploy the application on http://host:port and block until interrupted
    (Ctrl-C or SIGTERM); Ray then stops the replicas. Raises ClusterConfigError for invalid settings."""
    application = build_application(settings, options)  # invalid settings fail before Ray starts
    ray.init(include_dashboard=False, logging_level=getattr(logging, log_level.upper(), logging.INFO))
    signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which installs its own: stop Ray cleanly
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        print(f"promptcache: {options.num_replicas} replica(s) on http://{host}:{port} (router: {options.router})",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
