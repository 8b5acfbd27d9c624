//! Versioned schemas: the steps `migrate` applies, the version it records, and how `run`
//! and `check` judge the version they find.
//!
//! Each store declares its steps once, in order ([`Step`]); a schema's version is the
//! number of the last step applied. `migrate` records it in `<outbox>_versions`
//! (one row per component: `outbox`, and `wal` for WAL capture's objects) after each step,
//! so an interrupted migration resumes at the step it did not finish. Every step is
//! idempotent, so the step that was running when it stopped can run again.

use std::fmt;

use crate::error::{StoreError, StoreErrorKind};

/// The cluster protocol this build speaks: how nodes share the partitions of an ordered
/// PostgreSQL cluster, written to the nodes table's `protocol` column. Relays from before
/// protocol versions leave the column NULL, which counts as protocol 1.
pub const CLUSTER_PROTOCOL: u32 = 2;

/// The fix for a step that gave up waiting for a lock ([`StoreErrorKind::Conflict`]): not
/// retried by itself, as a relay's own work is.
pub const STEP_LOCK_HINT: &str = "a transaction held the table (a long query, a dump, an idle \
     session in a transaction): run `outbox-relay migrate` again once it ends";

/// The oldest protocol this build shares partitions with. Adjacent protocols work together;
/// a change that cannot raises this to [`CLUSTER_PROTOCOL`], and a node of this build then
/// takes no partition while a node of an older protocol is live (`/readyz` says why).
pub const OLDEST_PEER_PROTOCOL: u32 = 1;

/// How a step affects a busy outbox while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lock {
    /// Writers and the relay go on while it runs.
    Online,
    /// It cannot be made online: what it locks, and for how long.
    Locks(&'static str),
}

/// How a step is run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// Its statements and the new version in one transaction.
    InTransaction,
    /// Each statement on its own, outside any transaction (PostgreSQL's `CREATE INDEX
    /// CONCURRENTLY` refuses a transaction block); the version is recorded after the last.
    Alone,
}

/// One migration step: idempotent SQL that brings a schema from `version - 1` to `version`.
#[derive(Clone, Debug)]
pub struct Step {
    pub version: u32,
    /// One line saying what it adds, as `migrate --print` heads it.
    pub summary: &'static str,
    /// The statements, each idempotent, in order.
    pub statements: Vec<String>,
    pub lock: Lock,
    pub run: Run,
    /// Whether a relay that knows only earlier versions can still run on a schema with this
    /// step (an added index: yes; a column the older relay's statements would break on: no).
    pub older_relays_run: bool,
}

impl Step {
    /// The step as `migrate --print` shows it: a heading comment, then its statements.
    pub fn printable(&self, component: &str) -> String {
        let lock = match self.lock {
            Lock::Online => "online".to_string(),
            Lock::Locks(what) => format!("NOT online: {what}"),
        };
        let run = match self.run {
            Run::InTransaction => "",
            Run::Alone => " Run each statement outside a transaction.",
        };
        let mut out = format!(
            "-- {component} schema step {}: {} ({lock}).{run}\n",
            self.version, self.summary
        );
        for s in &self.statements {
            out.push_str(s.trim_end());
            out.push('\n');
        }
        out
    }
}

/// The steps of one component, in order, numbered 1, 2, ...
#[derive(Clone, Debug)]
pub struct Steps {
    pub component: &'static str,
    pub steps: Vec<Step>,
}

impl Steps {
    pub fn new(component: &'static str, steps: Vec<Step>) -> Self {
        for (i, s) in steps.iter().enumerate() {
            debug_assert_eq!(s.version as usize, i + 1, "steps are numbered in order");
        }
        Steps { component, steps }
    }

    /// The version every step brings the schema to: the one this relay needs and knows.
    pub fn latest(&self) -> u32 {
        self.steps.last().map_or(0, |s| s.version)
    }

    /// The steps a schema at `from` lacks.
    pub fn after(&self, from: u32) -> impl Iterator<Item = &Step> {
        self.steps.iter().filter(move |s| s.version > from)
    }

    /// The steps a schema at `found` lacks, as `migrate --print` shows them: the version
    /// table first (`version_table_ddl`) unless a version was found, then each step as
    /// `printable_step` writes it (with the statement that records its version); with none
    /// missing, a comment that says so. `found` is `None` when no database was asked.
    pub fn printable_missing(
        &self,
        found: Option<Found>,
        version_table_ddl: &str,
        printable_step: impl Fn(&Step) -> String,
    ) -> String {
        let from = found.map_or(0, Found::version);
        let mut out = String::new();
        if found.is_none_or(|f| !matches!(f, Found::At { .. })) {
            out.push_str(version_table_ddl);
        }
        let mut any = false;
        for step in self.after(from) {
            any = true;
            out.push('\n');
            out.push_str(&printable_step(step));
        }
        if !any {
            out.push_str(&format!(
                "-- the {} schema is at version {} here: no step is missing\n",
                self.component,
                from.max(self.latest())
            ));
        }
        out
    }

    /// The lowest version a relay must know to run on a schema at `version`.
    pub fn readable_from(&self, version: u32) -> u32 {
        self.steps
            .iter()
            .filter(|s| s.version <= version && !s.older_relays_run)
            .map(|s| s.version)
            .max()
            .unwrap_or(0)
    }
}

/// What a database holds of one component's schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// Nothing: neither the version nor the component's tables (`check` names the tables).
    Nothing,
    /// The tables without a version: made by a relay from before versions (0.1), or applied
    /// by hand from its `migrate --print`. Version 0: every step is to run (each is
    /// idempotent, so what exists is kept).
    Unversioned,
    /// `version`, readable by relays that know `readable_from` or later.
    At { version: u32, readable_from: u32 },
}

