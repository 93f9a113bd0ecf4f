#!/bin/sh
# Container entry point: serve promptcache. Settings come from PROMPTCACHE_* environment variables
# (PROMPTCACHE_MODEL, PROMPTCACHE_REDIS_URL, PROMPTCACHE_API_KEYS, ...); extra arguments are CLI flags,
# which win over the environment.
set -eu
exec promptcache serve --host "${PROMPTCACHE_HOST:-0.0.0.0}" --port "${PROMPTCACHE_PORT:-8000}" "$@"
