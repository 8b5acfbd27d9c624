//! Reading the claim's rows: the column types the relay can read, and each row as an event
//! (or as [`Claimed::Undecodable`] when it cannot be read).

use outbox_core::event::headers_from_json_text;
use outbox_core::store::{Claimed, StoreResult};
use outbox_core::{Event, Payload, StoreError, StoreErrorKind};
use tokio_postgres::Row;

use crate::{from_micros, Tables};

/// A timestamp as PostgreSQL sends it in binary: microseconds from 2000-01-01, with
/// `i64::MAX` and `i64::MIN` for `'infinity'` and `'-infinity'`. Read raw, so that no value
/// fails to decode (or overflows) before [`outbox_core::time::created_at_problem`] judges it.
struct PgMicros(i64);

impl PgMicros {
    /// Microseconds from the Unix epoch, infinities kept as `i64::MAX` / `i64::MIN`.
    fn unix_micros(&self) -> i64 {
        const FROM_2000: i64 = 946_684_800_000_000;
        match self.0 {
            i64::MAX | i64::MIN => self.0,
            m => m.saturating_add(FROM_2000),
        }
    }
}

impl<'a> tokio_postgres::types::FromSql<'a> for PgMicros {
    fn from_sql(
        _: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let bytes: [u8; 8] = raw.try_into()?;
        Ok(PgMicros(i64::from_be_bytes(bytes)))
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        use tokio_postgres::types::Type;
        *ty == Type::TIMESTAMPTZ || *ty == Type::TIMESTAMP
    }
}

/// Whether a claimed column's type can be read; one per column of `schema::RETURNED`.
type Reads = fn(&tokio_postgres::types::Type) -> bool;

fn claimed_column_reads() -> [(Reads, &'static str); 11] {
    use tokio_postgres::types::FromSql;
    let text: Reads = <String as FromSql>::accepts;
    [
        (<i64 as FromSql>::accepts, "bigint"),
        (<uuid::Uuid as FromSql>::accepts, "uuid"),
        (text, "text"),
        (text, "text"),
        (text, "text"),
        (text, "jsonb"),
        (text, "jsonb"),
        (text, "text"),
        (<bool as FromSql>::accepts, "boolean"),
        (<i32 as FromSql>::accepts, "integer"),
        (<PgMicros as FromSql>::accepts, "timestamptz"),
    ]
}

/// A column of the claim's result whose type the relay cannot read (altered after `migrate`):
/// no row of the table can be decoded, so this stops the relay rather than dead-letter all.
fn claimed_columns_problem(tables: &Tables, row: &Row) -> Option<StoreError> {
    let reads = claimed_column_reads();
    let columns = row.columns();
    if columns.len() != reads.len() {
        return Some(StoreError::new(
            StoreErrorKind::SchemaMismatch,
            format!(
                "claim returned {} columns, the relay reads {}",
                columns.len(),
                reads.len()
            ),
        ));
    }
    columns
        .iter()
        .zip(reads)
        .find(|(column, (accepts, _))| !accepts(column.type_()))
        .map(|(column, (_, expected))| {
            StoreError::new(
                StoreErrorKind::SchemaMismatch,
                format!(
                    "column {} of {} has type {}, which the relay cannot read as {expected}",
                    column.name(),
                    tables.outbox,
                    column.type_()
                ),
            )
        })
}

/// The claimed rows' sequence ids; a column type the relay cannot read is an error.
pub(crate) fn claimed_ids(tables: &Tables, rows: &[Row]) -> StoreResult<Vec<i64>> {
    if let Some(problem) = rows
        .first()
        .and_then(|r| claimed_columns_problem(tables, r))
    {
        return Err(problem);
    }
    rows.iter()
        .map(|r| {
            r.try_get(0).map_err(|e| {
                StoreError::new(
                    StoreErrorKind::SchemaMismatch,
                    "claim: unreadable sequence_id",
                )
                .with_source(e)
            })
        })
        .collect()
}

/// Reads column `index` of a claimed row, naming the column when it cannot (a NULL where
/// `migrate` made it NOT NULL).
fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    index: usize,
) -> Result<T, String> {
    row.try_get(index).map_err(|e| {
        let name = row.columns()[index].name();
        let cause = std::error::Error::source(&e);
        if cause.is_some_and(|c| c.is::<tokio_postgres::types::WasNull>()) {
            format!(
                "{name} is NULL, which the relay cannot publish; set {name} in the dead letters, then `outbox-relay dead retry`"
            )
        } else {
            format!("{name} cannot be read: {}", outbox_core::error::report(&e))
        }
    })
}

/// Decodes one claimed row (whose columns [`claimed_ids`] checked). A row that cannot be
/// decoded becomes [`Claimed::Undecodable`].
pub(crate) fn row_to_claimed(sequence_id: i64, row: &Row) -> Claimed {
    let destination: Option<String> = row.try_get(2).unwrap_or_default();
    let partition_key: Option<String> = row.try_get(3).unwrap_or_default();
    let attempts = row.try_get::<_, i32>(9).unwrap_or_default().max(0) as u32;
    let decoded = (|| {
        let mut headers = match column::<Option<String>>(row, 6)? {
            Some(text) => headers_from_json_text(&text)?,
            None => return Err(column::<String>(row, 6).unwrap_err()),
        };
        let payload = match column::<Option<String>>(row, 5)? {
            None => Payload::Null,
            Some(text) => Payload::from_json_text(text)?,
        }
        .restore_kept(&mut headers)?;
        let event_type: String = column(row, 4)?;
        if let Some(reason) = outbox_core::event::undecodable_dead_letter(&headers, &event_type) {
            return Err(reason);
        }
        let created_at = column::<PgMicros>(row, 10)?.unix_micros();
        if let Some(problem) = outbox_core::time::created_at_problem(created_at) {
            return Err(problem);
        }
        Ok(Event {
            sequence_id,
            event_id: column(row, 1)?,
            destination: column(row, 2)?,
            partition_key: partition_key.clone(),
            event_type,
            payload,
            headers,
            mutation_id: column(row, 7)?,
            rejected: column(row, 8)?,
            attempts,
            max_attempts: None,
            created_at: from_micros(created_at),
        })
    })();
    match decoded {
        Ok(event) => Claimed::Event(event.into()),
        Err(reason) => Claimed::Undecodable {
            sequence_id,
            // As the claim statement keys it; a row with neither is keyed by "".
            ordering_key: partition_key
                .or_else(|| destination.clone())
                .unwrap_or_default(),
            destination: destination.unwrap_or_default(),
            attempts,
            reason,
        },
    }
}
