//! Secrets out of URLs and the messages that quote them.
//!
//! Every URL the relay shows (logs, `check`, errors, a sink's description) goes through
//! [`redact_url`] first. It works on free text too, since driver and broker errors quote the
//! URL they failed on, sometimes more than one.

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
    "credential",
];

/// Characters that end a URL quoted in a message.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>')
}

/// Replaces every secret in `text` with `***`:
/// - the password of a URL's user info (`user:***@host`), or the whole user info when it has
///   no password, since a lone user-info part is often a token (`https://***@host`);
/// - the value of every parameter whose name looks secret (`?password=***`,
///   `&access_token=***`, and `password=***` in a key-value connection string).
///
/// Text without secrets comes back unchanged.
pub fn redact_url(text: &str) -> String {
    redact_parameters(&redact_user_info(text))
}

fn redact_user_info(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#') || ends_url(c))
            .unwrap_or(tail.len());
        // The last `@` of the authority: a password may itself contain an unescaped `@`.
        match tail[..authority_end].rfind('@') {
            Some(at) => {
                match tail[..at].split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str("***"),
                }
                rest = &tail[at..];
            }
            None => rest = tail,
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
        let name = rest[name_start..eq].to_ascii_lowercase();
        out.push_str(&rest[..=eq]);
        rest = &rest[eq + 1..];
        if !name.is_empty() && SECRET_NAMES.iter().any(|s| name.contains(s)) {
            let value_end = rest
                .find(|c: char| matches!(c, '&' | '#' | ';') || ends_url(c))
                .unwrap_or(rest.len());
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
        assert_eq!(
            redact_url("https://h/p?X-Amz-Signature=f00#frag"),
            "https://h/p?X-Amz-Signature=***#frag"
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
