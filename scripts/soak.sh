#!/usr/bin/env bash
# The soak (issue 34 §2): a cluster of relays on a private PostgreSQL and a private NATS
# JetStream, many writers committing and rolling back until N events are committed, and
# meanwhile rounds of every fault (kill -9 and restart, SIGTERM and restart, SIGSTOP past
# the lease and SIGCONT, a node's database sessions killed, a NATS restart, a PostgreSQL
# restart). Then every event is checked: nothing lost, no rolled-back event published,
# per-key order of first deliveries, duplicates counted. Every node's RSS is sampled each
# second. It prints one summary line and exits non-zero on a loss, a rolled-back event
# published or a key out of order.
#
#   scripts/soak.sh [poll|wal] [events]        # defaults: poll, 1000000
#
# It runs the ignored test `cluster::soak` (crates/outbox-relay/tests/it/cluster.rs), which
# documents its variables: OUTBOX_SOAK_NODES (3), OUTBOX_SOAK_WRITERS (12). With `wal`
# the nodes run --capture wal: one streams from the slot, the others stand by.
# OUTBOX_SOAK_RELEASE=1 runs the nodes on a release build of the relay (what users run, and
# it leaves the writers more of the CPU); the test itself stays a
# debug build. OUTBOX_SOAK_RELAY_BIN=<path> runs them on that binary instead.
#
# On a 2-core machine the writers commit 400-650 events/s beside debug nodes (a round of
# faults every ~25 s), about 750/s beside release nodes: a million events took 22 minutes
# polling on release nodes; 20,000 take about a minute. It is not part of CI. It never
# touches the shared test servers (scripts/servers.sh start): it starts its own PostgreSQL
# (through servers.sh, in a directory of its own) and nats-server, and stops them at the
# end.
set -euo pipefail
cd "$(dirname "$0")/.."

capture=${1:-poll}
case "$capture" in
  poll | wal) ;;
  *)
    echo "usage: $0 [poll|wal] [events]" >&2
    exit 2
    ;;
esac
export OUTBOX_SOAK_CAPTURE=$capture
export OUTBOX_SOAK_EVENTS=${2:-${OUTBOX_SOAK_EVENTS:-1000000}}
if [ "${OUTBOX_SOAK_RELEASE:-0}" = 1 ] && [ -z "${OUTBOX_SOAK_RELAY_BIN:-}" ]; then
  cargo build --release -p outbox-relay --bin outbox-relay >&2
  export OUTBOX_SOAK_RELAY_BIN=$PWD/target/release/outbox-relay
fi

log=$(mktemp --suffix=.soak.log)
echo "soak: capture=$capture events=$OUTBOX_SOAK_EVENTS, output in $log" >&2
# cargo test rather than nextest: the CI profile's slow-test limit would stop it. With
# pipefail, the pipeline fails when the test does.
status=0
cargo test -p outbox-relay --test it -- cluster::soak --exact \
  --include-ignored --nocapture --test-threads 1 2>&1 | tee "$log" >&2 || status=$?

echo
if ! grep -E '^soak: capture=' "$log"; then
  echo "soak: no summary line (the test failed before its check; see $log)"
  [ "$status" != 0 ] || status=1
fi
exit "$status"
