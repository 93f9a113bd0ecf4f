"""`promptcache serve --replicas N`: a local Ray cluster on this machine running the Serve application."""

from __future__ import annotations

import signal
import time
from typing import Any

from promptcache.cluster.options import ClusterOptions

APP_NAME = "promptcache"


def serve_cluster(settings: dict[str, Any], options: ClusterOptions, *, host: str, port: int,
                  log_level: str = "info") -> int:
    """Start Ray on this machine, deploy the application on http://host:port and block until interrupted
    (Ctrl-C or SIGTERM); Ray then stops the replicas. Raises ClusterConfigError for invalid settings."""
    import logging

    import ray
    from ray import serve

    from promptcache.cluster.app import build_application

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
