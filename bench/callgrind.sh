#!/usr/bin/env bash
# Instructions per proxied request, deterministic: floodgate's release build
# runs under callgrind while one keep-alive HTTP/1.1 client (curl, one
# connection) sends N1 and then, in a second run, N2 GETs through a route
# whose gcra limit never triggers, to nginx answering `ok`. The difference of
# the two runs' instruction totals (every thread, startup and shutdown
# included in both) divided by N2 - N1 is the cost of one request, without
# startup. Prints one line per store: memory, and Redis (a local
# redis-server); and, as the floor measured the same way, the bare hyper
# gateway of bench/gateway (hyper's two HTTP/1.1 codecs and nothing else,
# built here with the same release profile).
#
#   bench/callgrind.sh [BINARY]     default target/release/floodgate
#   N1 (default 1000), N2 (default 6000), STORES ("memory redis gateway",
#   "job": the bare gateway doing floodgate's job in the fewest lines
#   (bench/gateway, --same-job: a GCRA decision per address, hop-by-hop
#   fields off, X-Forwarded-*, the upstream's deadline, RateLimit fields),
#   and "nginx" and "haproxy": each doing the same job as operators run it
#   for a rate-limited API, see proxy_configs; "decision" and
#   "decision-redis": the same limit decided on the decision listener, as
#   nginx's auth_request asks it, with no upstream exchange; "rls" and
#   "rls-redis": the same limit on a descriptor route, asked with Envoy's
#   rate limit service protocol by h2load over one HTTP/2 connection),
#   KEEP (a directory: each run's callgrind file is kept there, named
#   STORE-N.out, for callgrind_annotate --inclusive=yes), LIMITS=none (the
#   route has no limits), ROUTE_EXTRA (more keys for the route, e.g.
#   'rate_limit_headers = "none"')
#
# What each per-request feature costs, by taking it away: bench/ablate.patch
# adds switches (read once from FG_ABLATE, a comma-separated list of hop,
# first, deadline, retry, fwd, dmetrics, umetrics, top, or all) that skip
# one feature each; it is for measuring only and never committed to the
# source. `git apply bench/ablate.patch`, build, then run this once per
# switch with FG_ABLATE set, and `git checkout src` afterwards.
#
# Where the instructions go, by function: KEEP=/tmp/cg bench/callgrind.sh,
# then `callgrind_annotate --inclusive=yes /tmp/cg/memory-6000.out` (and
# --tree=caller for who calls memcpy or malloc). By source line: build the
# same code with line tables (`cargo build --profile prof`, the release
# profile plus debug line tables; the instructions are the release build's
# within noise), run this on target/prof/floodgate, and annotate with
# `callgrind_annotate --auto=yes`. Divide by N2 for per-request figures
# (startup is a few hundred thousand instructions over all).
#
# Needs valgrind, nginx, haproxy, curl and redis-server (installed with apt-get when
# missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/same_job.sh
bin=${1:-target/release/floodgate}
n1=${N1:-1000}
n2=${N2:-6000}
stores=${STORES:-memory redis gateway}

need=()
for tool in valgrind nginx curl redis-server haproxy; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
case " $stores " in
  *" rls"*) command -v h2load >/dev/null 2>&1 || need+=(nghttp2-client) ;;
esac
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x "$bin" ] || cargo build --release --locked -q
gateway=bench/gateway/target/release/bare-gateway
case " $stores " in
  *" gateway "* | *" job "*) cargo build --release --locked -q --manifest-path bench/gateway/Cargo.toml ;;
esac

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 400); do (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

up=$(port); redis_port=$(port)
mkdir -p "$work/up"
cat >"$work/up/nginx.conf" <<CONF
daemon off; worker_processes 1; pid $work/up/nginx.pid; error_log stderr error;
events { worker_connections 1024; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$up; location / { return 200 "ok\n"; } } }
CONF
nginx -c "$work/up/nginx.conf" -p "$work/up" & pids+=($!)
redis-server --port "$redis_port" --save "" --appendonly no >/dev/null & pids+=($!)
wait_port "$up"; wait_port "$redis_port"

# nginx and HAProxy doing floodgate's job (bench/same_job.sh), one
# process, one thread.
proxy_configs() {
  local listen=$1
  mkdir -p "$work/ngx"
  {
    echo "daemon off; master_process off; worker_processes 1; pid $work/ngx/nginx.pid; error_log stderr error;"
    echo "events { worker_connections 1024; }"
    echo "http { access_log off;"
    same_job_nginx_http "$up" 16
    echo "  server { listen 127.0.0.1:$listen; keepalive_requests 1000000;"
    same_job_nginx_location
    echo "  } }"
  } >"$work/ngx/nginx.conf"
  same_job_haproxy "$listen" "$up" >"$work/haproxy.cfg"
}

