#!/usr/bin/env bash
# Quick, reproducible figures for one node (not the full benchmark suite of issue 6):
#  1. drain: N pre-filled events (about 200-byte JSON payloads, 1,000 keys) to the file sink;
#  2. latency: single-row inserts, each its own transaction, at a steady rate while the relay
#     runs, read back from the relay's commit-to-confirm histogram.
# PostgreSQL runs durably (fsync on) in its own state directory.
#   scripts/bench-quick.sh [events] [latency-inserts]
# RELAY_ARGS adds options to the drain's relay (e.g. "--batch-size 1000"); latency-inserts 0
# skips the latency part. BENCHMARKS.md's batch-size sweep was run this way:
#   for b in 500 1000 2000; do RELAY_ARGS="--batch-size $b" scripts/bench-quick.sh 1000000 0; done
set -euo pipefail
cd "$(dirname "$0")/.."
EVENTS=${1:-200000}
INSERTS=${2:-2000}
export OUTBOX_TEST_STATE=${OUTBOX_BENCH_STATE:-/tmp/outbox-relay-bench} OUTBOX_TEST_SERVERS=postgres
export OUTBOX_TEST_PG_PORT=${OUTBOX_BENCH_PG_PORT:-54339} OUTBOX_PG_DURABLE=1
trap 'scripts/servers.sh stop' EXIT
# A server that did not start stops here (eval of partial exports would not).
exports=$(scripts/servers.sh start) || { echo "bench-quick.sh: the servers did not start (see above)" >&2; exit 1; }
eval "$exports"
cargo build --release -q -p outbox-relay
BIN=target/release/outbox-relay
ADMIN=$OUTBOX_TEST_DATABASE_URL
DB=${ADMIN%/*}/bench
WORK=$(mktemp -d)

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r); $(psql "$ADMIN" -Atc 'select version()' | cut -d, -f1)"

reset_db() {
  psql -q "$ADMIN" -c "DROP DATABASE IF EXISTS bench" -c "CREATE DATABASE bench" >/dev/null
  $BIN migrate --database-url "$DB" >/dev/null
}

# 1. Drain.
reset_db
psql -q "$DB" -c "INSERT INTO outbox (destination, partition_key, event_type, payload)
  SELECT 'orders', 'customer-' || (i % 1000), 'order.created',
         jsonb_build_object('order_id', i, 'customer', 'customer-' || (i % 1000), 'total', 99.95,
                            'currency', 'EUR', 'items', 3, 'note', repeat('x', 100))
    FROM generate_series(1, $EVENTS) i" >/dev/null
start=$(date +%s.%N)
/usr/bin/time -f "%e s wall, %U s user, %S s sys, %M KiB peak RSS" -o "$WORK/time" \
  $BIN run --drain --database-url "$DB" --sink "file:$WORK/events.jsonl" --http-addr "" --log-level warn ${RELAY_ARGS:-}
end=$(date +%s.%N)
lines=$(wc -l < "$WORK/events.jsonl")
awk -v n="$lines" -v s="$start" -v e="$end" 'BEGIN { printf "drain: %d events to the file sink in %.2f s = %.0f events/s\n", n, e - s, n / (e - s) }'
echo "drain: relay $(cat "$WORK/time")"

# 2. Latency at a steady rate.
if [ "$INSERTS" = 0 ]; then rm -rf "$WORK"; exit 0; fi
reset_db
$BIN run --database-url "$DB" --sink "file:$WORK/latency.jsonl" --http-addr 127.0.0.1:0 --log-format json > /dev/null 2> "$WORK/relay.log" &
relay=$!
for _ in $(seq 100); do grep -q '"addr"' "$WORK/relay.log" && break; sleep 0.05; done
addr=$(grep -o '"addr":"[^"]*' "$WORK/relay.log" | head -1 | cut -d'"' -f4)
for i in $(seq "$INSERTS"); do
  echo "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ('orders', 'k$((i % 100))', 't', '{\"i\": $i}');"
  if (( i % 20 == 0 )); then echo "SELECT pg_sleep(0.05);"; fi   # about 400 inserts/s
done | psql -q "$DB" >/dev/null
for _ in $(seq 200); do [ "$(wc -l < "$WORK/latency.jsonl")" -ge "$INSERTS" ] && break; sleep 0.05; done
curl -s "http://$addr/metrics" | grep '^outbox_commit_to_confirm_seconds' > "$WORK/histogram"
kill -TERM $relay; wait $relay || true
awk -v n="$INSERTS" '
  /_bucket/ { match($0, /le="[^"]*"/); le = substr($0, RSTART + 4, RLENGTH - 5); c[le] = $NF; order[++k] = le }
  /_sum/ { sum = $NF } /_count/ { count = $NF }
  END {
    printf "latency: %d single-row inserts at about 400/s, commit-to-confirm mean %.2f ms\n", count, 1000 * sum / count
    split("0.5 0.99 0.999", qs, " ")
    for (q in qs) { for (i = 1; i <= k; i++) if (c[order[i]] >= qs[q] * count) { printf "latency: p%s <= %s s (histogram bucket)\n", qs[q] * 100, order[i]; break } }
  }' "$WORK/histogram"
rm -rf "$WORK"
