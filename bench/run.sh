#!/usr/bin/env bash
# Side-by-side benchmark: floodgate against nginx and HAProxy on this machine,
# in one run. Installs what it needs from the distribution (nginx, haproxy,
# wrk, hey, redis-server), starts every server on loopback, pins the server
# under test to CPU 0 and the load generator, upstream and Redis to CPU 1
# when there are at least two cores, runs each case twice for DURATION
# seconds (rows 1 to 6 in two interleaved passes, so drift in the machine's
# speed weighs on each alike), stops everything it started, and prints one
# markdown table with each row's throughput, latency and CPU per request
# (user + system from /proc of the server's processes, and of Redis) (also written to bench/latest-run.md unless NO_RESULTS=1;
# bench/RESULTS.md is the curated record with the analysis).
#   bench/run.sh [duration_seconds]        default 10
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
duration=${1:-10}
connections=${CONNECTIONS:-64}

need=()
for tool in nginx haproxy wrk hey redis-server redis-cli python3; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  pkgs=()
  for t in "${need[@]}"; do
    case $t in redis-server|redis-cli) pkgs+=(redis-server redis-tools) ;; *) pkgs+=("$t") ;; esac
  done
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
cargo build --release --locked -q
bin=$root/target/release/floodgate

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

if [ "$(nproc)" -ge 2 ]; then
  server_cpu="taskset -c 0"; load_cpu="taskset -c 1"
else
  server_cpu=""; load_cpu=""
fi
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

up=$(port); ngx_proxy=$(port); ngx_limit=$(port); hap=$(port); fg_mem=$(port); fg_redis=$(port); fg_flood=$(port); fg_keys=$(port); redis_port=$(port)

# --- the upstream: a fixed 200 from nginx, on the load generator's core ---
mkdir -p "$work/up" "$work/proxy"
cat >"$work/up/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/up/nginx.pid; error_log $work/up/error.log;
events { worker_connections 4096; }
http { access_log off; server { listen 127.0.0.1:$up; keepalive_requests 1000000;
  location / { return 200 "ok\n"; } } }
CONF
$load_cpu nginx -c "$work/up/nginx.conf" -p "$work/up" & pids+=($!)
up_pid=$!

