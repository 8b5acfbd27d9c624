//! TLS for database connections, with libpq's `sslmode` meanings (rustls, ring provider):
//!
//! | sslmode | encrypted | certificate checked |
//! |---|---|---|
//! | `disable`, `allow` | no | - |
//! | `prefer` (default) | if the server offers it | no (as libpq) |
//! | `require` | yes | no (as libpq), unless a CA file is given: then chain and host name |
//! | `verify-ca` | yes | chain against the system roots plus the CA file |
//! | `verify-full` | yes | chain and host name |
//!
//! The CA file comes from `sslrootcert=` in the URL or the `database_ca_file` setting.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use outbox_core::redact::{query_start, url_decoded};
use outbox_core::{StoreError, StoreErrorKind};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verify {
    Nothing,
    Chain,
    ChainAndName,
}

fn config_error(message: String) -> StoreError {
    StoreError::new(StoreErrorKind::Config, message)
}

/// Parses the URL (libpq `sslmode` and `sslrootcert` included) into a connection config and
/// the TLS connector that implements its `sslmode`.
pub fn prepare(
    url: &str,
    ca_file: Option<&Path>,
) -> Result<(tokio_postgres::Config, MakeRustlsConnect), StoreError> {
    let (url, sslmode, rootcert) = split_tls_params(url);
    if rootcert.is_some() && ca_file.is_some() {
        return Err(config_error(
            "both the URL's sslrootcert and database_ca_file (--database-ca-file) name a CA \
             file: keep one"
                .into(),
        ));
    }
    let ca_file = rootcert.or_else(|| ca_file.map(Path::to_path_buf));
    let (mode, verify) = sslmode_of(sslmode.as_deref(), ca_file.is_some())?;
    let mode = match mode {
        TlsUse::Never => "disable",
        TlsUse::IfOffered => "prefer",
        TlsUse::Always => "require",
    };
    let url = with_param(&url, "sslmode", mode);
    let config = tokio_postgres::Config::from_str(&url)
        // With its cause (a port that is no number, an option PostgreSQL's client does not
        // know): "invalid connection string" alone named nothing to fix.
        .map_err(|e| {
            config_error(format!(
                "invalid database URL: {}",
                outbox_core::redact::redact_url(&outbox_core::error::report(&e))
            ))
        })?;
    let tls = client_config(verify, ca_file.as_deref())?;
    Ok((config, MakeRustlsConnect::new(tls)))
}

/// Whether a connection uses TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsUse {
    Never,
    /// When the server offers it (`prefer`).
    IfOffered,
    Always,
}

/// TLS for a connection that is not tokio-postgres's (WAL capture's replication
/// connection), with the same `sslmode` meanings: whether to use it, and the rustls
/// configuration that checks what the mode checks.
pub fn for_sslmode(
    sslmode: Option<&str>,
    ca_file: Option<&Path>,
) -> Result<(TlsUse, Arc<rustls::ClientConfig>), StoreError> {
    let (mode, verify) = sslmode_of(sslmode, ca_file.is_some())?;
    Ok((mode, Arc::new(client_config(verify, ca_file)?)))
}

/// libpq's `sslmode` (`prefer` when unset): whether TLS is used, and what is checked.
fn sslmode_of(sslmode: Option<&str>, has_ca_file: bool) -> Result<(TlsUse, Verify), StoreError> {
    Ok(match sslmode.unwrap_or("prefer") {
        // A CA file that checks nothing would be a promise of verification not kept.
        mode @ ("disable" | "allow" | "prefer") if has_ca_file => {
            return Err(config_error(format!(
                "a CA file is given (database_ca_file, --database-ca-file, or the URL's \
                 sslrootcert), but sslmode={mode} checks no certificate: add \
                 sslmode=verify-full to the database URL (or verify-ca, or require), or drop \
                 the CA file"
            )))
        }
        "disable" | "allow" => (TlsUse::Never, Verify::Nothing),
        "prefer" => (TlsUse::IfOffered, Verify::Nothing),
        "require" if has_ca_file => (TlsUse::Always, Verify::ChainAndName),
        "require" => (TlsUse::Always, Verify::Nothing),
        "verify-ca" => (TlsUse::Always, Verify::Chain),
        "verify-full" => (TlsUse::Always, Verify::ChainAndName),
        other => {
            return Err(config_error(format!(
                "invalid sslmode {other:?}: use disable, prefer, require, verify-ca or verify-full"
            )))
        }
    })
}

/// Removes `sslmode` and `sslrootcert` from a URL's query, returning them (for other
/// clients of the same URL, such as WAL capture's replication connection).
pub fn split_tls_params(url: &str) -> (String, Option<String>, Option<PathBuf>) {
    let Some(start) = query_start(url) else {
        return (url.to_string(), None, None);
    };
    let (base, query) = (&url[..start], &url[start + 1..]);
    let (mut sslmode, mut rootcert, mut kept) = (None, None, Vec::new());
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        // Names and values as tokio-postgres reads them: percent-decoded.
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match url_decoded(name).as_str() {
            "sslmode" => sslmode = Some(url_decoded(value)),
            "sslrootcert" => rootcert = Some(PathBuf::from(url_decoded(value))),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, sslmode, rootcert)
}

