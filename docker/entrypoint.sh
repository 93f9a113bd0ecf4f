#!/bin/sh
# Container entry point: serve promptcache. Settings come from PROMPTCACHE_* environment variables
# (PROMPTCACHE_MODEL, PROMPTCACHE_REDIS_URL, PROMPTCACHE_API_KEYS_FILE, ...); extra arguments are CLI flags,
# which win over the environment.
#
# A container listens on every interface, so it refuses to start without API keys (PROMPTCACHE_API_KEYS,
# PROMPTCACHE_API_KEYS_FILE, --api-key or --api-keys-file) unless it binds to loopback only or
# PROMPTCACHE_ALLOW_UNAUTHENTICATED=1 says an open server is intended (docs/security.md).
set -eu
host="${PROMPTCACHE_HOST:-0.0.0.0}"
keyed="${PROMPTCACHE_API_KEYS:-}${PROMPTCACHE_API_KEYS_FILE:-}"
for arg in "$@"; do
  case "$arg" in --api-key|--api-key=*|--api-keys-file|--api-keys-file=*) keyed=yes ;; esac
done
if [ -z "$keyed" ] && [ "${PROMPTCACHE_ALLOW_UNAUTHENTICATED:-0}" != "1" ]; then
  case "$host" in
    127.*|localhost|::1) ;;
    *) echo "promptcache: refusing to serve on $host without API keys; set PROMPTCACHE_API_KEYS_FILE (or" \
            "PROMPTCACHE_API_KEYS), or PROMPTCACHE_ALLOW_UNAUTHENTICATED=1 for an open server" >&2
       exit 64 ;;
  esac
fi
exec promptcache serve --host "$host" --port "${PROMPTCACHE_PORT:-8000}" "$@"
