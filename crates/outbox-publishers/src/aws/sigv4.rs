//! AWS Signature Version 4 for the one request shape the AWS sinks send: a `POST` of a body
//! to the endpoint's path, without a query string. Checked against botocore's signer (the
//! test below holds a signature botocore made for the same request).

use std::time::SystemTime;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use outbox_core::redact::Secret;

/// One set of credentials: what a request is signed with.
#[derive(Clone, Debug, PartialEq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: Secret,
    pub session_token: Option<Secret>,
    /// When temporary credentials stop working.
    pub expires: Option<SystemTime>,
}

/// The request to sign: what the canonical request is built from.
pub struct Request<'a> {
    /// The `Host` header as sent: the host, and the port when it is not the scheme's.
    pub host: &'a str,
    /// The URL path, `/` for the services' root.
    pub path: &'a str,
    /// Headers besides `host` and the `x-amz-*` ones added here, lower-case names.
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
}

/// The service and region a signature is scoped to.
pub struct Scope<'a> {
    pub service: &'a str,
    pub region: &'a str,
}

/// The headers to add to the request: `x-amz-date`, `x-amz-security-token` (temporary
/// credentials only) and `authorization`.
pub fn sign(
    request: &Request<'_>,
    scope: &Scope<'_>,
    credentials: &Credentials,
    now: SystemTime,
) -> Vec<(&'static str, String)> {
    let stamp = amz_date(now);
    let date = &stamp[..8];
    let mut headers: Vec<(String, String)> = request
        .headers
        .iter()
        .map(|(name, value)| (name.to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    headers.push(("host".into(), request.host.to_string()));
    headers.push(("x-amz-date".into(), stamp.clone()));
    if let Some(token) = &credentials.session_token {
        headers.push(("x-amz-security-token".into(), token.expose().to_string()));
    }
    headers.sort();
    let signed_headers = headers
        .iter()
        .map(|(name, _)| name.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let canonical_headers: String = headers
        .iter()
        .map(|(name, value)| format!("{name}:{value}\n"))
        .collect();
    let canonical_request = format!(
        "POST\n{}\n\n{canonical_headers}\n{signed_headers}\n{}",
        request.path,
        hex(&Sha256::digest(request.body))
    );
    let credential_scope = format!("{date}/{}/{}/aws4_request", scope.region, scope.service);
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{stamp}\n{credential_scope}\n{}",
        hex(&Sha256::digest(canonical_request.as_bytes()))
    );
    let key = [date, scope.region, scope.service, "aws4_request"]
        .iter()
        .fold(
            format!("AWS4{}", credentials.secret_access_key.expose()).into_bytes(),
            |key, part| hmac(&key, part.as_bytes()),
        );
    let signature = hex(&hmac(&key, string_to_sign.as_bytes()));
    let mut added = vec![("x-amz-date", stamp)];
    if let Some(token) = &credentials.session_token {
        added.push(("x-amz-security-token", token.expose().to_string()));
    }
    added.push((
        "authorization",
        format!(
            "AWS4-HMAC-SHA256 Credential={}/{credential_scope}, SignedHeaders={signed_headers}, \
             Signature={signature}",
            credentials.access_key_id
        ),
    ));
    added
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `20261126T032000Z`: the time in UTC, as SigV4 writes it.
fn amz_date(now: SystemTime) -> String {
    humantime::format_rfc3339_seconds(now)
        .to_string()
        .chars()
        .filter(|c| *c != '-' && *c != ':')
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::redact::Secret;
    use std::time::{Duration, UNIX_EPOCH};

    /// The signature botocore 1.43 (`SigV4Auth.add_auth`, its clock fixed at
    /// 2026-11-26T03:20:00Z) made for this request: an SQS JSON-protocol call with temporary
    /// credentials, the request every AWS sink sends.
    #[test]
    fn signature_matches_botocore() {
        let credentials = Credentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: Secret::new("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
            session_token: Some(Secret::new("session-token-example")),
            expires: None,
        };
        let body = br#"{"QueueUrl":"https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo","Entries":[]}"#;
        let request = Request {
            host: "sqs.eu-west-1.amazonaws.com",
            path: "/",
            headers: &[
                ("Content-Type", "application/x-amz-json-1.0"),
                ("X-Amz-Target", "AmazonSQS.SendMessageBatch"),
            ],
            body,
        };
        let scope = Scope {
            service: "sqs",
            region: "eu-west-1",
        };
        let at = UNIX_EPOCH + Duration::from_secs(1_795_663_200); // 2026-11-26T03:20:00Z
        let headers = sign(&request, &scope, &credentials, at);
        assert_eq!(
            headers,
            vec![
                ("x-amz-date", "20261126T032000Z".to_string()),
                ("x-amz-security-token", "session-token-example".to_string()),
                (
                    "authorization",
                    "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261126/eu-west-1/sqs/aws4_request, \
                     SignedHeaders=content-type;host;x-amz-date;x-amz-security-token;x-amz-target, \
                     Signature=b6517947caead3be782528f1c3005138695269d2c57249e949b66c9439084d91"
                        .to_string()
                ),
            ]
        );
    }
}
