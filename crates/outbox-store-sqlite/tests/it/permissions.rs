//! The files of the SQLite store are private to the relay's user.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use outbox_store_sqlite::SqliteStore;

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn a_new_database_and_its_wal_and_shm_files_are_readable_by_the_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let store = SqliteStore::open(&db, false).unwrap();
    store.migrate().await.unwrap();
    store
        .batch_execute(
            "INSERT INTO outbox (destination, event_type, payload) VALUES ('d', 't', '1')",
        )
        .await
        .unwrap();
    for file in ["outbox.db", "outbox.db-wal", "outbox.db-shm"] {
        let path = dir.path().join(file);
        assert!(path.exists(), "{file} exists while the store is open");
        assert_eq!(mode_of(&path), 0o600, "{file}");
    }
}

/// `sqlite:file:...` URLs reach the store as SQLite URIs: the file they name is private too.
#[tokio::test]
async fn a_database_named_by_a_file_uri_is_readable_by_the_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    for (uri, file) in [
        (format!("file:{d}/plain.db?mode=rwc"), "plain.db"),
        (
            format!("file://localhost{d}/with%20space.db"),
            "with space.db",
        ),
        (format!("file://{d}/abs.db?cache=private#x"), "abs.db"),
        // SQLite keeps an escape that is no `%HH` as it is written: the relay made no
        // private file first, and SQLite created it with the umask's mode.
        (format!("file:{d}/odd%zz.db"), "odd%zz.db"),
        (format!("file:{d}/cut%4.db"), "cut%4.db"),
    ] {
        let store = SqliteStore::open(&uri, false).unwrap();
        store.migrate().await.unwrap();
        let path = dir.path().join(file);
        assert!(path.exists(), "{uri} creates {file}");
        for file in [path.clone(), dir.path().join(format!("{file}-wal"))] {
            assert_eq!(mode_of(&file), 0o600, "{uri}: {}", file.display());
        }
    }
}

#[tokio::test]
async fn an_existing_database_keeps_its_mode() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shared.db");
    std::fs::write(&db, "").unwrap();
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o640)).unwrap();
    let store = SqliteStore::open(&db, false).unwrap();
    store.migrate().await.unwrap();
    assert_eq!(mode_of(&db), 0o640);
    assert_eq!(mode_of(&dir.path().join("shared.db-wal")), 0o640);
}

#[test]
fn processes_opening_a_new_database_together_all_succeed() {
    // A relay and `outbox-relay send` started together on a new outbox.db: each switches the
    // file to WAL, and SQLite answers one of them "database is locked" at once.
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("outbox.db");
        let start = std::sync::Arc::new(std::sync::Barrier::new(4));
        let openers: Vec<_> = (0..4)
            .map(|_| {
                let (db, start) = (db.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let store = SqliteStore::open(&db, false)?;
                    // Each sets the tables up too (`run` and `send` migrate on a new file).
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap()
                        .block_on(store.migrate())
                })
            })
            .collect();
        for opener in openers {
            let opened = opener.join().unwrap();
            assert!(opened.is_ok(), "round {round}: {:?}", opened.err());
        }
    }
}

/// A VFS without shared memory or locks (`vfs=unix-none`) keeps the file out of WAL:
/// SQLite answers the switch with the mode it stays in, which went unread. The relay ran
/// with its reads blocking the application's writes, and with no locks between the two.
#[test]
fn a_database_that_cannot_switch_to_wal_is_refused_naming_why() {
    let dir = tempfile::tempdir().unwrap();
    let uri = format!("file:{}/v.db?vfs=unix-none", dir.path().display());
    let refused = match SqliteStore::open(&uri, false) {
        Ok(_) => panic!("{uri} opened out of WAL"),
        Err(e) => e,
    };
    assert_eq!(
        refused.kind(),
        outbox_core::StoreErrorKind::Config,
        "{refused}"
    );
    let said = refused.to_string();
    assert!(
        said.contains("did not switch") && said.contains("default VFS"),
        "{said}"
    );
    assert!(
        !dir.path().join("v.db").exists(),
        "the refused opening leaves no empty database file behind"
    );
}