fn with_param(url: &str, key: &str, value: &str) -> String {
    let sep = if query_start(url).is_some() { '&' } else { '?' };
    format!("{url}{sep}{key}={value}")
}

fn client_config(
    verify: Verify,
    ca_file: Option<&Path>,
) -> Result<rustls::ClientConfig, StoreError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(format!("TLS setup: {e}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match verify {
        Verify::Nothing => Arc::new(Lenient {
            chain: None,
            provider,
        }),
        Verify::Chain | Verify::ChainAndName => {
            let roots = Arc::new(root_store(ca_file)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| config_error(format!("TLS setup: {e}")))?;
            if verify == Verify::Chain {
                Arc::new(Lenient {
                    chain: Some(webpki),
                    provider,
                })
            } else {
                webpki
            }
        }
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, StoreError> {
    let mut roots = RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
            .map_err(|e| {
                config_error(format!(
                    "cannot read database CA file {}: {e}",
                    path.display()
                ))
            })?;
        for cert in certs {
            roots.add(cert).map_err(|e| {
                config_error(format!("invalid certificate in {}: {e}", path.display()))
            })?;
        }
    }
    Ok(roots)
}

/// The lenient checks of libpq: `prefer`/`require` encrypt and check the handshake but trust
/// any certificate; `verify-ca` also verifies the chain, but not the host name.
/// (`verify-full` is rustls's own verifier.)
#[derive(Debug)]
struct Lenient {
    /// `Some` for `verify-ca`: the chain must verify.
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl Lenient {
    /// The provider's signature algorithms, which every signature check here uses.
    fn algorithms(&self) -> &rustls::crypto::WebPkiSupportedAlgorithms {
        &self.provider.signature_verification_algorithms
    }
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, self.algorithms())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, self.algorithms())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms().supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A password's unescaped `?` is the password's, not the query's start; names and values
    /// are read percent-decoded, as tokio-postgres reads them.
    #[test]
    fn the_query_starts_past_the_credentials() {
        let (url, sslmode, _) = split_tls_params("postgres://u:Pw?x@h:5432/db?sslmode=require");
        assert_eq!(
            (url.as_str(), sslmode.as_deref()),
            ("postgres://u:Pw?x@h:5432/db", Some("require"))
        );
        let (url, sslmode, rootcert) = split_tls_params(
            "postgres://u:p@h/db?ssl%6Dode=verify%2Dfull&application_name=a&sslrootcert=%2Fca.pem",
        );
        assert_eq!(url, "postgres://u:p@h/db?application_name=a");
        assert_eq!(sslmode.as_deref(), Some("verify-full"));
        assert_eq!(rootcert, Some(PathBuf::from("/ca.pem")));
        assert_eq!(
            with_param("postgres://u:Pw?x@h/db", "sslmode", "prefer"),
            "postgres://u:Pw?x@h/db?sslmode=prefer"
        );
    }

    #[test]
    fn libpq_tls_parameters_are_taken_out_of_the_url() {
        let (url, mode, root) = split_tls_params(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x",
        );
        assert_eq!(url, "postgres://u@h/db?application_name=x");
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root, Some(PathBuf::from("/ca.pem")));
        let (url, mode, _) = split_tls_params("postgres://u@h/db");
        assert_eq!((url.as_str(), mode), ("postgres://u@h/db", None));
    }

    /// A CA file with an sslmode that verifies nothing was read by nothing: the server's
    /// certificate went unchecked, silently.
    #[test]
    fn a_ca_file_is_refused_where_the_sslmode_checks_no_certificate() {
        let ca = Path::new("/nonexistent/ca.pem");
        for mode in ["", "?sslmode=prefer", "?sslmode=disable", "?sslmode=allow"] {
            let err = prepare(&format!("postgres://u@h/db{mode}"), Some(ca))
                .err()
                .expect("refused");
            assert!(
                err.to_string().contains("add sslmode=verify-full"),
                "{mode}: {err}"
            );
        }
        let err = prepare(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=/a.pem",
            Some(ca),
        )
        .err()
        .expect("refused");
        assert!(err.to_string().contains("keep one"), "{err}");
    }

    #[test]
    fn every_libpq_sslmode_is_accepted_and_others_named() {
        for mode in [
            "disable",
            "allow",
            "prefer",
            "require",
            "verify-ca",
            "verify-full",
        ] {
            prepare(&format!("postgres://u@h/db?sslmode={mode}"), None).unwrap();
        }
        let err = prepare("postgres://u@h/db?sslmode=always", None)
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("use disable, prefer, require"),
            "{err}"
        );
    }
}
