#!/bin/sh
# Container entry point: serve promptcache. Settings come from PROMPTCACHE_* environment variables
# (PROMPTCACHE_MODEL, PROMPTCACHE_REDIS_URL, PROMPTCACHE_API_KEYS_FILE, ...); extra arguments are CLI flags,
# which win over the environment.
#
# A container listens on every interface, so it refuses to start without API keys (PROMPTCACHE_API_KEYS,
# PROMPTCACHE_API_KEYS_FILE, --api-key or --api-keys-file) unless it binds to loopback only (PROMPTCACHE_HOST,
# or --host, which wins) or PROMPTCACHE_ALLOW_UNAUTHENTICATED=1 says an open server is intended
# (docs/security.md). A key list of only commas and spaces, or an empty flag value, is no key.
set -eu
host="${PROMPTCACHE_HOST:-0.0.0.0}"
keyed=""
if [ -n "${PROMPTCACHE_API_KEYS_FILE:-}" ] || [ -n "$(printf '%s' "${PROMPTCACHE_API_KEYS:-}" | tr -d ', \t\n')" ]; then
  keyed=yes
fi
previous=""
for arg in "$@"; do
  # The value of the flag before ("--host 0.0.0.0"), then the flag itself ("--host=0.0.0.0"); argparse also
  # takes --host shortened to --ho or --hos.
  case "$previous" in
    --api-key|--api-keys-file) if [ -n "$arg" ]; then keyed=yes; fi ;;
    --ho|--hos|--host) host="$arg" ;;
  esac
  case "$arg" in
    --api-key=?*|--api-keys-file=?*) keyed=yes ;;
    --ho=*|--hos=*|--host=*) host="${arg#*=}" ;;
  esac
  previous="$arg"
done
if [ -z "$keyed" ] && [ "${PROMPTCACHE_ALLOW_UNAUTHENTICATED:-0}" != "1" ]; then
  case "$host" in
    127.*|localhost|::1) ;;
    *) echo "promptcache: refusing to serve on '$host' without API keys; set PROMPTCACHE_API_KEYS_FILE (or" \
            "PROMPTCACHE_API_KEYS), or PROMPTCACHE_ALLOW_UNAUTHENTICATED=1 for an open server" >&2
       exit 64 ;;
  esac
fi
exec promptcache serve --host "$host" --port "${PROMPTCACHE_PORT:-8000}" "$@"
