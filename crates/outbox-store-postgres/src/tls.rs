//! TLS for database connections: rustls with the ring provider, the system's roots and an
//! optional extra CA file. Certificates are always verified when TLS is used.

use std::path::Path;
use std::sync::Arc;

use outbox_core::{StoreError, StoreErrorKind};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;
use tokio_postgres_rustls::MakeRustlsConnect;

pub fn connector(ca_file: Option<&Path>) -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
            .map_err(|e| {
                StoreError::new(
                    StoreErrorKind::Config,
                    format!("cannot read database CA file {}: {e}", path.display()),
                )
            })?;
        for cert in certs {
            roots.add(cert).map_err(|e| {
                StoreError::new(
                    StoreErrorKind::Config,
                    format!("invalid certificate in {}: {e}", path.display()),
                )
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::new(StoreErrorKind::Config, format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}
