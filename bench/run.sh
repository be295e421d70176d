#!/usr/bin/env bash
# Side-by-side benchmark: floodgate against nginx, an nginx + Lua + Redis
# limiter, HAProxy and the floor (bench/gateway: hyper's two HTTP/1.1 codecs
# and nothing else, and the same doing floodgate's job in the fewest lines)
# on this machine, in one run, judged on CPU per request.
#
# Installs what it needs from the distribution (nginx and its Lua module,
# haproxy, wrk, redis-server, stress-ng), starts every server on
# loopback, pins the server under test to CPU 0 and the load generator,
# upstream and Redis to CPU 1 when there are at least two cores, and stops
# everything it started.
#
# Rows 1 to 9 are measured in ROUNDS rounds of SECONDS each, alternated (each
# round in the reverse order of the one before), twice: on a quiet machine,
# and with a competing CPU load on both cores (`stress-ng --cpu 2` at nice
# 19, started and stopped here; LOADED=0 skips that phase). Each cell is the
# median over the rounds. CPU per request is user + system time from
# /proc/PID/stat of the server's processes (nginx's workers included), and
# of Redis, divided by the requests wrk completed; context switches come
# from /proc/PID/task/*/status, syscalls from `perf stat` in a separate pass
# (when perf can count them), so that counting them does not weigh on the
# CPU figures. Rows 10 and 11 (a flooding client, 100 000 clients) run once,
# quiet.
#
# Prints a markdown table and the targets of bench/RESULTS.md met or
# missed; also written to bench/latest-run.md unless NO_RESULTS=1.
#   bench/run.sh [seconds]        default 8; ROUNDS (default 3), CONNECTIONS (64)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/same_job.sh
root=$(pwd)
duration=${1:-8}
rounds=${ROUNDS:-3}
connections=${CONNECTIONS:-64}
loaded=${LOADED:-1}

lua_module=/usr/lib/nginx/modules/ngx_http_lua_module.so
need=()
for tool in nginx haproxy wrk redis-server redis-cli python3 stress-ng; do
  command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
[ -e "$lua_module" ] || need+=(lua)
if [ ${#need[@]} -gt 0 ]; then
  pkgs=()
  for t in "${need[@]}"; do
    case $t in
      redis-server|redis-cli) pkgs+=(redis-server redis-tools) ;;
      lua) pkgs+=(libnginx-mod-http-lua lua-resty-core) ;;
      *) pkgs+=("$t") ;;
    esac
  done
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
cargo build --release --locked -q
bin=$root/target/release/floodgate
cargo build --release --locked -q --manifest-path bench/gateway/Cargo.toml
gateway=$root/bench/gateway/target/release/bare-gateway

