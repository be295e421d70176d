#!/usr/bin/env bash
# Runs the untrusted-input property tests (path normalisation and client
# identification) with a large case count, bounded in time.
#   bench/fuzz.sh [cases] [seconds]     defaults: 2000000 cases, 600 s
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-2000000}
seconds=${2:-600}
start=$(date +%s)
FLOODGATE_FUZZ_CASES=$cases timeout "$seconds" \
  cargo test --release --locked --test untrusted_input -- --test-threads 2
echo "ran $cases cases per property in $(( $(date +%s) - start )) s"
