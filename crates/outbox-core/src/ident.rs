//! SQL identifiers from configuration: validated, then always quoted.

use std::fmt;

use crate::error::{StoreError, StoreErrorKind};

/// A validated SQL identifier: ASCII letters, digits and underscores, not starting with a
/// digit, at most 63 bytes (PostgreSQL's limit). It is always emitted double-quoted (or
/// backquoted for MySQL), so reserved words are safe too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident(String);

impl Ident {
    pub fn new(name: &str, what: &str) -> Result<Self, StoreError> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && !name.as_bytes()[0].is_ascii_digit()
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if valid {
            Ok(Ident(name.to_string()))
        } else {
            Err(StoreError::new(
                StoreErrorKind::Config,
                format!(
                    "invalid {what} {name:?}: use 1-63 ASCII letters, digits or underscores, not starting with a digit"
                ),
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `"name"`.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A schema-qualified table name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableName {
    pub schema: Ident,
    pub name: Ident,
}

impl TableName {
    pub fn new(schema: &str, name: &str) -> Result<Self, StoreError> {
        Ok(TableName {
            schema: Ident::new(schema, "schema name")?,
            name: Ident::new(name, "table name")?,
        })
    }

    /// `"schema"."name"`.
    pub fn quoted(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.name.quoted())
    }

    /// A sibling object in the same schema named `<table><suffix>`, quoted.
    pub fn sibling(&self, suffix: &str) -> String {
        format!("{}.\"{}{}\"", self.schema.quoted(), self.name, suffix)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// A server-wide lock's name (MySQL's `GET_LOCK`): `prefix` and `name`, within the server's
/// 64 characters. A longer one is cut, and told apart from others cut alike by a hash of
/// the whole name (FNV-1a: stable across builds and versions, unlike the standard library's
/// hasher, since relays of two versions must name one lock alike).
pub fn server_lock_name(prefix: &str, name: &str) -> String {
    const LIMIT: usize = 64;
    let whole = format!("{prefix}{name}");
    if whole.len() <= LIMIT {
        return whole;
    }
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut cut = LIMIT.saturating_sub(prefix.len() + 17).min(name.len());
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{prefix}{}~{hash:016x}", &name[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_lock_names_fit_the_limit_and_stay_apart() {
        assert_eq!(server_lock_name("p:", "shop.outbox"), "p:shop.outbox");
        let long_a = format!("shop.{}a", "x".repeat(80));
        let long_b = format!("shop.{}b", "x".repeat(80));
        let (a, b) = (
            server_lock_name("p:", &long_a),
            server_lock_name("p:", &long_b),
        );
        assert!(a.len() <= 64 && b.len() <= 64);
        assert_ne!(a, b);
        assert!(server_lock_name("p:", &format!("shop.{}", "é".repeat(60))).len() <= 64);
    }

    #[test]
    fn accepts_plain_identifiers_and_quotes_them() {
        let t = TableName::new("public", "outbox").unwrap();
        assert_eq!(t.quoted(), "\"public\".\"outbox\"");
        assert_eq!(t.sibling("_notify"), "\"public\".\"outbox_notify\"");
        assert!(Ident::new("select", "table name").is_ok());
    }

    #[test]
    fn rejects_injection_and_oddities() {
        for bad in [
            "",
            "1abc",
            "out box",
            "x\";drop table y;--",
            "a.b",
            &"x".repeat(64),
        ] {
            let err = Ident::new(bad, "table name").unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Config, "{bad}");
        }
    }
}
