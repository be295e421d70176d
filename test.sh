#!/usr/bin/env bash
# The test suite, on a machine with Rust and little else: gets what the tests
# need, then runs `cargo test --locked` (extra arguments are passed to it).
#
# - Redis: REDIS_URL if set, else Docker (testcontainers) if a daemon
#   answers and has the redis:7.2 image; else a redis-server the tests
#   start themselves. redis-server and redis-cli are installed either way:
#   the Cluster, Sentinel, TLS and outage tests start, pause and kill
#   their own.
# - openssl (the TLS tests make their certificates), promtool (the metrics
#   exposition is checked with it), Chromium (the dashboard is rendered
#   headless), Python 3 with grpcio, websockets, openai and xds-protos (the
#   gRPC and WebSocket peers, the OpenAI SDK client and a client of Envoy's
#   rate limit service built from Envoy's definitions, in tests/peers/), nginx and
#   Caddy (front proxies asking floodgate's decision listener).
#
# What is missing is installed with apt-get and pip when this runs as root
# (or FLOODGATE_TEST_INSTALL=1 with sudo); otherwise the script names
# exactly what to install and stops.
set -euo pipefail
cd "$(dirname "$0")"

packages=()
command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || packages+=(redis-tools)
command -v openssl >/dev/null 2>&1 || packages+=(openssl)
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v chromium >/dev/null 2>&1 || packages+=(chromium)
command -v python3 >/dev/null 2>&1 || packages+=(python3 python3-pip)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || packages+=(nginx)
command -v caddy >/dev/null 2>&1 || packages+=(caddy)
python_ok() { python3 -c 'import grpc, websockets, openai, envoy.service.ratelimit.v3.rls_pb2_grpc' >/dev/null 2>&1; }

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if [ "${FLOODGATE_TEST_INSTALL:-0}" = 1 ] && command -v sudo >/dev/null 2>&1; then
    sudo="sudo"
  elif [ ${#packages[@]} -gt 0 ] || ! python_ok; then
    echo "test.sh: the tests need what is not installed here:" >&2
    [ ${#packages[@]} -gt 0 ] && echo "  apt-get install ${packages[*]}" >&2
    python_ok || echo "  python3 -m pip install 'grpcio>=1.60' 'websockets>=14,<18' 'openai>=1.40,<3' 'xds-protos>=1.60'" >&2
    echo "Install them (or run as root, or with FLOODGATE_TEST_INSTALL=1 to use sudo), then run ./test.sh again." >&2
    exit 2
  fi
fi
if [ ${#packages[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: install ${packages[*]} (Debian names) with your package manager, then run ./test.sh again." >&2
    exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
if ! python_ok; then
  $sudo python3 -m pip install --quiet --disable-pip-version-check 'grpcio>=1.60' 'websockets>=14,<18' 'openai>=1.40,<3' 'xds-protos>=1.60'
fi

# Everything is here: the promtool and Chromium checks must run, not be
# skipped.
export FLOODGATE_TEST_NEEDS_PROMTOOL=1
export FLOODGATE_TEST_NEEDS_CHROMIUM=1
exec cargo test --locked "$@"
