#!/usr/bin/env bash
# The whole test suite: installs and starts the servers, runs every test, stops the servers.
#   scripts/test.sh [extra cargo-nextest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

cleanup() { scripts/servers.sh stop; }
trap cleanup EXIT

# A server that did not start stops here (eval of partial exports would not).
exports=$(scripts/servers.sh start) || { echo "test.sh: the servers did not start (see above)" >&2; exit 1; }
eval "$exports"

if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
extra=()
if command -v tansu >/dev/null 2>&1; then
  echo "test.sh: tansu found: running the Kafka compatibility tests against it too" >&2
  extra+=(--run-ignored all)
fi
cargo nextest run --workspace --no-fail-fast "${extra[@]}" "$@"
# A build without the broker sinks, as the README's first command makes: each left-out
# scheme must name the feature that brings it.
cargo nextest run -p outbox-publishers --no-default-features --lib
