//! WAL capture's settings: the replication slot it streams from and the publication that
//! names the captured tables.

/// The name every slot had by default before names were derived ([`WalSettings::slot_name`]),
/// and the start of those names.
pub const DEFAULT_SLOT: &str = "outbox_relay";
/// The publication `migrate --capture wal` creates: one per database is enough for one outbox.
pub const DEFAULT_PUBLICATION: &str = "outbox_relay";

/// What WAL capture holds in memory by default, in MiB ([`crate::budget`]).
pub const DEFAULT_MEMORY_MIB: u64 = 32;
/// The most `wal_memory_mib` (and binlog capture's `binlog_memory_mib`) may be (64 GiB):
/// more is a typo, not a plan.
pub const MAX_MEMORY_MIB: u64 = 65_536;

/// PostgreSQL's longest identifier (NAMEDATALEN - 1): a longer slot name is refused.
const MAX_NAME_LEN: usize = 63;

outbox_core::settings! {
    /// What the operator sets about WAL capture (the keys of the same names).
    #[derive(Clone, Debug, PartialEq)]
    pub struct WalSettings {
        /// The logical replication slot of --capture wal, created on first run. One active relay
        /// streams from it; others wait as standbys. Default: outbox_relay_<database>, with
        /// _<schema> and _<table> when they are not public and outbox (a slot made by an earlier
        /// version under the old default, outbox_relay, is kept).
        pub slot: String = String::new(),
        /// The publication of --capture wal (created by `migrate --capture wal`). Default:
        /// outbox_relay.
        pub publication: Option<String> = None,
        /// The most --capture wal holds in memory, in MiB: events read from the slot ahead of
        /// the sink and events in flight together, counted by their size. The stream is read
        /// only while there is room (what is unread waits in the server's WAL); one event
        /// larger than this still passes, alone. Default: 32.
        pub wal_memory_mib: Option<u64> = None,
    }
}

impl WalSettings {
    /// Whether any of them is given, even at its default value: they apply to WAL capture
    /// only. (Compared with the defaults, `--publication outbox_relay` without WAL capture
    /// passed as if it were not there.)
    pub fn is_set(&self) -> bool {
        !self.slot.is_empty() || self.publication.is_some() || self.wal_memory_mib.is_some()
    }

    /// The publication: the one given, or [`DEFAULT_PUBLICATION`].
    pub fn publication(&self) -> &str {
        self.publication.as_deref().unwrap_or(DEFAULT_PUBLICATION)
    }

    /// The memory budget in MiB: the one given, or [`DEFAULT_MEMORY_MIB`].
    pub fn memory_mib(&self) -> u64 {
        self.wal_memory_mib.unwrap_or(DEFAULT_MEMORY_MIB)
    }

    /// The memory budget in bytes.
    pub fn memory_budget(&self) -> usize {
        usize::try_from(self.memory_mib().saturating_mul(1024 * 1024)).unwrap_or(usize::MAX)
    }

    /// Refuses slot and publication names PostgreSQL would not take as given, and a memory
    /// budget of nothing (or of more than 64 GiB).
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_MEMORY_MIB).contains(&self.memory_mib()) {
            return Err(format!(
                "wal_memory_mib must be between 1 and {MAX_MEMORY_MIB} (got {}): it is the MiB of \
                 events WAL capture may hold",
                self.memory_mib()
            ));
        }
        let explicit_slot = (!self.slot.is_empty()).then_some(self.slot.as_str());
        for (name, what) in [
            (explicit_slot, "slot"),
            (Some(self.publication()), "publication"),
        ] {
            let Some(name) = name else { continue };
            let valid = !name.is_empty()
                && name.len() <= MAX_NAME_LEN
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !valid {
                return Err(format!(
                    "invalid {what} name {name:?}: use 1-63 lowercase ASCII letters, digits or \
                     underscores"
                ));
            }
        }
        Ok(())
    }

    /// The replication slot: the one configured, or by default one named after the database
    /// and the outbox table (`outbox_relay_<database>[_<schema>][_<table>]`, the schema and
    /// table left out when they are `public` and `outbox`), since a slot's name is the
    /// server's: a fixed default made a second database on one server refuse to start. Too
    /// long, or not `[a-z0-9_]`, it ends with a hash of the whole instead.
    pub fn slot_name(&self, database: &str, schema: &str, table: &str) -> String {
        if !self.slot.is_empty() {
            return self.slot.clone();
        }
        let mut parts = vec![DEFAULT_SLOT, database];
        if schema != "public" {
            parts.push(schema);
        }
        if table != "outbox" {
            parts.push(table);
        }
        let whole = parts.join("_");
        let name: String = whole
            .chars()
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '_') => c,
                _ => '_',
            })
            .collect();
        if name == whole && name.len() <= MAX_NAME_LEN {
            return name;
        }
        let hash = stable_hash(&whole);
        let mut name = name;
        name.truncate(MAX_NAME_LEN - 9);
        format!("{name}_{hash:08x}")
    }

    /// The slot an earlier version used for the README's default outbox (`public.outbox`),
    /// kept when nothing names another: a second outbox of that database, added later, must
    /// not take over the slot of the first.
    pub fn legacy_slot(&self, schema: &str, table: &str) -> Option<String> {
        (self.slot.is_empty()
            && self.publication() == DEFAULT_PUBLICATION
            && (schema, table) == ("public", "outbox"))
            .then(|| DEFAULT_SLOT.into())
    }
}

/// FNV-1a of `text`: stable across builds and platforms, unlike std's hasher (names made
/// from it outlive the process).
pub(crate) fn stable_hash(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_postgresql_would_change_are_refused() {
        WalSettings::default().validate().unwrap();
        for (slot, publication) in [("Bad-Name", DEFAULT_PUBLICATION), ("", "pub lication")] {
            let settings = WalSettings {
                slot: slot.into(),
                publication: Some(publication.into()),
                ..WalSettings::default()
            };
            let err = settings.validate().unwrap_err();
            assert!(err.contains("lowercase ASCII"), "{err}");
        }
    }

    #[test]
    fn the_old_default_slot_is_kept_only_for_the_default_outbox() {
        let default = WalSettings::default();
        assert_eq!(
            default.legacy_slot("public", "outbox").as_deref(),
            Some(DEFAULT_SLOT)
        );
        assert_eq!(default.legacy_slot("public", "orders"), None);
        let named = WalSettings {
            slot: "mine".into(),
            ..WalSettings::default()
        };
        assert_eq!(named.legacy_slot("public", "outbox"), None);
        assert_eq!(named.slot_name("shop", "public", "outbox"), "mine");
        assert_eq!(
            default.slot_name("shop", "sales", "orders"),
            "outbox_relay_shop_sales_orders"
        );
    }
}
