#!/usr/bin/env bash
# The long variants of the network-fault scenarios (crates/outbox-relay/tests/it/faults.rs,
# issue 13 section 4): one node's broker link delayed by 20 s while its database link is cut,
# the database blackholed for 30 s, the broker link half-open for 30 s, and cluster
# membership changing every 3 s for 5 minutes. Prints each scenario's figures at the end.
#
#   scripts/chaos.sh [the start of a scenario's name]
#
# Every OUTBOX_FAULTS_* variable the test file documents can be overridden, e.g.
#   OUTBOX_FAULTS_CHURN=15m OUTBOX_FAULTS_SEED=7 scripts/chaos.sh membership
# Uses the running test servers (OUTBOX_TEST_DATABASE_URL) if set, otherwise starts its own
# PostgreSQL and stops it again; each scenario starts a private nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${OUTBOX_TEST_DATABASE_URL:-}" ]; then
  export OUTBOX_TEST_SERVERS=postgres
  trap 'scripts/servers.sh stop' EXIT
  # A server that did not start stops here (eval of partial exports would not).
  exports=$(scripts/servers.sh start) || { echo "chaos.sh: the servers did not start (see above)" >&2; exit 1; }
  eval "$exports"
fi

export OUTBOX_FAULTS_BROKER_DELAY=${OUTBOX_FAULTS_BROKER_DELAY:-20s}
export OUTBOX_FAULTS_DB_CUT=${OUTBOX_FAULTS_DB_CUT:-20s}
export OUTBOX_FAULTS_DB_BLACKHOLE=${OUTBOX_FAULTS_DB_BLACKHOLE:-30s}
export OUTBOX_FAULTS_HALF_OPEN=${OUTBOX_FAULTS_HALF_OPEN:-30s}
export OUTBOX_FAULTS_CHURN=${OUTBOX_FAULTS_CHURN:-5m}
export OUTBOX_FAULTS_CHURN_PERIOD=${OUTBOX_FAULTS_CHURN_PERIOD:-3s}
figures=$(mktemp)
export OUTBOX_FAULTS_FIGURES=$figures

# cargo test rather than nextest: the CI profile's slow-test limit would stop these.
# Ignored scenarios (known relay bugs) run too: this is where they are measured.
status=0
# The crate's tests are one binary (`it`): the filter keeps to the faults module.
cargo test -p outbox-relay --test it -- "faults::${1:-}" --test-threads 1 --nocapture --include-ignored "${@:2}" \
  || status=$?

echo
echo "== chaos figures (duplicates: messages beyond each event's first; max_reorder: 0 = per-key order held) =="
awk '{
  delete f
  for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
  printf "%-16s events=%-7s duplicates=%-6s max_copies=%-3s max_reorder=%-3s nodes=%-4s elapsed=%s\n",
    f["scenario"], f["events"], f["duplicates"], f["max_copies"], f["max_reorder"], f["nodes"], f["elapsed"]
}' "$figures"
rm -f "$figures"
exit $status
