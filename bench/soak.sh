#!/usr/bin/env bash
# A bounded soak: mixed traffic through floodgate (limited and unlimited
# routes, allowed and denied clients, proxied and direct answers) for
# DURATION seconds while Redis is SIGKILLed and restarted every 15 s. Prints
# floodgate's resident memory and open file descriptors before and after,
# and wrk's summary. Not part of the test suite.
#   bench/soak.sh [duration_seconds]      default 60
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-60}
for tool in redis-server wrk; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install redis-server wrk)" >&2; exit 1; }
done
cargo build --release --locked -q
bin=target/release/floodgate
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
redis_port=$(free_port); up_port=$(free_port); port=$(free_port); admin_port=$(free_port)

start_redis() {
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
  redis_pid=$!
  pids+=("$redis_pid")
}
start_redis

# The upstream is another floodgate answering by itself.
cat >"$work/upstream.toml" <<TOML
[server]
listen = "127.0.0.1:$up_port"
[[routes]]
name = "echo"
respond = { status = 200, body = "upstream\n" }
TOML
"$bin" --config "$work/upstream.toml" 2>/dev/null & pids+=($!)

cat >"$work/floodgate.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin_port"
[store]
backend = "redis"
url = "redis://127.0.0.1:$redis_port"
timeout = "50ms"
on_error = "local"
[[routes]]
name = "login"
match = { path_prefix = "/login" }
upstream = "http://127.0.0.1:$up_port"
client = { from = "header", name = "X-Client" }
limits = [{ algorithm = "sliding_log", limit = 5, window = "10s" }]
[[routes]]
name = "api"
match = { path_prefix = "/api" }
upstream = "http://127.0.0.1:$up_port"
client = { from = "header", name = "X-Client" }
limits = [
  { algorithm = "gcra", limit = 50, window = "1s", burst = 20 },
  { algorithm = "sliding_window", limit = 1000, window = "1m" },
]
[[routes]]
name = "direct"
match = { path_prefix = "/direct" }
respond = { status = 200, body = "direct\n" }
limits = [{ algorithm = "token_bucket", limit = 100, window = "1s" }]
[[routes]]
name = "rest"
upstream = "http://127.0.0.1:$up_port"
TOML
FLOODGATE_LOG=warn "$bin" --config "$work/floodgate.toml" 2>"$work/floodgate.log" &
fg=$!; pids+=("$fg")
sleep 1

cat >"$work/mixed.lua" <<'LUA'
local paths = {"/login", "/api/items", "/api/orders?page=2", "/direct", "/static/app.js"}
local n = 0
request = function()
  n = n + 1
  local path = paths[(n % #paths) + 1]
  local client = "c" .. (n % 500)
  return wrk.format("GET", path, { ["X-Client"] = client })
end
LUA

sample() { printf '%s rss=%s fds=%s\n' "$1" "$(awk '/VmRSS/{print $2" "$3}' /proc/$fg/status)" "$(ls /proc/$fg/fd | wc -l)"; }
wrk -t1 -c32 -d5s -s "$work/mixed.lua" "http://127.0.0.1:$port" >/dev/null
sample before

wrk -t1 -c32 -d"${duration}s" -s "$work/mixed.lua" "http://127.0.0.1:$port" >"$work/wrk.txt" &
load=$!
elapsed=0
while [ "$elapsed" -lt "$duration" ]; do
  sleep 15; elapsed=$((elapsed + 15))
  [ "$elapsed" -ge "$duration" ] && break
  kill -9 "$redis_pid"; sleep 2; start_redis
  echo "redis restarted at ${elapsed}s"
done
wait "$load"
sleep 2
sample after
cat "$work/wrk.txt"
curl -s "http://127.0.0.1:$admin_port/metrics" | grep -E '^floodgate_requests_total' | grep -v ' 0$' || true
kill -0 "$fg" && echo "floodgate still running"
