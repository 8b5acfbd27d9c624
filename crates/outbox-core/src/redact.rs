//! Secrets: the one type that holds them, and the one redactor for URLs and the messages
//! that quote them; and untrusted text made safe to print ([`escape_controls`]).
//!
//! A secret setting (the admin token, a webhook's signing secret, a broker password) is a
//! [`Secret`]: it never shows in `Debug` or `Display`, and serializes as `***` inside
//! [`redacted`] (what `/api/v1/status` and `check` show). Every URL the relay shows (logs,
//! `check`, errors, a sink's description) goes through [`redact_url`] first. It works on free
//! text too, since driver and broker errors quote the URL they failed on, sometimes more than
//! one.

use std::cell::Cell;

/// A secret value. It reads from any scalar (a token of digits arrives from the environment
/// as a number), never shows in `Debug`, `Display` or an error about its value, and
/// serializes as `***` inside [`redacted`] (and as itself otherwise, so that settings survive
/// being layered).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value, for the one place that uses it (a signature, a connection, a comparison).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

thread_local! {
    static REDACTING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (a serialization) with every [`Secret`] serialized as `***`.
pub fn redacted<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            REDACTING.with(|r| r.set(self.0));
        }
    }
    let _reset = Reset(REDACTING.with(|r| r.replace(true)));
    f()
}

impl serde::Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if REDACTING.with(Cell::get) {
            serializer.serialize_str("***")
        } else {
            serializer.serialize_str(&self.0)
        }
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text;
        // serde's "invalid type" errors quote the value: every scalar is taken as text.
        impl serde::de::Visitor<'_> for Text {
            type Value = Secret;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a secret string")
            }
            fn visit_str<E>(self, v: &str) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Secret, E> {
                Ok(Secret(v))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_i128<E>(self, v: i128) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_u128<E>(self, v: u128) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
            fn visit_char<E>(self, v: char) -> Result<Secret, E> {
                Ok(Secret(v.to_string()))
            }
        }
        deserializer.deserialize_any(Text)
    }
}

/// At most the first `n` characters of `text`, cut on a character boundary: for text
/// stored in a column of bounded length.
pub fn first_chars(text: &str, n: usize) -> &str {
    match text.char_indices().nth(n) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

/// `text` with every control character written as an escape (`\n`, `\u{1b}`): a
/// destination, key, type or a receiver's answer is untrusted, and printed raw it could
/// forge a log line or drive the operator's terminal.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}');
    if !text.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Query and connection-string parameters whose values are secrets, matched by substring of
/// the lower-cased name: `password`, `sslpassword`, `access_token`, `api_key`, `apikey`,
/// `secret`, `auth`, `X-Amz-Signature`, …
const SECRET_NAMES: &[&str] = &[
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "auth",
    "sig",
    "cred",
    "bearer",
    "hmac",
    "jwt",
    "sessionid",
    "session_id",
];

/// Names that are secrets only whole: as parts they are in ordinary names
/// (`target_session_attrs`, `inside`).
const SECRET_WHOLE_NAMES: &[&str] = &["session", "sid", "pw", "otp"];

/// Characters that end a URL quoted in a message.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>')
}

/// Hosts whose webhook URLs carry their secret in the path (capability URLs).
const CAPABILITY_HOSTS: &[&str] = &[
    "hooks.slack.com",
    "discord.com",
    "discordapp.com",
    "webhook.office.com",
    "hooks.zapier.com",
];

/// A value that looks generated rather than written: long, of URL-safe characters, with
/// letters and digits (API keys, signed tokens, the last part of a capability URL).
fn looks_like_token(value: &str) -> bool {
    value.len() >= 16
        && value.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~' | '+' | '/' | '%' | '=')
        })
        && value.chars().any(|c| c.is_ascii_digit())
        && value.chars().any(|c| c.is_ascii_alphabetic())
}