work=$(mktemp -d)
pids=()
stress_pid=""
cleanup() {
  [ -n "$stress_pid" ] && kill "$stress_pid" 2>/dev/null
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

up=$(port); ngx_proxy=$(port); ngx_limit=$(port); ngx_lua=$(port); hap=$(port)
fg_mem=$(port); fg_redis=$(port); fg_flood=$(port); fg_keys=$(port); redis_port=$(port); gw=$(port); job=$(port)

# --- the upstream: a fixed 200 from nginx, on the load generator's core ---
mkdir -p "$work/up" "$work/proxy" "$work/lua"
cat >"$work/up/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/up/nginx.pid; error_log $work/up/error.log;
events { worker_connections 4096; }
http { access_log off; server { listen 127.0.0.1:$up; keepalive_requests 1000000;
  location / { return 200 "ok\n"; } } }
CONF
$load_cpu nginx -c "$work/up/nginx.conf" -p "$work/up" & pids+=($!)
up_pid=$!

# --- Redis, shared by floodgate and the nginx + Lua row ---
$load_cpu redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null & pids+=($!)
redis_pid=$!
# Up before floodgate starts, so no instance begins with Redis unreachable
# (it would, by design, start with its breaker open and let requests
# through until it finds Redis).
wait_port "$redis_port"

# --- nginx as a proxy, plain, and as operators run it for a rate-limited
# API: limit_req that never triggers, the client's Host passed on and the
# upstream told who asked (X-Forwarded-For, -Proto, -Host), as floodgate
# does by default ---
{
  echo "worker_processes 1; daemon off; pid $work/proxy/nginx.pid; error_log $work/proxy/error.log;"
  echo "events { worker_connections 4096; }"
  echo "http { access_log off;"
  same_job_nginx_http "$up" 128
  echo "  server { listen 127.0.0.1:$ngx_proxy; keepalive_requests 1000000;"
  echo '    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } }'
  echo "  server { listen 127.0.0.1:$ngx_limit; keepalive_requests 1000000;"
  same_job_nginx_location
  echo "  } }"
} >"$work/proxy/nginx.conf"
$server_cpu nginx -c "$work/proxy/nginx.conf" -p "$work/proxy" & pids+=($!)
ngx_pid=$!

# --- nginx + Lua + Redis: what Kong's Redis policy and lua-resty-redis do.
# One EVALSHA of a fixed-window script per request, in RESP over a cosocket
# kept alive between requests; a count over the limit is a 429. ---
sha=$(redis-cli -p "$redis_port" script load \
  "local n = redis.call('INCR', KEYS[1]) if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end return n" | tr -d '\r')
cat >"$work/lua/nginx.conf" <<CONF
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module $lua_module;
worker_processes 1; daemon off; pid $work/lua/nginx.pid; error_log $work/lua/error.log;
events { worker_connections 4096; }
http { access_log off;
  upstream app { server 127.0.0.1:$up; keepalive 128; keepalive_requests 1000000; }
  server { listen 127.0.0.1:$ngx_lua; keepalive_requests 1000000;
    location / {
      access_by_lua_block {
        local sock = ngx.socket.tcp()
        sock:settimeout(100)
        local ok, err = sock:connect("127.0.0.1", $redis_port)
        if not ok then ngx.log(ngx.ERR, "redis: ", err) return ngx.exit(500) end
        local key = "ngxlua:" .. ngx.var.remote_addr
        ok, err = sock:send({"*5\r\n\$7\r\nEVALSHA\r\n\$40\r\n$sha\r\n\$1\r\n1\r\n\$",
          #key, "\r\n", key, "\r\n\$4\r\n1000\r\n"})
        if not ok then ngx.log(ngx.ERR, "redis: ", err) return ngx.exit(500) end
        local line
        line, err = sock:receive()
        if not line then ngx.log(ngx.ERR, "redis: ", err) return ngx.exit(500) end
        sock:setkeepalive(10000, 128)
        if line:byte(1) ~= 58 then ngx.log(ngx.ERR, "redis: ", line) return ngx.exit(500) end
        if tonumber(line:sub(2)) > 1000000000 then return ngx.exit(429) end
      }
      proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
CONF
$server_cpu nginx -c "$work/lua/nginx.conf" -p "$work/lua" & pids+=($!)
lua_pid=$!

# --- HAProxy with a stick table that never triggers, telling the upstream
# who asked as floodgate does ---
same_job_haproxy "$hap" "$up" >"$work/haproxy.cfg"
$server_cpu haproxy -f "$work/haproxy.cfg" -db >/dev/null 2>&1 & pids+=($!)
hap_pid=$!

# --- the floor: hyper's server and client codecs, one upstream connection
# per client connection, nothing else ---
$server_cpu "$gateway" "127.0.0.1:$gw" "127.0.0.1:$up" & pids+=($!)
gw_pid=$!

# --- the same gateway doing floodgate's job in the fewest lines: a GCRA
# decision per address, hop-by-hop fields off, X-Forwarded-*, the
# upstream's deadline, RateLimit fields (bench/gateway, --same-job) ---
$server_cpu "$gateway" "127.0.0.1:$job" "127.0.0.1:$up" --same-job & pids+=($!)
job_pid=$!

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
for p in $up $ngx_proxy $ngx_limit $ngx_lua $hap $gw $job $fg_mem $fg_redis $fg_flood $fg_keys $redis_port; do wait_port "$p"; done

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
# The processes of a server: itself and its children (nginx's workers).
tree() { echo "$1" $(pgrep -P "$1" || true); }
# CPU ticks (user + system) of a server's processes.
tree_ticks() {
  local total=0 p
  for p in $(tree "$1"); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}
# Context switches (voluntary and not) of every thread of a server.
tree_switches() {
  local p
  for p in $(tree "$1"); do cat /proc/"$p"/task/*/status 2>/dev/null; done |
    awk '/ctxt_switches/ {s += $2} END {print s + 0}'
}
# Decision commands so far: FCALL (Redis 7+) or EVALSHA (older Redis).
decision_calls() { redis-cli -p "$redis_port" info commandstats | sed -n 's/^cmdstat_\(fcall\|evalsha\):calls=\([0-9]*\),.*/\2/p' | tr -d '\r' | awk '{s+=$1} END {print s+0}'; }

# sample PHASE ROW PORT SERVER_PID [wrk script]: one wrk run, one line in
# $work/samples: phase row req/s p50 p99 non2xx requests server_ticks
# redis_ticks switches redis_calls
sample() {
  local args=(-t1 -c"$connections" -d"${duration}s" --latency)
  [ -n "${5:-}" ] && args+=(-s "$5")
  local s0 r0 x0 c0 s1 r1 x1 c1
  s0=$(tree_ticks "$4"); r0=$(tree_ticks "$redis_pid"); x0=$(tree_switches "$4"); c0=$(decision_calls)
  $load_cpu wrk "${args[@]}" "http://127.0.0.1:$3/" >"$work/wrk.out"
  s1=$(tree_ticks "$4"); r1=$(tree_ticks "$redis_pid"); x1=$(tree_switches "$4"); c1=$(decision_calls)
  python3 - "$work/wrk.out" "$1" "$2" "$((s1 - s0))" "$((r1 - r0))" "$((x1 - x0))" "$((c1 - c0))" >>"$work/samples" <<'PY'
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
print(*sys.argv[2:4], rps, p50, p99, int(m.group(1)) if m else 0, total, *sys.argv[4:8])
PY
  tail -1 "$work/samples" | awk '{printf "  %s %s: %d req/s\n", $1, $2, $3}' >&2
}

declare -A port=([direct]=$up [ngx_proxy]=$ngx_proxy [ngx_limit]=$ngx_limit [ngx_lua]=$ngx_lua [haproxy]=$hap [gateway]=$gw [job]=$job [fg_mem]=$fg_mem [fg_redis]=$fg_redis)
declare -A server_pid=([direct]=$up_pid [ngx_proxy]=$ngx_pid [ngx_limit]=$ngx_pid [ngx_lua]=$lua_pid [haproxy]=$hap_pid [gateway]=$gw_pid [job]=$job_pid [fg_mem]=$pid_mem [fg_redis]=$pid_redis)
rows=(direct ngx_proxy ngx_limit ngx_lua haproxy gateway job fg_mem fg_redis)

echo "warming up..." >&2
for key in "${rows[@]}"; do $load_cpu wrk -t1 -c16 -d2s "http://127.0.0.1:${port[$key]}/" >/dev/null; done

: >"$work/samples"
phase() { # quiet | loaded
  local round order
  for round in $(seq "$rounds"); do
    order=("${rows[@]}")
    [ $((round % 2)) = 0 ] && mapfile -t order < <(printf '%s\n' "${rows[@]}" | tac)
    for key in "${order[@]}"; do sample "$1" "$key" "${port[$key]}" "${server_pid[$key]}"; done
  done
}
echo "quiet: $rounds rounds of ${#rows[@]} rows, ${duration} s each" >&2
phase quiet
if [ "$loaded" = 1 ]; then
  # Every core busy with lower-priority work, as on a shared node: the
  # servers win the CPU when they want it, but each wake-up may find it
  # taken by another task and wait for the scheduler.
  nice -n 19 stress-ng --cpu "$(nproc)" --quiet & stress_pid=$!
  sleep 2
  echo "loaded: the same, with stress-ng --cpu $(nproc) at nice 19" >&2
  phase loaded
  kill "$stress_pid"; wait "$stress_pid" 2>/dev/null || true; stress_pid=""
  sleep 1
fi

# Syscalls per request, counted by the kernel's tracepoint in one more run
# per row (apart from the CPU figures, which counting would inflate).
: >"$work/syscalls"
if perf stat -e raw_syscalls:sys_enter -- true >/dev/null 2>&1; then
  for key in ngx_proxy ngx_limit ngx_lua haproxy gateway job fg_mem fg_redis; do
    targets=$(tree "${server_pid[$key]}" | tr ' ' ',')
    perf stat -x, -e raw_syscalls:sys_enter -p "$targets" -o "$work/perf.out" -- sleep 3 &
    perf_pid=$!
    $load_cpu wrk -t1 -c"$connections" -d3s "http://127.0.0.1:${port[$key]}/" >"$work/wrk.out"
    wait "$perf_pid" || true
    n=$(sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' "$work/wrk.out")
    s=$(grep raw_syscalls "$work/perf.out" | cut -d, -f1)
    echo "$key $s $n" >>"$work/syscalls"
  done
fi

# Rows 10 and 11, once, quiet.
: >"$work/extra"
before=$(decision_calls)
sample quiet fg_flood "$fg_flood" "$pid_flood" "$work/flood.lua"
sample quiet fg_flood "$fg_flood" "$pid_flood" "$work/flood.lua"
after=$(decision_calls)
echo "flood_calls $((after - before))" >>"$work/extra"
echo "rss0 $(awk '/VmRSS/{print $2}' "/proc/$pid_keys/status")" >>"$work/extra"
sample quiet fg_keys "$fg_keys" "$pid_keys" "$work/keys.lua"
echo "rss1 $(awk '/VmRSS/{print $2}' "/proc/$pid_keys/status")" >>"$work/extra"
sample quiet fg_keys "$fg_keys" "$pid_keys" "$work/keys.lua"
echo "rss2 $(awk '/VmRSS/{print $2}' "/proc/$pid_keys/status")" >>"$work/extra"
echo "keys $(redis-cli -p "$redis_port" dbsize | tr -d '\r')" >>"$work/extra"
echo "connections $(redis-cli -p "$redis_port" client list | grep -cE "cmd=(fcall|evalsha)" || true)" >>"$work/extra"
# Store failures and the like; not the startup note that a loopback
# listener is unreachable from outside, which a benchmark run inside a
# container gets by design.
grep ' WARN ' "$work/floodgate.log" | grep -v 'loopback address inside a container' >"$work/warnings" || true
warnings=$(wc -l <"$work/warnings")
echo "warnings $warnings" >>"$work/extra"
[ "$warnings" = 0 ] || head -1 "$work/warnings" | cut -c1-400 >"$work/first-warning"
grep -q '\[error\]' "$work/lua/error.log" && grep -m1 '\[error\]' "$work/lua/error.log" >"$work/lua-error"

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
{
  echo "# floodgate benchmark"
  echo
  echo "$(date -u +%Y-%m-%d), $(nproc) cores ($cpu), $(uname -sr); nginx $(nginx -v 2>&1 | sed 's/.*\///'), HAProxy $(haproxy -v | head -1 | awk '{print $3}'), Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'); wrk with 1 thread and $connections connections; $rounds alternated rounds of ${duration} s per row and phase, medians."
  echo "Server under test on CPU 0; load generator, upstream (nginx returning a fixed 200) and Redis on CPU 1. Loaded: \`stress-ng --cpu $(nproc)\` at nice 19 beside them."
  echo
  python3 - "$work/samples" "$work/syscalls" "$work/extra" "$hz" "$loaded" <<'PY'
import statistics, sys
samples, syscalls, extra, hz, loaded = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
rows = {}
for line in open(samples):
    phase, row, rps, p50, p99, bad, n, ticks, rticks, switches, calls = line.split()
    n = int(n)
    rows.setdefault((phase, row), []).append(dict(
        rps=float(rps), p50=float(p50), p99=float(p99), bad=int(bad), n=n,
        cpu=int(ticks) / hz / n * 1e6, redis=int(rticks) / hz / n * 1e6,
        switches=int(switches) / n, calls=int(calls) / n))
sys_per = {}
for line in open(syscalls):
    row, s, n = line.split()
    if s.isdigit() and int(n) > 0:
        sys_per[row] = int(s) / int(n)
ex = dict(line.split(None, 1) for line in open(extra))
def med(phase, row, field):
    return statistics.median(s[field] for s in rows[(phase, row)])
uses_redis = {"ngx_lua", "fg_redis", "fg_flood", "fg_keys"}
names = [
    ("direct", "direct to the upstream"),
    ("ngx_proxy", "nginx reverse proxy (1 worker, upstream keepalive)"),
    ("ngx_limit", "nginx `limit_req`, never triggers, `X-Forwarded-*` and `Host`"),
    ("ngx_lua", "nginx + Lua, one `EVALSHA` per request over a kept-alive cosocket"),
    ("haproxy", "HAProxy stick table `http_req_rate`, never triggers, `X-Forwarded-*`"),
    ("gateway", "bare hyper gateway (the floor: hyper's two codecs, nothing else)"),
    ("job", "the same gateway doing floodgate's job in the fewest lines"),
    ("fg_mem", "floodgate, memory store, never triggers"),
    ("fg_redis", "floodgate, Redis store, never triggers"),
]
def total(phase, row):
    return med(phase, row, "cpu") + (med(phase, row, "redis") if row in uses_redis else 0)
phases = ["quiet"] + (["loaded"] if loaded else [])
print("| # | case | phase | server CPU µs/req | Redis CPU µs/req | total µs/req | req/s | p50 ms | p99 ms | context switches/req | syscalls/req | Redis calls/req |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for i, (row, name) in enumerate(names, 1):
    for phase in phases:
        r = rows[(phase, row)]
        redis = f"{med(phase, row, 'redis'):.2f}" if row in uses_redis else ""
        calls = f"{med(phase, row, 'calls'):.3f}" if row in uses_redis else ""
        sc = f"{sys_per[row]:.2f}" if phase == "quiet" and row in sys_per else ""
        print(f"| {i} | {name} | {phase} | {med(phase, row, 'cpu'):.2f} | {redis} | {total(phase, row):.2f} | "
              f"{med(phase, row, 'rps'):.0f} | {med(phase, row, 'p50'):.2f} | {med(phase, row, 'p99'):.2f} | "
              f"{med(phase, row, 'switches'):.2f} | {sc} | {calls} |")
flood = rows[("quiet", "fg_flood")]
admitted = sum(s["n"] - s["bad"] for s in flood)
print(f"| 10 | floodgate, Redis store, one client flooding | quiet | {med('quiet', 'fg_flood', 'cpu'):.2f} | "
      f"{med('quiet', 'fg_flood', 'redis'):.2f} | | {med('quiet', 'fg_flood', 'rps'):.0f} | | | | | "
      f"{ex['flood_calls'].strip()} calls in all |")
print(f"| 11 | floodgate, Redis store, 100 000 distinct clients | quiet | {med('quiet', 'fg_keys', 'cpu'):.2f} | "
      f"{med('quiet', 'fg_keys', 'redis'):.2f} | | {med('quiet', 'fg_keys', 'rps'):.0f} | | | | | |")
print()
bad = {k: sum(s["bad"] for s in v) for k, v in rows.items() if k[1] not in ("fg_flood",)}
print(f"- Row 10: {admitted} of {sum(s['n'] for s in flood)} requests admitted (the limit is 10 a minute), "
      f"the rest answered 429; {ex['flood_calls'].strip()} Redis calls in 2 × the run.")
print(f"- Row 11: RSS {ex['rss0'].strip()} → {ex['rss1'].strip()} → {ex['rss2'].strip()} KiB over two passes; "
      f"{ex['keys'].strip()} keys in Redis; {ex['connections'].strip()} Redis connections in use by the floodgate instances.")
wrong = {f"{k[0]} {k[1]}": v for k, v in bad.items() if v}
print(f"- Answers other than 2xx in rows 1–9: {wrong or 'none'}.")
w = ex["warnings"].strip()
print("- floodgate logged no warnings (no store failures) during the run." if w == "0"
      else f"- floodgate logged {w} warnings during the run.")
print()
print("Targets (CPU per request, same run):")
def line(ok, text):
    print(f"- {'met' if ok else '**missed**'}: {text}")
for phase in phases:
    m, l = med(phase, "fg_mem", "cpu"), med(phase, "ngx_limit", "cpu")
    line(m <= l, f"{phase}: floodgate memory store {m:.2f} µs ≤ nginx `limit_req` {l:.2f} µs")
m, r = med("quiet", "fg_mem", "cpu"), med("quiet", "fg_redis", "cpu")
line(r <= m + 1.5, f"quiet: floodgate Redis store's own {r:.2f} µs ≤ memory store's {m:.2f} + 1.5 µs")
t, p = total("quiet", "fg_redis"), med("quiet", "ngx_proxy", "cpu")
line(t <= 1.3 * p, f"quiet: floodgate + Redis {t:.2f} µs ≤ 1.3 × nginx proxy {p:.2f} µs = {1.3 * p:.2f} µs ({t / p:.2f}×)")
g = med("quiet", "gateway", "cpu")
line(m <= 1.10 * g, f"quiet: floodgate memory store {m:.2f} µs ≤ 1.10 × bare hyper gateway {g:.2f} µs = {1.10 * g:.2f} µs ({m / g:.2f}×)")
line(m <= 1.20 * p, f"quiet: floodgate memory store {m:.2f} µs ≤ 1.20 × nginx proxy {p:.2f} µs = {1.20 * p:.2f} µs ({m / p:.2f}×)")
line(t <= 1.35 * p, f"quiet: floodgate + Redis {t:.2f} µs ≤ 1.35 × nginx proxy = {1.35 * p:.2f} µs")
# Issue 48: beside nginx and HAProxy doing the same job (rows 3 and 5).
for phase in phases:
    fm, nl, hp = med(phase, "fg_mem", "cpu"), med(phase, "ngx_limit", "cpu"), med(phase, "haproxy", "cpu")
    line(fm <= 1.25 * nl, f"{phase}: floodgate memory store {fm:.2f} µs ≤ 1.25 × nginx doing the same job {nl:.2f} µs = {1.25 * nl:.2f} µs ({fm / nl:.2f}×)")
    line(fm < hp, f"{phase}: floodgate memory store {fm:.2f} µs < HAProxy doing the same job {hp:.2f} µs ({fm / hp:.2f}×)")
    jb = med(phase, "job", "cpu")
    print(f"- beside: {phase}: the hyper gateway doing the same job {jb:.2f} µs ({jb / nl:.2f}× nginx, {jb / hp:.2f}× HAProxy); "
          f"floodgate memory store {fm / jb:.2f}× it")
if loaded:
    mr = med("loaded", "fg_mem", "cpu") / m
    gr = med("loaded", "gateway", "cpu") / g
    line(mr <= gr + 0.05, f"loaded: floodgate memory store rose {100 * (mr - 1):+.0f} %, "
         f"the bare hyper gateway {100 * (gr - 1):+.0f} % (allowed: its rise + 5 points)")
    fr = total("loaded", "fg_redis") / total("quiet", "fg_redis")
    nr = med("loaded", "ngx_proxy", "cpu") / med("quiet", "ngx_proxy", "cpu")
    line(fr <= nr, f"loaded: floodgate + Redis rose {100 * (fr - 1):+.0f} % "
         f"({total('quiet', 'fg_redis'):.2f} → {total('loaded', 'fg_redis'):.2f} µs), "
         f"nginx proxy {100 * (nr - 1):+.0f} %")
print()
print("Each round (server CPU µs/req):")
for phase in phases:
    for row, _ in names:
        print(f"- {phase} {row}: " + " ".join(f"{s['cpu']:.2f}" for s in rows[(phase, row)]))
PY
  [ -e "$work/first-warning" ] && echo "- floodgate's first warning: \`$(cat "$work/first-warning")\`"
  [ -e "$work/lua-error" ] && echo "- nginx + Lua logged an error: \`$(cut -c1-300 "$work/lua-error")\`"
  true
} | tee "$work/results.md"
[ "${NO_RESULTS:-0}" = 1 ] || cp "$work/results.md" bench/latest-run.md
