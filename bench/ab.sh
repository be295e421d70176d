#!/usr/bin/env bash
# CPU per proxied request of two floodgate builds, side by side: the memory
# and Redis rows of bench/run.sh for binary A and binary B, alternated
# (A B, then B A, ...) over several rounds so that drift in the machine's
# speed weighs on both alike. Per row it prints the medians of: floodgate's
# own CPU (user + system from /proc/PID/stat, its process alone) in µs per
# request, Redis's CPU per request, and requests per second.
#   bench/ab.sh BIN_A BIN_B [rounds] [seconds]     defaults: 5 rounds of 8 s
# With ADMIN=1 both run with an admin listener (which turns on the
# per-client counting behind /clients/top).
# To compare with an earlier commit:
#   git worktree add /tmp/before <commit>
#   (cd /tmp/before && CARGO_TARGET_DIR=/tmp/before-target cargo build --release)
#   cargo build --release
#   bench/ab.sh /tmp/before-target/release/floodgate target/release/floodgate
set -euo pipefail
a=$(realpath "$1"); b=$(realpath "$2"); rounds=${3:-5}; duration=${4:-8}
connections=${CONNECTIONS:-64}
for tool in nginx wrk redis-server python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool (see bench/run.sh)" >&2; exit 1; }
done
work=$(mktemp -d); pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$work"; }
trap cleanup EXIT
if [ "$(nproc)" -ge 2 ]; then server_cpu="taskset -c 0"; load_cpu="taskset -c 1"; else server_cpu=""; load_cpu=""; fi
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

up=$(port); redis_port=$(port)
mkdir -p "$work/up"
cat >"$work/up/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/up/nginx.pid; error_log $work/up/error.log;
events { worker_connections 4096; }
http { access_log off; server { listen 127.0.0.1:$up; keepalive_requests 1000000;
  location / { return 200 "ok\n"; } } }
CONF
$load_cpu nginx -c "$work/up/nginx.conf" -p "$work/up" & pids+=($!)
$load_cpu redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null & pids+=($!)
redis_pid=$!
wait_port "$redis_port"; wait_port "$up"

declare -A pid portof
for bin in a b; do
  for store in memory redis; do
    p=$(port); key="$bin-$store"; portof[$key]=$p
    {
      echo "[server]"; echo "listen = \"127.0.0.1:$p\""
      [ "${ADMIN:-0}" = 1 ] && echo "admin_listen = \"127.0.0.1:$(port)\""
      if [ "$store" = redis ]; then
        printf '[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:%s"\nkey_prefix = "ab-%s"\ntimeout = "100ms"\n' "$redis_port" "$key"
      fi
      printf '[[routes]]\nname = "api"\nupstream = "http://127.0.0.1:%s"\nlimits = [{ algorithm = "gcra", limit = 1000000000, window = "1s" }]\n' "$up"
    } >"$work/$key.toml"
    binary=$a; [ "$bin" = b ] && binary=$b
    FLOODGATE_LOG=warn $server_cpu "$binary" --config "$work/$key.toml" 2>>"$work/floodgate.log" & pids+=($!)
    pid[$key]=$!
  done
done
for key in "${!portof[@]}"; do wait_port "${portof[$key]}"; done
for key in "${!portof[@]}"; do $load_cpu wrk -t1 -c16 -d2s "http://127.0.0.1:${portof[$key]}/" >/dev/null; done

: >"$work/samples"
for round in $(seq "$rounds"); do
  order=(a-memory b-memory a-redis b-redis)
  [ $((round % 2)) = 0 ] && order=(b-memory a-memory b-redis a-redis)
  for key in "${order[@]}"; do
    c0=$(ticks "${pid[$key]}"); r0=$(ticks "$redis_pid")
    $load_cpu wrk -t1 -c"$connections" -d"${duration}s" "http://127.0.0.1:${portof[$key]}/" >"$work/wrk.out"
    c1=$(ticks "${pid[$key]}"); r1=$(ticks "$redis_pid")
    n=$(sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' "$work/wrk.out")
    bad=$(sed -n 's/^ *Non-2xx or 3xx responses: *\([0-9]*\)/\1/p' "$work/wrk.out"); bad=${bad:-0}
    [ "$bad" = 0 ] || { echo "$key: $bad answers were not 2xx" >&2; exit 1; }
    echo "$key $n $((c1 - c0)) $((r1 - r0))" >>"$work/samples"
    echo "round $round $key: $n requests" >&2
  done
done
python3 - "$work/samples" "$hz" "$duration" "$a" "$b" <<'PY'
import statistics, sys
samples, hz, duration, a, b = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
rows = {}
for line in open(samples):
    key, n, cpu, redis = line.split()
    n, cpu, redis = int(n), int(cpu), int(redis)
    rows.setdefault(key, []).append((cpu / hz / n * 1e6, redis / hz / n * 1e6, n / duration))
print(f"A = {a}\nB = {b}\n")
print("| row | floodgate CPU µs/req (median) | each round | Redis CPU µs/req | req/s |")
print("|---|---:|---|---:|---:|")
med = {}
for key in ["a-memory", "b-memory", "a-redis", "b-redis"]:
    r = rows[key]
    m = statistics.median(x[0] for x in r)
    med[key] = m
    each = " ".join(f"{x[0]:.2f}" for x in r)
    rc = statistics.median(x[1] for x in r) if key.endswith("redis") else None
    print(f"| {key} | {m:.2f} | {each} | {'' if rc is None else f'{rc:.2f}'} | {statistics.median(x[2] for x in r):.0f} |")
for store in ["memory", "redis"]:
    d = med[f"b-{store}"] - med[f"a-{store}"]
    print(f"\nB − A, {store}: {d:+.2f} µs per request")
PY