/// Replaces every secret in `text` with `***`:
/// - the password of a URL's user info (`user:***@host`), or the whole user info when it has
///   no password, since a lone user-info part is often a token (`https://***@host`);
/// - the path of a capability URL, whose path is the secret (`https://hooks.slack.com/***`):
///   a known webhook host's, or one with a segment that looks like a token;
/// - the value of every parameter whose name looks secret (`?password=***`,
///   `&access_token=***`, and `password=***` in a key-value connection string), and of every
///   query parameter whose value looks like a token (`?code=***`);
/// - the credential after an HTTP authorization scheme (`Basic ***`, `Bearer ***`), in
///   whatever form a receiver echoes a request's header (`Authorization: Basic …`,
///   `"authorization":"Basic …"`, `auth=Basic …`).
///
/// Text without secrets comes back unchanged.
pub fn redact_url(text: &str) -> String {
    // The schemes first: a parameter's value ends at a space, so `auth=Basic X` hid only
    // the scheme's name.
    redact_parameters(&redact_auth_schemes(&redact_user_info(text)))
}

/// The HTTP authorization schemes whose credential follows the scheme's name and a space.
const AUTH_SCHEMES: &[&str] = &["basic", "bearer"];

/// A credential's characters (base64, base64url, a JWT's dots, an opaque token's).
fn credential_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '=' | '-' | '_' | '.' | '~')
}

/// Whether a word after `Basic` or `Bearer` is a credential, not prose ("Basic
/// authentication required"): 8 characters or more, with a digit, a `+`, `/` or `=`, or a
/// capital after its first letter (base64 and tokens have them; words rarely do).
fn looks_like_credential(word: &str) -> bool {
    word.len() >= 8
        && (word.contains(|c: char| c.is_ascii_digit() || matches!(c, '+' | '/' | '='))
            || word.chars().skip(1).any(|c| c.is_ascii_uppercase()))
}

/// Hides the credential after each `Basic ` or `Bearer ` (any case, a word of its own):
/// a run of at least 8 credential characters. A shorter word after the scheme's name is
/// prose ("basic auth failed").
fn redact_auth_schemes(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some((at, scheme)) = AUTH_SCHEMES
        .iter()
        .filter_map(|s| lower[from..].find(s).map(|i| (from + i, *s)))
        .min()
    {
        from = at + scheme.len();
        let word_start = at == 0 || !text[..at].ends_with(|c: char| c.is_ascii_alphanumeric());
        let spaces = text[from..].len() - text[from..].trim_start_matches([' ', '\t']).len();
        if !word_start || spaces == 0 {
            continue;
        }
        let credential_start = from + spaces;
        let length = text[credential_start..]
            .find(|c: char| !credential_char(c))
            .unwrap_or(text.len() - credential_start);
        if !looks_like_credential(&text[credential_start..credential_start + length]) {
            continue;
        }
        out.push_str(&text[copied..credential_start]);
        out.push_str("***");
        copied = credential_start + length;
        from = copied;
    }
    out.push_str(&text[copied..]);
    out
}

/// Where a URL's user info ends: the index of its closing `@` in `after_scheme` (the text
/// after `://`), or `None` when it has none. A password may hold an unescaped `/`, `?`, `#`
/// or `@` (generated ones often hold a `/`, and tokio-postgres reads the user info up to the
/// first `@` anywhere), so the user info is not cut at the first `/` as a URL parser would:
/// it runs to the first `@` unless what comes before that `@` is a host and a path (it has a
/// `/`, `?` or `#` but no `:`), then on over each later `@` reached without a `/`, `?` or
/// `#` (a password's own `@`). Reading too much as user info only hides more.
pub fn user_info_end(after_scheme: &str) -> Option<usize> {
    // Only whitespace ends the search: a password may hold a quote or `<` (tokio-postgres
    // connects with one), and a URL quoted in a message has its `@` before the quote.
    let end = after_scheme
        .find(char::is_whitespace)
        .unwrap_or(after_scheme.len());
    let url = &after_scheme[..end];
    let path_like = |s: &str| s.contains(['/', '?', '#']);
    let first = url.find('@')?;
    if !url[..first].contains(':') && path_like(&url[..first]) {
        return None;
    }
    let mut end = first;
    while let Some(next) = url[end + 1..].find('@').map(|i| end + 1 + i) {
        if path_like(&url[end + 1..next]) {
            break;
        }
        end = next;
    }
    Some(end)
}

