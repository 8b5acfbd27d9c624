//! The integration tests of `outbox-publishers`: one module per subject, linked into one test
//! binary (`it`). One module's tests:
//! `cargo nextest run -p outbox-publishers -E 'binary(it) & test(/^MODULE::/)'`.

#[cfg(feature = "aws")]
mod aws;
#[cfg(feature = "aws")]
mod aws_credentials;
#[cfg(all(feature = "webhook", feature = "ably"))]
mod http;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "redis")]
mod redis;
