#!/usr/bin/env bash
# The quickstart: PostgreSQL and NATS JetStream started locally (Debian packages, as the
# tests do), the outbox migrated, the relay running, and a demo writer whose events you see
# arrive at a NATS subscriber, live.
#
#   scripts/quickstart.sh              # until Ctrl-C; the dashboard is at http://127.0.0.1:2259/
#   scripts/quickstart.sh --events 20  # writes 20 events, waits for all 20 to arrive, exits 0
#
# Everything lives in $OUTBOX_QUICKSTART_STATE (default /tmp/outbox-relay-quickstart) and
# listens on 127.0.0.1 only: PostgreSQL on $OUTBOX_QUICKSTART_PG_PORT (54349), NATS on
# $OUTBOX_QUICKSTART_NATS_PORT (54242, monitoring on $OUTBOX_QUICKSTART_NATS_MONITOR_PORT, the
# next one), the relay's HTTP server on $OUTBOX_QUICKSTART_HTTP
# (default 127.0.0.1:2259). Everything started is stopped on exit.
# OUTBOX_QUICKSTART_BIN picks the relay binary (default: a release build, made if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

events=0
if [[ ${1:-} == --events ]]; then
  events=${2:?usage: $0 [--events N]}
fi
export OUTBOX_TEST_STATE=${OUTBOX_QUICKSTART_STATE:-/tmp/outbox-relay-quickstart}
export OUTBOX_TEST_PG_PORT=${OUTBOX_QUICKSTART_PG_PORT:-54349}
export OUTBOX_TEST_NATS_PORT=${OUTBOX_QUICKSTART_NATS_PORT:-54242}
export OUTBOX_TEST_NATS_MONITOR_PORT=${OUTBOX_QUICKSTART_NATS_MONITOR_PORT:-$((OUTBOX_TEST_NATS_PORT + 1))}
export OUTBOX_TEST_SERVERS="postgres nats"
http=${OUTBOX_QUICKSTART_HTTP:-127.0.0.1:2259}
relay=${OUTBOX_QUICKSTART_BIN:-target/release/outbox-relay}
# Bold only on a terminal.
if [[ -t 2 ]]; then bold=$'\033[1m' plain=$'\033[0m'; else bold='' plain=''; fi
say() { printf '%squickstart:%s %s\n' "$bold" "$plain" "$*" >&2; }

if [[ ! -x $relay ]]; then
  say "building the relay (release, NATS sink only; a few minutes the first time)"
  cargo build --release --locked -p outbox-relay --no-default-features --features nats >&2
  relay=target/release/outbox-relay
fi

pids=()
subscriber=$(mktemp)
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -f "$subscriber"
  scripts/servers.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "starting PostgreSQL and NATS JetStream on 127.0.0.1 (state in $OUTBOX_TEST_STATE)"
# A server that did not start stops here (eval of partial exports would not).
exports=$(scripts/servers.sh start) || { say "the servers did not start (see above)"; exit 1; }
eval "$exports"
admin=$OUTBOX_TEST_DATABASE_URL
database=${admin%/postgres}/quickstart
PGOPTIONS='-c client_min_messages=warning' \
  psql -q "$admin" -c 'DROP DATABASE IF EXISTS quickstart' -c 'CREATE DATABASE quickstart' >/dev/null

say "migrating: the outbox, its dead letters, the nodes and partitions tables, the NOTIFY trigger"
"$relay" migrate --database-url "$database" >&2

# A stream that keeps demo.* (the relay publishes with JetStream, and waits for its ack),
# and a subscriber that prints every message as it arrives: NATS's own protocol, spoken
# by Python's standard library, so nothing more is installed.
cat > "$subscriber" <<'PY'
import json, socket, sys
host, port, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port))
f = s.makefile("rb")
f.readline()  # INFO
stream = json.dumps({"name": "DEMO", "subjects": ["demo.>"]}).encode()
s.sendall(b'CONNECT {"verbose":false,"headers":true}\r\n'
          b"SUB demo.> 1\r\nSUB _INBOX.quickstart 2\r\n"
          + b"PUB $JS.API.STREAM.CREATE.DEMO _INBOX.quickstart %d\r\n%s\r\nPING\r\n" % (len(stream), stream))
seen = 0
while want == 0 or seen < want:
    line = f.readline()
    if not line:
        break
    if line.startswith(b"PING"):
        s.sendall(b"PONG\r\n")
        continue
    if line.startswith(b"PONG"):
        print("subscribed to demo.> (JetStream stream DEMO)", file=sys.stderr, flush=True)
        continue
    if not (line.startswith(b"MSG") or line.startswith(b"HMSG")):
        continue
    parts = line.split()
    size = int(parts[-1])
    body = f.read(size + 2)[:-2]
    if parts[2] == b"2":
        continue  # the stream API's answer
    headers = b""
    if line.startswith(b"HMSG"):
        split = int(parts[-2])
        headers, body = body[:split], body[split:]
    event_id = next((h.split(b":", 1)[1].strip().decode() for h in headers.split(b"\r\n")
                     if h.lower().startswith(b"nats-msg-id:")), "?")
    seen += 1
    print(f"received  {parts[1].decode():<14} id {event_id}  {body.decode()}", flush=True)
PY
python3 "$subscriber" 127.0.0.1 "$OUTBOX_TEST_NATS_PORT" "$events" &
sub=$!
pids+=("$sub")

say "starting the relay: $relay run --sink $OUTBOX_TEST_NATS_URL (log in $OUTBOX_TEST_STATE/relay.log)"
"$relay" run --database-url "$database" --sink "$OUTBOX_TEST_NATS_URL" --http-addr "$http" \
  2>"$OUTBOX_TEST_STATE/relay.log" &
relay_pid=$!
pids+=("$relay_pid")
until "$relay" health --http-addr "$http" >/dev/null 2>&1; do
  if ! kill -0 "$relay_pid" 2>/dev/null; then
    say "the relay stopped; its log:"
    tail -20 "$OUTBOX_TEST_STATE/relay.log" >&2
    exit 1
  fi
  sleep 0.1
done
say "dashboard and metrics: http://$http/  (http://$http/metrics)"

say "the demo writer inserts an order event every half second, in its own transaction"
n=0
while [[ $events == 0 || $n -lt $events ]]; do
  n=$((n + 1))
  psql -q "$database" -c "BEGIN;
    INSERT INTO outbox (destination, partition_key, event_type, payload)
    VALUES ('demo.orders', 'order-$((n % 3))', 'order.created', '{\"order\": $n}');
    COMMIT;" >/dev/null
  echo "wrote     demo.orders    order $n (key order-$((n % 3)))"
  sleep 0.5
done
# With --events: done once the subscriber has seen them all.
for _ in $(seq 600); do
  kill -0 "$sub" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$sub" 2>/dev/null; then
  say "not every event arrived within a minute; the relay's log:"
  tail -20 "$OUTBOX_TEST_STATE/relay.log" >&2
  exit 1
fi
wait "$sub"
say "all $events events arrived"
