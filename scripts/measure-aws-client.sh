#!/usr/bin/env bash
# What the AWS sinks' client costs to build against the official SDK (BENCHMARKS.md, "AWS
# sinks"): two scratch crates in DIR (default /tmp/aws-client-measure), each built clean with
# `cargo build --release`; prints the crates in each lock file, the CPU time and the stripped
# binary's size. Takes about 20 minutes of CPU on 2 cores.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/aws-client-measure}
rm -rf "$dir" && mkdir -p "$dir/sdk/src" "$dir/ours/src"
cat >"$dir/sdk/Cargo.toml" <<'TOML'
[package]
name = "sdk-measure"
version = "0.1.0"
edition = "2021"
[dependencies]
aws-config = "1"
aws-sdk-sqs = "1"
aws-sdk-sns = "1"
aws-sdk-kinesis = "1"
aws-sdk-eventbridge = "1"
tokio = { version = "1", features = ["rt-multi-thread", "macros"] }
TOML
cat >"$dir/sdk/src/main.rs" <<'RUST'
#[tokio::main]
async fn main() {
    let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    let url = std::env::args().nth(1).unwrap_or_default();
    let entry = aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder().id("0").message_body("x").build().unwrap();
    let sent = aws_sdk_sqs::Client::new(&config).send_message_batch().queue_url(&url).entries(entry).send().await;
    let _ = aws_sdk_sns::Client::new(&config).publish_batch().topic_arn("arn").send().await;
    let _ = aws_sdk_kinesis::Client::new(&config).put_records().stream_name("s").send().await;
    let _ = aws_sdk_eventbridge::Client::new(&config).put_events().send().await;
    println!("{}", sent.is_ok());
}
RUST
cat >"$dir/ours/Cargo.toml" <<TOML
[package]
name = "ours-measure"
version = "0.1.0"
edition = "2021"
[dependencies]
outbox-publishers = { path = "$repo/crates/outbox-publishers", default-features = false, features = ["aws"] }
rustls = { version = "0.23", default-features = false, features = ["ring"] }
tokio = { version = "1", features = ["rt-multi-thread", "macros"] }
serde_json = "1"
TOML
cat >"$dir/ours/src/main.rs" <<'RUST'
#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config: outbox_publishers::SinkConfig = serde_json::from_value(serde_json::json!({"uri": "sqs:"})).unwrap();
    println!("{}", outbox_publishers::build_sink("s", &config).await.is_ok());
}
RUST
for crate in sdk ours; do
  (
    cd "$dir/$crate"
    cargo generate-lockfile -q
    /usr/bin/time -f "%U %S" -o time.txt cargo build --release -q
    read -r user sys <time.txt
    cp "target/release/$crate-measure" stripped && strip stripped
    printf '%s: %s crates, %s s CPU, %s bytes stripped\n' "$crate" \
      "$(grep -c '^name = ' Cargo.lock)" "$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.0f", u + s }')" \
      "$(stat -c %s stripped)"
  )
done
