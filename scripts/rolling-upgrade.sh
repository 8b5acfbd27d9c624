#!/usr/bin/env bash
# A rolling upgrade with two builds of the relay (issue 34 §1). It builds an older commit of
# this repository in a worktree of its own, then runs the ignored test
# `cluster::rolling_upgrade_from_an_older_build`: the older build migrates a private
# PostgreSQL and runs two nodes of an ordered cluster on a private NATS JetStream while six
# writers commit and roll back; this build migrates while they run, then replaces them one
# at a time (the README's "Upgrading"). Every event is checked: nothing lost, no rolled-back
# event published, per-key order of first deliveries. It prints one summary line
# (`upgrade: …`) and exits non-zero on a loss, a rolled-back event or a key out of order.
#
#   scripts/rolling-upgrade.sh [REV] [poll|wal] [events]
#
# REV defaults to 31c8641, the last build before schema versions and the cluster protocol:
# what a cluster deployed before them runs. OUTBOX_OLDER_RELAY_BIN, when set, is used
# instead of building REV. Events default to 30,000 (about two minutes of writers on a
# 2-core machine). Building REV takes a full build (10-20 minutes, about 3 GB in
# target/upgrade-from). It is not part of CI, and never touches the shared test servers.
set -euo pipefail
cd "$(dirname "$0")/.."

rev=${1:-31c8641}
capture=${2:-poll}
case "$capture" in
  poll | wal) ;;
  *)
    echo "usage: $0 [REV] [poll|wal] [events]" >&2
    exit 2
    ;;
esac
export OUTBOX_UPGRADE_CAPTURE=$capture
export OUTBOX_UPGRADE_EVENTS=${3:-${OUTBOX_UPGRADE_EVENTS:-30000}}

if [ -z "${OUTBOX_OLDER_RELAY_BIN:-}" ]; then
  if ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "rolling-upgrade: $rev is not a commit of this repository (give one: $0 REV)" >&2
    exit 2
  fi
  tree=target/upgrade-from/src
  rm -rf "$tree"
  mkdir -p target/upgrade-from
  git worktree prune
  git worktree add --detach --force "$tree" "$rev" >&2
  trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || true' EXIT
  echo "rolling-upgrade: building $rev (the older build)" >&2
  CARGO_TARGET_DIR="$PWD/target/upgrade-from/target" \
    cargo build --manifest-path "$tree/Cargo.toml" -p outbox-relay --bin outbox-relay >&2
  export OUTBOX_OLDER_RELAY_BIN=$PWD/target/upgrade-from/target/debug/outbox-relay
fi

log=$(mktemp --suffix=.upgrade.log)
echo "rolling-upgrade: from $OUTBOX_OLDER_RELAY_BIN, capture=$capture, events=$OUTBOX_UPGRADE_EVENTS, output in $log" >&2
# cargo test rather than nextest: the CI profile's slow-test limit would stop it.
status=0
cargo test -p outbox-relay --test it -- cluster::rolling_upgrade_from_an_older_build --exact \
  --include-ignored --nocapture --test-threads 1 2>&1 | tee "$log" >&2 || status=$?

echo
if ! grep -E '^upgrade: capture=' "$log"; then
  echo "rolling-upgrade: no summary line (the test failed before its check; see $log)"
  [ "$status" != 0 ] || status=1
fi
exit "$status"
