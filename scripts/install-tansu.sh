#!/usr/bin/env bash
# Installs Tansu, a Kafka-compatible broker, from crates.io (a cold build takes about 25
# minutes on 2 cores). With `tansu` on the PATH, scripts/test.sh also runs the Kafka
# compatibility tests against it.
set -euo pipefail
cargo install tansu --features dynostore --locked