impl Found {
    /// The version, counting an unversioned schema as 0.
    pub fn version(self) -> u32 {
        match self {
            Found::Nothing | Found::Unversioned => 0,
            Found::At { version, .. } => version,
        }
    }
}

impl Found {
    /// A version row as the database holds it (`version`, `readable_from`); a negative
    /// number is a [`StoreErrorKind::SchemaVersion`] error with the message `negative` gives.
    pub fn recorded(
        version: i64,
        readable_from: i64,
        negative: impl FnOnce() -> String,
    ) -> Result<Found, StoreError> {
        match (u32::try_from(version), u32::try_from(readable_from)) {
            (Ok(version), Ok(readable_from)) => Ok(Found::At {
                version,
                readable_from,
            }),
            _ => Err(StoreError::new(StoreErrorKind::SchemaVersion, negative())),
        }
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Nothing => f.write_str("no schema"),
            Found::Unversioned => {
                f.write_str("an unversioned schema (from before schema versions)")
            }
            Found::At { version, .. } => write!(f, "version {version}"),
        }
    }
}

/// Whether this relay can run on the schema it found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The version this relay needs.
    Current,
    /// Nothing there yet: `check` names what is missing.
    Missing,
    /// A later version whose steps leave this relay's statements working.
    NewerReadable { version: u32 },
}

const MIGRATE_HINT: &str = "run `outbox-relay migrate` with the same settings (as a role that may \
     create objects; `outbox-relay migrate --print` shows the missing steps and what each locks)";
const UPGRADE_HINT: &str = "upgrade this relay to the version that migrated the schema (or later)";

/// Judges `found` for a relay whose `steps` end at the version it needs and knows. A schema
/// it cannot run on is a [`StoreErrorKind::SchemaVersion`] error naming the fix.
pub fn judge(steps: &Steps, found: Found, what: &str) -> Result<Verdict, StoreError> {
    let latest = steps.latest();
    let component = steps.component;
    match found {
        Found::Nothing => Ok(Verdict::Missing),
        Found::At { version, .. } if version == latest => Ok(Verdict::Current),
        Found::At {
            version,
            readable_from,
        } if version > latest => {
            if readable_from <= latest {
                Ok(Verdict::NewerReadable { version })
            } else {
                Err(StoreError::new(
                    StoreErrorKind::SchemaVersion,
                    format!(
                        "{what}: the {component} schema is at version {version}, newer than this \
                         relay knows (up to {latest}), and relays before version {readable_from} \
                         cannot run on it"
                    ),
                )
                .with_hint(UPGRADE_HINT))
            }
        }
        older => {
            let missing = latest - older.version();
            Err(StoreError::new(
                StoreErrorKind::SchemaVersion,
                format!(
                    "{what}: the {component} schema is {older}, and this relay needs version \
                     {latest} ({missing} step{} missing)",
                    if missing == 1 { "" } else { "s" }
                ),
            )
            .with_hint(MIGRATE_HINT))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(version: u32, older_relays_run: bool) -> Step {
        Step {
            version,
            summary: "a step",
            statements: vec![format!("SELECT {version};")],
            lock: Lock::Online,
            run: Run::InTransaction,
            older_relays_run,
        }
    }

    fn steps() -> Steps {
        Steps::new("outbox", vec![step(1, false), step(2, true), step(3, true)])
    }

    #[test]
    fn an_older_schema_names_migrate_and_a_newer_one_the_upgrade() {
        let s = steps();
        let older = judge(&s, Found::Unversioned, "outbox").unwrap_err();
        assert_eq!(older.kind(), StoreErrorKind::SchemaVersion);
        assert!(
            older.report().contains("3 steps missing"),
            "{}",
            older.report()
        );
        assert!(older.report().contains("outbox-relay migrate"));
        let at = |version, readable_from| Found::At {
            version,
            readable_from,
        };
        assert!(judge(&s, at(2, 1), "outbox")
            .unwrap_err()
            .report()
            .contains("1 step missing"));
        assert_eq!(judge(&s, at(3, 1), "outbox").unwrap(), Verdict::Current);
        assert_eq!(
            judge(&s, at(4, 1), "outbox").unwrap(),
            Verdict::NewerReadable { version: 4 }
        );
        let newer = judge(&s, at(5, 5), "outbox").unwrap_err();
        assert_eq!(newer.kind(), StoreErrorKind::SchemaVersion);
        assert!(
            newer.report().contains("upgrade this relay"),
            "{}",
            newer.report()
        );
        assert_eq!(
            judge(&s, Found::Nothing, "outbox").unwrap(),
            Verdict::Missing
        );
    }

    #[test]
    fn only_steps_that_break_older_relays_raise_the_readable_version() {
        let s = steps();
        assert_eq!(s.readable_from(3), 1);
        let s = Steps::new(
            "outbox",
            vec![step(1, false), step(2, false), step(3, true)],
        );
        assert_eq!(s.readable_from(3), 2);
        assert_eq!(s.after(1).map(|s| s.version).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn print_says_whether_a_step_locks() {
        let mut s = step(2, true);
        s.lock = Lock::Locks("blocks writes to the nodes table for milliseconds");
        s.run = Run::Alone;
        let text = s.printable("outbox");
        assert!(text.starts_with("-- outbox schema step 2: a step (NOT online: blocks writes"));
        assert!(text.contains("outside a transaction"));
    }
}
