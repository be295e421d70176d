#!/usr/bin/env bash
# CPU per decision on the decision listener, beside the proxy path: one
# floodgate (release build) serves a route whose gcra limit never triggers
# three ways, in alternated rounds, and its user + system CPU (from
# /proc/PID/stat) over each round is divided by the round's requests:
#
#   proxy     GET / on the proxy listener, forwarded to nginx answering `ok`
#   proxy-h2  the same over HTTP/2 (h2c), as the rls row speaks it
#   decision  the same route decided on the decision listener, as nginx's
#             auth_request asks (X-Original-URI, X-Forwarded-For), nothing
#             forwarded
#   rls       a descriptor route with the same limit, asked with Envoy's rate
#             limit service protocol (one RateLimitRequest, h2c)
#
# h2load drives each round over one connection (HTTP/1.1 for proxy and
# decision, HTTP/2 for proxy-h2 and rls), one request at a time. Prints each mode's median
# over the rounds, in microseconds of floodgate's CPU a request.
#
#   bench/decisions.sh [BINARY]     default target/release/floodgate
#   N (requests a round, default 40000), ROUNDS (default 5),
#   STORE (memory or redis, default memory)
#
# Needs h2load (nghttp2-client), nginx and redis-server (installed with
# apt-get when missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/floodgate}
n=${N:-40000}
rounds=${ROUNDS:-5}
store=${STORE:-memory}

need=()
command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client)
command -v nginx >/dev/null 2>&1 || need+=(nginx)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x "$bin" ] || cargo build --release --locked -q

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 400); do (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

up=$(port); listen=$(port); decisions=$(port); redis_port=$(port)
mkdir -p "$work/up"
cat >"$work/up/nginx.conf" <<CONF
daemon off; worker_processes 1; pid $work/up/nginx.pid; error_log stderr error;
events { worker_connections 1024; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$up; location / { return 200 "ok\n"; } } }
CONF
nginx -c "$work/up/nginx.conf" -p "$work/up" & pids+=($!)
wait_port "$up"
{
  printf '[server]\nlisten = "127.0.0.1:%s"\ndecision_listen = "127.0.0.1:%s"\n' "$listen" "$decisions"
  printf 'decision_peers = ["127.0.0.1/32"]\ndrain_delay = "0s"\nshutdown_grace = "1s"\n'
  if [ "$store" = redis ]; then
    redis-server --port "$redis_port" --save "" --appendonly no >/dev/null & pids+=($!)
    wait_port "$redis_port"
    printf '[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:%s/0"\ntimeout = "1s"\n' "$redis_port"
  fi
  printf '[[routes]]\nname = "bench"\nmatch = { path_prefix = "/" }\nupstream = "http://127.0.0.1:%s"\n' "$up"
  printf 'limits = [{ algorithm = "gcra", limit = 100000000, window = "1s" }]\n'
  printf '[[routes]]\nname = "descriptors"\ndescriptor = { domain = "edge", entries = ["user"] }\n'
  printf 'limits = [{ algorithm = "gcra", limit = 100000000, window = "1s" }]\n'
} >"$work/fg.toml"
RUST_LOG=warn "$bin" --config "$work/fg.toml" >"$work/fg.log" 2>&1 & fg=$!; pids+=($fg)
wait_port "$listen"; wait_port "$decisions"
# RateLimitRequest { domain: "edge", descriptors: [{ entries: [{ key:
# "user", value: "ann" }] }] }, framed as one gRPC message.
printf '\x00\x00\x00\x00\x15\x0a\x04edge\x12\x0d\x0a\x0b\x0a\x04user\x12\x03ann' >"$work/rls.bin"

cpu() { awk '{ print $14 + $15 }' "/proc/$fg/stat"; }
hz=$(getconf CLK_TCK)
load() {
  case $1 in
    proxy) h2load --h1 -n "$n" -c 1 -m 1 "http://127.0.0.1:$listen/" ;;
    proxy-h2) h2load -n "$n" -c 1 -m 1 "http://127.0.0.1:$listen/" ;;
    decision) h2load --h1 -n "$n" -c 1 -m 1 -H 'X-Original-URI: /v1/chat' \
      -H 'X-Original-Method: POST' -H 'X-Forwarded-For: 192.0.2.7' "http://127.0.0.1:$decisions/_floodgate" ;;
    rls) h2load -n "$n" -c 1 -m 1 -d "$work/rls.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
      "http://127.0.0.1:$decisions/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" ;;
  esac >"$work/h2load.log"
  grep -q "$n succeeded" "$work/h2load.log" || { cat "$work/h2load.log" >&2; exit 1; }
}
declare -A samples
modes="proxy decision proxy-h2 rls"
for mode in $modes; do load "$mode"; done   # warm-up
for round in $(seq "$rounds"); do
  for mode in $modes; do
    before=$(cpu)
    load "$mode"
    after=$(cpu)
    samples[$mode]+="$(awk -v t=$((after - before)) -v hz="$hz" -v n="$n" 'BEGIN { printf "%.2f", t / hz * 1e6 / n }') "
  done
done
median() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
echo "store: $store, $n requests a round, $rounds rounds, floodgate's CPU (user + system) a request, median (all rounds)"
for mode in $modes; do
  echo "$mode: $(median "${samples[$mode]}") µs ($(echo ${samples[$mode]}))"
done