# Total instructions of floodgate serving $2 requests with store $1 (or of
# the bare gateway, nginx or HAProxy, for "gateway", "nginx", "haproxy").
instructions() {
  local store=$1 n=$2 listen
  listen=$(port)
  local run=("$bin" --config "$work/fg.toml")
  # The decision rows: curl asks the decision listener as nginx does.
  local decide="" rls=""
  case $store in decision*) decide=1 ;; rls*) decide=1; rls=1 ;; esac
  case $store in
    gateway) run=("$gateway" "127.0.0.1:$listen" "127.0.0.1:$up") ;;
    job) run=("$gateway" "127.0.0.1:$listen" "127.0.0.1:$up" --same-job) ;;
    nginx) proxy_configs "$listen"; run=(nginx -c "$work/ngx/nginx.conf" -p "$work/ngx") ;;
    haproxy) proxy_configs "$listen"; run=(haproxy -f "$work/haproxy.cfg" -db) ;;
  esac
  {
    if [ -n "$decide" ]; then
      printf '[server]\nlisten = "127.0.0.1:%s"\ndecision_listen = "127.0.0.1:%s"\ndecision_peers = ["127.0.0.1/32"]\n' "$(port)" "$listen"
      printf 'drain_delay = "0s"\nshutdown_grace = "1s"\n'
    else
      printf '[server]\nlisten = "127.0.0.1:%s"\ndrain_delay = "0s"\nshutdown_grace = "1s"\n' "$listen"
    fi
    case $store in redis | *-redis)
      printf '[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:%s/0"\ntimeout = "1s"\n' "$redis_port" ;;
    esac
    if [ -n "$rls" ]; then
      printf '[[routes]]\nname = "bench"\ndescriptor = { domain = "edge", entries = ["user"] }\n'
    else
      printf '[[routes]]\nname = "bench"\nmatch = { path_prefix = "/" }\n'
    fi
    [ -n "$decide" ] || printf 'upstream = "http://127.0.0.1:%s"\n' "$up"
    if [ "${LIMITS:-}" != none ]; then
      printf 'limits = [{ algorithm = "gcra", limit = 100000000, window = "1s" }]\n'
    fi
    if [ -n "${ROUTE_EXTRA:-}" ]; then printf '%s\n' "$ROUTE_EXTRA"; fi
  } >"$work/fg.toml"
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" \
    "${run[@]}" >"$work/fg.log" 2>&1 &
  local pid=$!
  wait_port "$listen"
  if [ -n "$rls" ]; then
    # RateLimitRequest { domain: "edge", descriptors: [{ entries: [{ key:
    # "user", value: "ann" }] }] }, framed as one gRPC message.
    printf '\x00\x00\x00\x00\x15\x0a\x04edge\x12\x0d\x0a\x0b\x0a\x04user\x12\x03ann' >"$work/rls.bin"
    h2load -n "$n" -c 1 -m 1 -d "$work/rls.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
      "http://127.0.0.1:$listen/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" >"$work/h2load.log"
    grep -q "$n succeeded" "$work/h2load.log" || { cat "$work/h2load.log" >&2; exit 1; }
  else
    # One warm-up request, then n on one kept-alive connection.
    curl -s -o /dev/null "http://127.0.0.1:$listen/"
    {
      # Options in a curl config apply to every URL in it: said once.
      if [ -n "$decide" ]; then
        echo 'header = "X-Original-URI: /v1/chat"'; echo 'header = "X-Original-Method: POST"'
        echo 'header = "X-Forwarded-For: 192.0.2.7"'
      fi
      for _ in $(seq "$n"); do echo "url = \"http://127.0.0.1:$listen/\""; echo 'output = "/dev/null"'; done
    } >"$work/urls"
    curl -s --config "$work/urls"
  fi
  kill -TERM "$pid"
  wait "$pid" || true
  awk '/^(totals|summary):/ { print $2; exit }' "$work/cg.out"
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$work/cg.out" "$KEEP/$store-$n.out"; fi
}

declare -A per
for store in $stores; do
  a=$(instructions "$store" "$n1")
  b=$(instructions "$store" "$n2")
  per[$store]=$(( (b - a) / (n2 - n1) ))
  echo "$store: ${per[$store]} instructions per request ($a for $n1, $b for $n2)"
done
ratio() { # floodgate's row, another row, the target
  if [ -n "${per[$1]:-}" ] && [ -n "${per[$2]:-}" ]; then
    awk -v a="${per[$1]}" -v b="${per[$2]}" -v x="$1 / $2" -v t="$3" \
      'BEGIN { printf "%s: %.2fx (target: %s)\n", x, a / b, t }'
  fi
}
ratio memory gateway "at most 1.30x"
ratio job gateway "the job at its floor: the gateway doing floodgate's job"
ratio memory job "floodgate against the smallest gateway doing its job"
ratio redis gateway "at most 1.45x"
ratio memory nginx "at most 1.25x, in CPU per request"
ratio memory haproxy "below 1, in CPU per request"
ratio decision memory "a decision without forwarding, beside the proxy path"
ratio decision-redis redis "a decision without forwarding, beside the proxy path"
ratio rls memory "Envoy's rate limit service, beside the proxy path"
ratio rls-redis redis "Envoy's rate limit service, beside the proxy path"