/// Where a URL's query begins (the index of its `?`), past its credentials: a password may
/// hold an unescaped `?`, which tokio-postgres reads as the password's. Split at the first
/// `?`, `postgres://u:Pw?x@h/db?sslmode=require` lost its `sslmode`, and the relay connected
/// without TLS while `check` said ok.
pub fn query_start(url: &str) -> Option<usize> {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[after_scheme..];
    let from = user_info_end(rest).map_or(0, |at| at + 1);
    rest[from..].find('?').map(|i| after_scheme + from + i)
}

/// A URL query parameter's name or value as the database clients read it: percent-decoded
/// (`p%61ssword` is `password` to tokio-postgres).
pub fn url_decoded(raw: &str) -> String {
    percent_encoding::percent_decode_str(raw)
        .decode_utf8_lossy()
        .into_owned()
}

/// Whether the URL `url` (a setting's value, not free text) holds whitespace before its last
/// `@`: a password with an unescaped space, which clients connect with but [`redact_url`]
/// cannot tell from the end of a URL in a message (so it would show it). Settings refuse
/// it, asking for the space percent-encoded.
pub fn user_info_has_whitespace(url: &str) -> bool {
    let Some((_, after_scheme)) = url.split_once("://") else {
        return false;
    };
    after_scheme
        .rfind('@')
        .is_some_and(|at| after_scheme[..at].contains(char::is_whitespace))
}

/// A URL shown redacted ([`redact_url`]) by `Debug`: for the `url` field of connection
/// settings, whose derived `Debug` would show the password to whatever prints them.
pub struct RedactedUrl<'a>(pub &'a str);

impl std::fmt::Debug for RedactedUrl<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&redact_url(self.0), f)
    }
}

fn redact_user_info(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let host_start = match user_info_end(tail) {
            Some(at) => {
                match tail[..at].split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str("***"),
                }
                at
            }
            None => 0,
        };
        let authority_end = tail[host_start..]
            .find(|c: char| matches!(c, '/' | '?' | '#') || ends_url(c))
            .map_or(tail.len(), |i| host_start + i);
        out.push_str(&tail[host_start..authority_end]);
        rest = &tail[authority_end..];
        let path_end = rest
            .find(|c: char| matches!(c, '?' | '#') || ends_url(c))
            .unwrap_or(rest.len());
        let host = tail[host_start..authority_end]
            .trim_start_matches('@')
            .split(':')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        let path = &rest[..path_end];
        let capability = CAPABILITY_HOSTS
            .iter()
            .any(|h| host == *h || host.ends_with(&format!(".{h}")))
            || path.split('/').any(looks_like_token);
        if capability && path.len() > 1 {
            out.push_str("/***");
            rest = &rest[path_end..];
        }
    }
    out.push_str(rest);
    out
}