# --- nginx as a proxy, plain and with limit_req that never triggers ---
cat >"$work/proxy/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/proxy/nginx.pid; error_log $work/proxy/error.log;
events { worker_connections 4096; }
http { access_log off;
  upstream app { server 127.0.0.1:$up; keepalive 128; keepalive_requests 1000000; }
  limit_req_zone \$binary_remote_addr zone=perip:10m rate=100000000r/s;
  server { listen 127.0.0.1:$ngx_proxy; keepalive_requests 1000000;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } }
  server { listen 127.0.0.1:$ngx_limit; keepalive_requests 1000000;
    location / { limit_req zone=perip burst=1000000 nodelay;
      proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
CONF
$server_cpu nginx -c "$work/proxy/nginx.conf" -p "$work/proxy" & pids+=($!)
ngx_pid=$!

# --- HAProxy with a stick table that never triggers ---
cat >"$work/haproxy.cfg" <<CONF
global
  nbthread 1
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  http-reuse always
frontend fe
  bind 127.0.0.1:$hap
  stick-table type ip size 1m expire 10s store http_req_rate(10s)
  http-request track-sc0 src
  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }
  default_backend app
backend app
  server up 127.0.0.1:$up
CONF
$server_cpu haproxy -f "$work/haproxy.cfg" -db >/dev/null 2>&1 & pids+=($!)
hap_pid=$!

# --- Redis for floodgate ---
$load_cpu redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null & pids+=($!)
redis_pid=$!
# Up before floodgate starts, so no instance begins with Redis unreachable
# (it would, by design, start with its breaker open and let requests
# through until it finds Redis).
wait_port "$redis_port"

# --- floodgate, four ways ---
floodgate_conf() { # port store client limit
  local store=""
  [ "$2" = redis ] && store="[store]
backend = \"redis\"
url = \"redis://127.0.0.1:$redis_port\"
key_prefix = \"bench-$1\"
timeout = \"100ms\""
  cat <<TOML
[server]
listen = "127.0.0.1:$1"
$store
[[routes]]
name = "api"
upstream = "http://127.0.0.1:$up"
client = $3
limits = [$4]
TOML
}
never='{ algorithm = "gcra", limit = 1000000000, window = "1s" }'
floodgate_conf "$fg_mem" memory '{ from = "remote_addr" }' "$never" >"$work/mem.toml"
floodgate_conf "$fg_redis" redis '{ from = "remote_addr" }' "$never" >"$work/redis.toml"
floodgate_conf "$fg_flood" redis '{ from = "header", name = "X-Client" }' '{ algorithm = "sliding_log", limit = 10, window = "1m" }' >"$work/flood.toml"
floodgate_conf "$fg_keys" redis '{ from = "header", name = "X-Client" }' "$never" >"$work/keys.toml"
for f in mem redis flood keys; do
  FLOODGATE_LOG=warn $server_cpu "$bin" --config "$work/$f.toml" 2>>"$work/floodgate.log" & pids+=($!)
  eval "pid_$f=\$!"
done
for p in $up $ngx_proxy $ngx_limit $hap $fg_mem $fg_redis $fg_flood $fg_keys $redis_port; do wait_port "$p"; done

cat >"$work/flood.lua" <<'LUA'
wrk.headers["X-Client"] = "flooder"
LUA
cat >"$work/keys.lua" <<'LUA'
math.randomseed(42)
request = function()
  return wrk.format("GET", "/", { ["X-Client"] = "client-" .. math.random(1, 100000) })
end
LUA

hz=$(getconf CLK_TCK)
# CPU ticks (user + system) of a process and its children (nginx's workers).
tree_ticks() {
  local total=0 p
  for p in "$1" $(pgrep -P "$1" || true); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

# run_wrk PORT [script] [server_pid]
#   -> "rps p50_ms p99_ms non2xx total server_cpu_us redis_cpu_us" (CPU per request)
run_wrk() {
  local args=(-t1 -c"$connections" -d"${duration}s" --latency)
  [ -n "${2:-}" ] && args+=(-s "$2")
  local s0 r0 s1 r1
  s0=$(tree_ticks "${3:-$$}"); r0=$(tree_ticks "$redis_pid")
  $load_cpu wrk "${args[@]}" "http://127.0.0.1:$1/" >"$work/wrk.out"
  s1=$(tree_ticks "${3:-$$}"); r1=$(tree_ticks "$redis_pid")
  python3 - "$work/wrk.out" "$((s1 - s0))" "$((r1 - r0))" "$hz" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def ms(v):
    m = re.match(r"([\d.]+)(\w+)", v)
    if not m:
        sys.exit(f"cannot read a latency from wrk's output:\n{text}")
    n, unit = m.groups()
    return float(n) * {"us": 0.001, "ms": 1, "s": 1000, "m": 60000}[unit]
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
# Anchored to the start of a line: the Req/Sec line can end in "50%" too.
p50 = ms(re.search(r"^\s*50%\s+(\S+)", text, re.M).group(1))
p99 = ms(re.search(r"^\s*99%\s+(\S+)", text, re.M).group(1))
m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
total = int(re.search(r"(\d+) requests in", text).group(1))
server, redis, hz = (int(x) for x in sys.argv[2:5])
per = lambda ticks: ticks / hz / max(1, total) * 1e6
print(rps, p50, p99, int(m.group(1)) if m else 0, total, round(per(server), 2), round(per(redis), 2))
PY
}
rss_kib() { awk '/VmRSS/{print $2}' "/proc/$1/status"; }
# Decision commands so far: FCALL (Redis 7+) or EVALSHA (older Redis).
decision_calls() { redis-cli -p "$redis_port" info commandstats | sed -n 's/^cmdstat_\(fcall\|evalsha\):calls=\([0-9]*\),.*/\2/p' | tr -d '\r' | awk '{s+=$1} END {print s+0}'; }

declare -A rps p50 p99 cpu rcpu note
record() { # key run_a run_b: averages two runs of one case
  read -r r1 l1 h1 n1 t1 c1 d1 <<<"$2"; read -r r2 l2 h2 n2 t2 c2 d2 <<<"$3"
  rps[$1]=$(python3 -c "print(round(($r1+$r2)/2))")
  cpu[$1]=$(python3 -c "print(round(($c1+$c2)/2, 1))")
  rcpu[$1]=$(python3 -c "print(round(($d1+$d2)/2, 1))")
  p50[$1]=$(python3 -c "print(round(($l1+$l2)/2, 2))")
  p99[$1]=$(python3 -c "print(round(($h1+$h2)/2, 2))")
  last_non2xx=$((n1 + n2)); last_total=$((t1 + t2))
}
case_run() { # key port script server_pid: two runs back to back
  local a b
  a=$(run_wrk "$2" "$3" "$4"); b=$(run_wrk "$2" "$3" "$4")
  record "$1" "$a" "$b"
}

echo "warming up..." >&2
for p in $up $ngx_proxy $fg_mem $fg_redis; do $load_cpu wrk -t1 -c16 -d2s "http://127.0.0.1:$p/" >/dev/null; done

# Rows 1 to 6, whose ratios are the targets: one run of each in order, then
# one of each in reverse order, so that a machine getting faster or slower
# during the run (a shared VM does) weighs on every row alike.
declare -A port=([direct]=$up [ngx_proxy]=$ngx_proxy [ngx_limit]=$ngx_limit [haproxy]=$hap [fg_mem]=$fg_mem [fg_redis]=$fg_redis)
declare -A server_pid=([direct]=$up_pid [ngx_proxy]=$ngx_pid [ngx_limit]=$ngx_pid [haproxy]=$hap_pid [fg_mem]=$pid_mem [fg_redis]=$pid_redis)
interleaved=(direct ngx_proxy ngx_limit haproxy fg_mem fg_redis)
declare -A first
redis_calls=0; redis_requests=0
for pass in 1 2; do
  order=("${interleaved[@]}")
  [ "$pass" = 2 ] && mapfile -t order < <(printf '%s\n' "${interleaved[@]}" | tac)
  for key in "${order[@]}"; do
    before=$(decision_calls); out=$(run_wrk "${port[$key]}" "" "${server_pid[$key]}"); after=$(decision_calls)
    if [ "$key" = fg_redis ]; then
      read -r _ _ _ _ total _ _ <<<"$out"
      redis_calls=$((redis_calls + after - before)); redis_requests=$((redis_requests + total))
    fi
    if [ "$pass" = 1 ]; then first[$key]=$out; else record "$key" "${first[$key]}" "$out"; fi
  done
done
note[fg_redis]="$(python3 -c "print(f'{$redis_calls/max(1,$redis_requests):.2f} Redis commands (FCALL) per request')")"
conns=$(redis-cli -p "$redis_port" client list | grep -cE "cmd=(fcall|evalsha)" || true)
note[fg_redis]="${note[fg_redis]}, $conns Redis connections for $connections concurrent requests"
before=$(decision_calls); case_run fg_flood "$fg_flood" "$work/flood.lua" "$pid_flood"; after=$(decision_calls)
note[fg_flood]="$((last_total - last_non2xx)) of $last_total admitted (the limit is 10 a minute), the rest answered 429; $((after - before)) Redis calls in 2 × ${duration}s"
rss0=$(rss_kib "$pid_keys"); case_run fg_keys "$fg_keys" "$work/keys.lua" "$pid_keys"; rss1=$(rss_kib "$pid_keys")
case_run fg_keys_again "$fg_keys" "$work/keys.lua" "$pid_keys"; rss2=$(rss_kib "$pid_keys")
keys=$(redis-cli -p "$redis_port" dbsize | tr -d '\r')
note[fg_keys]="RSS ${rss0} → ${rss1} → ${rss2} KiB over two more passes; $keys keys in Redis"

# p99 at half of the proxies' own maximum, with a fixed request rate (hey -q).
half_p99() { # port rps
  local per=$(( $2 / 2 / 16 )); [ "$per" -lt 1 ] && per=1
  $load_cpu hey -z "${duration}s" -c 16 -q "$per" "http://127.0.0.1:$1/" >"$work/hey.out"
  python3 - "$work/hey.out" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
print(round(float(re.search(r"99%\s+in\s+([\d.]+)\s+secs", t).group(1)) * 1000, 2))
PY
}
half_ngx=$(half_p99 "$ngx_proxy" "${rps[ngx_proxy]}")
half_fg=$(half_p99 "$fg_redis" "${rps[fg_redis]}")

# Redis: script calls per second pipelined vs one per round trip.
# floodgate loaded its function library into this Redis; call it directly.
fn=$(redis-cli -p "$redis_port" function list | grep -o 'floodgate_decide_[0-9a-f]*' | head -1)
rb() { $load_cpu redis-benchmark -p "$redis_port" -n 100000 -c 1 -P "$1" -q fcall "$fn" 1 "bench:{k}:0" "" 1 "gcra 1000000000 1000 1000000000" | sed -n 's/.*: \([0-9.]*\) requests per second.*/\1/p' | tail -1; }
pipelined=$(rb 32); serial=$(rb 1)

ratio() { python3 -c "print(f'{$1/$2:.2f}×')"; }
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
{
  echo "# floodgate benchmark"
  echo
  echo "$(date -u +%Y-%m-%d), $(nproc) cores ($cpu), $(uname -sr); nginx $(nginx -v 2>&1 | sed 's/.*\///'), HAProxy $(haproxy -v | head -1 | awk '{print $3}'), Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'), wrk with 1 thread and $connections connections, ${duration} s per run, two runs per row (averaged; rows 1–6 in two passes, the second in reverse order)."
  echo "Server under test on CPU 0; load generator, upstream (nginx returning a fixed 200) and Redis on CPU 1."
  echo
  echo "| # | case | req/s | p50 ms | p99 ms | server CPU µs/req | Redis CPU µs/req | vs nginx proxy | vs nginx limit_req | notes |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
  row() {
    local redis=""; case $3 in fg_redis|fg_flood|fg_keys) redis=${rcpu[$3]} ;; esac
    echo "| $1 | $2 | ${rps[$3]} | ${p50[$3]} | ${p99[$3]} | ${cpu[$3]} | $redis | $(ratio "${rps[$3]}" "${rps[ngx_proxy]}") | $(ratio "${rps[$3]}" "${rps[ngx_limit]}") | ${note[$3]:-} |"
  }
  row 1 "direct to the upstream" direct
  row 2 "nginx reverse proxy (1 worker, upstream keepalive)" ngx_proxy
  row 3 "nginx \`limit_req\`, never triggers" ngx_limit
  row 4 "HAProxy stick table \`http_req_rate\`, never triggers" haproxy
  row 5 "floodgate, memory store, never triggers" fg_mem
  row 6 "floodgate, Redis store, never triggers" fg_redis
  row 7 "floodgate, Redis store, one client flooding" fg_flood
  row 8 "floodgate, Redis store, 100k distinct clients" fg_keys
  echo
  echo "- p99 at half of each one's maximum rate (hey, 16 connections, fixed rate): nginx proxy ${half_ngx} ms, floodgate with Redis ${half_fg} ms."
  echo "- The decision function (FCALL) through redis-benchmark: ${pipelined} calls/s pipelined (32 deep) vs ${serial} calls/s one per round trip ($(ratio "$pipelined" "$serial"))."
  # A store failure lets requests through (on_error = "allow"), which would
  # flatter the Redis rows: say so whenever the instances logged anything.
  warnings=$(grep -c ' WARN ' "$work/floodgate.log" || true)
  if [ "$warnings" = 0 ]; then
    echo "- floodgate logged no warnings (no store failures) during the run."
  else
    echo "- floodgate logged $warnings warnings during the run; the first: \`$(grep -m1 ' WARN ' "$work/floodgate.log" | cut -c1-400)\`"
  fi
} | tee "$work/results.md"
[ "${NO_RESULTS:-0}" = 1 ] || cp "$work/results.md" bench/latest-run.md
