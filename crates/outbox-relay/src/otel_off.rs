//! Built without the `otel` feature: no exporter. An environment that asks for one is told
//! so once, rather than silently exporting nothing.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::Telemetry;

use crate::error::ConfigError;

pub enum Otel {}

impl Otel {
    pub fn from_env(
        _node: &str,
        _table: &str,
        _max_links: usize,
    ) -> Result<Option<Otel>, ConfigError> {
        let asked = [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
        if asked {
            tracing::warn!(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set, but this relay was built without the otel \
                 feature: no spans are exported"
            );
        }
        Ok(None)
    }

    pub fn telemetry(&self) -> Arc<dyn Telemetry> {
        match *self {}
    }

    pub async fn shutdown(self, _budget: Duration) {
        match self {}
    }
}