fn redact_parameters(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let name_start = rest[..eq]
            .rfind(|c: char| matches!(c, '?' | '&' | ';') || ends_url(c))
            .map_or(0, |i| i + 1);
        // Decoded, as the client reads it: `p%61ssword=` is a password.
        let name = url_decoded(&rest[name_start..eq]).to_ascii_lowercase();
        let in_query = matches!(rest[..name_start].chars().last(), Some('?' | '&'));
        out.push_str(&rest[..=eq]);
        rest = &rest[eq + 1..];
        let secret_name = !name.is_empty()
            && (SECRET_NAMES.iter().any(|s| name.contains(s))
                || SECRET_WHOLE_NAMES.contains(&name.as_str()));
        let value_end = match (secret_name, in_query, rest.strip_prefix('\'')) {
            // tokio-postgres reads a query parameter's value up to the next `&`: a `;`, `#`,
            // quote or `<` is part of the password. (Whitespace still ends it, for a URL
            // quoted in a message; a password's own is percent-encoded.)
            (true, true, _) => rest
                .find(|c: char| c == '&' || c.is_whitespace())
                .unwrap_or(rest.len()),
            // A key-value connection string's quoted value (`password='a b;c'`), to its
            // closing quote (an escaped `\'` does not close it).
            (true, false, Some(quoted)) => {
                let mut escaped = false;
                quoted
                    .char_indices()
                    .find(|&(_, c)| {
                        let closes = c == '\'' && !escaped;
                        escaped = c == '\\' && !escaped;
                        closes
                    })
                    .map_or(rest.len(), |(i, _)| i + 2)
            }
            _ => rest
                .find(|c: char| matches!(c, '&' | '#' | ';') || ends_url(c))
                .unwrap_or(rest.len()),
        };
        if secret_name || (in_query && looks_like_token(&rest[..value_end])) {
            if value_end > 0 {
                out.push_str("***");
            }
            rest = &rest[value_end..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    /// Names that say a secret, with values a person chose (no digits, so not taken for a
    /// token by their look): `bearer=`, `hmac=` and the rest were shown as given.
    #[test]
    fn more_secret_names_are_hidden_whatever_their_values_look_like() {
        for name in [
            "bearer",
            "hmac",
            "jwt",
            "session",
            "sessionid",
            "sid",
            "cred",
            "pw",
            "otp",
        ] {
            let url = format!("http://h/p?{name}=correcthorsebatterystaple&x=1");
            assert_eq!(redact_url(&url), format!("http://h/p?{name}=***&x=1"));
        }
        let kept = "postgres://h/db?target_session_attrs=read-write";
        assert_eq!(redact_url(kept), kept);
    }

    /// A receiver that echoes the request's Authorization header in its error put the
    /// webhook URL's password, as Basic's base64, in `last_error`, the log and the API: the
    /// credential after `Basic` or `Bearer` is hidden in every form a body gives it, and
    /// prose after the word is kept.
    #[test]
    fn a_credential_after_an_authorization_scheme_is_hidden() {
        for (echoed, shown) in [
            (
                "ERR auth=Basic aG9va3VzZXI6SE9PS1BBU1NzM2NyM3Q=",
                "ERR auth=*** ***",
            ),
            (
                "Authorization: Basic aG9va3VzZXI6SE9PS1BBU1NzM2NyM3Q= refused",
                "Authorization: Basic *** refused",
            ),
            (
                r#"{"authorization":"Bearer eyJhbGciOi.eyJzdWIi.SflKxw"}"#,
                r#"{"authorization":"Bearer ***"}"#,
            ),
            ("basic auth failed", "basic auth failed"),
            (
                "HTTP Basic authentication required; Bearer credentials expected",
                "HTTP Basic authentication required; Bearer credentials expected",
            ),
            ("a basicallyfine word", "a basicallyfine word"),
        ] {
            let redacted = redact_url(echoed);
            assert!(!redacted.contains("aG9va3VzZXI6"), "{redacted}");
            assert!(!redacted.contains("SflKxw"), "{redacted}");
            assert_eq!(redacted, shown);
        }
    }

    /// tokio-postgres decodes a parameter's name: `p%61ssword=` sets the password, so it is
    /// redacted as one.
    #[test]
    fn a_percent_encoded_password_parameter_is_redacted() {
        let shown = redact_url("postgres://relay@h/db?p%61ssword=SECRETA1&application_name=a");
        assert!(!shown.contains("SECRETA1"), "{shown}");
        assert!(shown.contains("application_name=a"), "{shown}");
    }

    /// tokio-postgres reads `?password=` up to the next `&`, so a `;`, `#`, quote or `<` is
    /// part of the password; the redactor ended the value there and showed the rest (or,
    /// with that character first, nothing was hidden at all).
    #[test]
    fn a_secret_query_value_is_hidden_up_to_the_next_parameter() {
        for c in [';', '\'', '"', '`', '<', '>', '#'] {
            for name in ["password", "sslpassword"] {
                for value in [format!("a{c}SECRET"), format!("{c}SECRET")] {
                    let url = format!("postgres://u@h/d?{name}={value}&sslmode=require");
                    let shown = redact_url(&url);
                    assert!(!shown.contains("SECRET"), "{url} shown as {shown}");
                    assert!(
                        shown.ends_with(&format!("?{name}=***&sslmode=require")),
                        "{shown}"
                    );
                }
            }
        }
        // A URL quoted in a message ends at whitespace.
        assert_eq!(
            redact_url("cannot connect to postgres://u@h/d?password=pw: refused"),
            "cannot connect to postgres://***@h/d?password=*** refused"
        );
        // A key-value connection string's quoted value, to its closing quote.
        assert_eq!(
            redact_url("host=h password='a b;c\\'d' user=u"),
            "host=h password=*** user=u"
        );
    }

    #[test]
    fn user_info_passwords_are_hidden_and_users_kept() {
        assert_eq!(
            redact_url("postgres://relay:s3cr%40t@db:5432/app?sslmode=require"),
            "postgres://relay:***@db:5432/app?sslmode=require"
        );
        assert_eq!(
            redact_url("redis://u:secret@h:6379/0"),
            "redis://u:***@h:6379/0"
        );
        // An unescaped `@` in the password: everything up to the host's `@` goes.
        assert_eq!(
            redact_url("amqp://guest:p@ss@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(redact_url("redis://:pw@h"), "redis://:***@h");
    }

    /// A generated password holding an unescaped `/`, `?`, `#` or a quote: tokio-postgres connects
    /// with it (it reads the user info up to the first `@`), and the redactor used to end the
    /// user info at the `/`, so nothing was hidden.
    #[test]
    fn a_password_holding_a_slash_a_question_mark_or_a_hash_is_hidden() {
        for (input, shown) in [
            (
                "postgres://app:Zx9/Qw+e@db/app",
                "postgres://app:***@db/app",
            ),
            (
                "postgres://app:a?b@db:5432/app?x=1",
                "postgres://app:***@db:5432/app?x=1",
            ),
            (
                "mysql://root:a#b@127.0.0.1/db",
                "mysql://root:***@127.0.0.1/db",
            ),
            ("nats://u:a/b@c@h:4222", "nats://u:***@h:4222"),
            (
                "failed: postgres://u:x/y@h/d refused",
                "failed: postgres://u:***@h/d refused",
            ),
            // A quote or `<` in the password used to end the search before its `@`.
            (
                "postgres://relay:ab'cd@db/app",
                "postgres://relay:***@db/app",
            ),
            (
                "postgres://relay:a\"b`c<d>@db/app",
                "postgres://relay:***@db/app",
            ),
            (
                "cannot reach \"postgres://relay:ab'cd@db/app\": refused",
                "cannot reach \"postgres://relay:***@db/app\": refused",
            ),
        ] {
            assert_eq!(redact_url(input), shown, "{input}");
        }
    }

    /// An `@` in a path or a query after a host is not user info.
    #[test]
    fn an_at_sign_after_the_host_is_not_user_info() {
        assert_eq!(
            redact_url("https://hooks.example/in?email=a@b.example"),
            "https://hooks.example/in?email=a@b.example"
        );
        assert_eq!(
            redact_url("postgres://u:p@db/app?application_name=x@y"),
            "postgres://u:***@db/app?application_name=x@y"
        );
        assert_eq!(
            super::user_info_end("hooks.example/in?email=a@b.example"),
            None
        );
        assert_eq!(
            super::user_info_end("u:p@db/app?application_name=x@y"),
            Some(3)
        );
    }

    #[test]
    fn a_lone_user_info_part_is_hidden_whole() {
        assert_eq!(redact_url("https://ghp_token@host/x"), "https://***@host/x");
        assert_eq!(
            redact_url("postgres://relay@db/app"),
            "postgres://***@db/app"
        );
    }

    #[test]
    fn secret_parameters_are_hidden() {
        assert_eq!(
            redact_url("postgres://db/app?user=x&password=hunter2&sslmode=require"),
            "postgres://db/app?user=x&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("https://hooks.example/in?access_token=abc&channel=x"),
            "https://hooks.example/in?access_token=***&channel=x"
        );
        // A `#` may be a password's own (tokio-postgres reads a value up to `&`): what
        // follows a secret is hidden with it.
        assert_eq!(
            redact_url("https://h/p?X-Amz-Signature=f00#frag"),
            "https://h/p?X-Amz-Signature=***"
        );
        assert_eq!(
            redact_url("host=db user=relay password=hunter2 sslpassword=k"),
            "host=db user=relay password=*** sslpassword=***"
        );
    }

    #[test]
    fn every_url_in_a_message_is_redacted() {
        assert_eq!(
            redact_url("cannot reach nats://a:pw1@h1:4222 or \"amqp://b:pw2@h2\": refused"),
            "cannot reach nats://a:***@h1:4222 or \"amqp://b:***@h2\": refused"
        );
        // An `@` after the authority (an e-mail in the path or query) is no user info.
        assert_eq!(
            redact_url("https://h/notify?to=a@b.example"),
            "https://h/notify?to=a@b.example"
        );
    }

    /// The relay had two redactors: the binary's `redact_url` hid user-info passwords and
    /// `password=` values but showed a lone user-info token, `access_token=` and every URL of
    /// a message after the first; the sinks' `redact_uri` hid the whole user info but no
    /// parameter, and cut from the scheme to the *last* `@` of the text, hiding hosts rather
    /// than secrets. Each case: the input, what each of them showed, and what is shown now.
    #[test]
    fn the_cases_each_old_redactor_got_wrong() {
        #[rustfmt::skip]
        let cases = [
            // (input, old redact_url, old redact_uri, now)
            ("redis://token@h:6379", "redis://token@h:6379", "redis://***@h:6379",
             "redis://***@h:6379"),
            ("https://h/in?access_token=abc", "https://h/in?access_token=abc",
             "https://h/in?access_token=abc", "https://h/in?access_token=***"),
            ("postgres://db/app?password=pw", "postgres://db/app?password=***",
             "postgres://db/app?password=pw", "postgres://db/app?password=***"),
            ("host=db password=pw", "host=db password=***", "host=db password=pw",
             "host=db password=***"),
            ("nats://a:pw1@h1 or amqp://b:pw2@h2", "nats://a:***@h1 or amqp://b:pw2@h2",
             "nats://***@h2", "nats://a:***@h1 or amqp://b:***@h2"),
            ("https://h/notify?to=a@b.example", "https://h/notify?to=a@b.example",
             "https://***@b.example", "https://h/notify?to=a@b.example"),
        ];
        for (input, _binary, _sinks, now) in cases {
            assert_eq!(redact_url(input), now, "{input}");
        }
    }

    #[test]
    fn capability_urls_show_their_host_only() {
        assert_eq!(
            redact_url("https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX"),
            "https://hooks.slack.com/***"
        );
        assert_eq!(
            redact_url("webhook https://discord.com/api/webhooks/123/abc-DEF (refused)"),
            "webhook https://discord.com/*** (refused)"
        );
        // Any host, when a path segment looks generated.
        assert_eq!(
            redact_url("https://h.example/in/8f14e45fceea167a5a36dedd4bea2543?x=1"),
            "https://h.example/***?x=1"
        );
        // A template's placeholders and ordinary names stay.
        assert_eq!(
            redact_url("https://h.example/events/{destination}"),
            "https://h.example/events/{destination}"
        );
    }

    #[test]
    fn query_values_that_look_like_tokens_are_hidden() {
        assert_eq!(
            redact_url("https://f.example/api/hook?code=Zm9vYmFyYmF6cXV4MTIzNDU2&name=orders"),
            "https://f.example/api/hook?code=***&name=orders"
        );
        // Outside a query string, a `name=value` is left alone unless its name is secret.
        assert_eq!(
            redact_url("event_id=0191f2c4a7b87c3d9e1f"),
            "event_id=0191f2c4a7b87c3d9e1f"
        );
    }

    #[test]
    fn secrets_never_show_and_read_from_any_scalar() {
        let s: super::Secret = serde_json::from_str("12345678901234567890").unwrap();
        assert_eq!(s.expose(), "12345678901234567890");
        assert_eq!(format!("{s:?} {s}"), "\"***\" ***");
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            "\"12345678901234567890\""
        );
        let shown = super::redacted(|| serde_json::to_string(&s).unwrap());
        assert_eq!(shown, "\"***\"");
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            "\"12345678901234567890\""
        );
        let b: super::Secret = serde_json::from_str("true").unwrap();
        assert_eq!(b.expose(), "true");
    }

    #[test]
    fn control_characters_are_escaped_visibly() {
        use super::escape_controls;
        assert_eq!(escape_controls("orders.créées"), "orders.créées");
        assert_eq!(
            escape_controls("a\nERROR forged\u{1b}[2J\tb"),
            "a\\nERROR forged\\u{1b}[2J\\tb"
        );
    }

    #[test]
    fn text_without_secrets_is_unchanged() {
        for text in [
            "sqlite:outbox.db",
            "sqlite:file:outbox.db?mode=ro",
            "amqp://h:5672",
            "stdout",
            "file:/var/log/events.jsonl",
            "mysql://db/app?require_ssl=true",
            "batch_size must be between 1 and 50000",
        ] {
            assert_eq!(redact_url(text), text);
        }
    }
}
