//! What `migrate --capture wal` creates besides the outbox: the publication WAL capture
//! reads, and the function that writes table-less events ([`crate::emit_function_ddl`]).

use outbox_core::ident::{Ident, TableName};

/// Creates the publication `publication` of `table`'s INSERTs, if no publication of that
/// name exists. INSERTs only: the relay's own deletes of delivered rows, and any updates,
/// stay out of the stream. Needs the table's owner (or a superuser). An existing
/// publication of the same name is left as it is.
pub fn publication_ddl(publication: &Ident, table: &TableName) -> String {
    let name = publication.as_str();
    let quoted = publication.quoted();
    let table = table.quoted();
    format!(
        r#"DO $outbox_publication$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = '{name}') THEN
        CREATE PUBLICATION {quoted} FOR TABLE {table} WITH (publish = 'insert');
    END IF;
END
$outbox_publication$;"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_publication_covers_the_outbox_inserts_only() {
        let ddl = publication_ddl(
            &Ident::new("outbox_pub", "publication").unwrap(),
            &TableName::new("app", "events").unwrap(),
        );
        assert!(ddl.contains(
            r#"CREATE PUBLICATION "outbox_pub" FOR TABLE "app"."events" WITH (publish = 'insert');"#
        ));
        assert!(ddl.contains("WHERE pubname = 'outbox_pub'"));
    }
}
