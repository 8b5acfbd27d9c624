//! Generated text held to a checked-in copy: a change to it shows in review as a diff of
//! that file. Setting `OUTBOX_UPDATE_SNAPSHOTS=1` rewrites the copies instead of comparing.

use std::path::Path;

/// Compares `actual` with `<manifest_dir>/snapshots/<name>` (pass `env!("CARGO_MANIFEST_DIR")`),
/// or rewrites that file when `OUTBOX_UPDATE_SNAPSHOTS=1`.
pub fn assert_snapshot(manifest_dir: &str, name: &str, actual: &str) {
    let path = Path::new(manifest_dir).join("snapshots").join(name);
    if std::env::var("OUTBOX_UPDATE_SNAPSHOTS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("a directory")).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected != actual {
        let first_difference = expected
            .lines()
            .zip(actual.lines())
            .position(|(e, a)| e != a)
            .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
        panic!(
            "{} differs from the text generated now, first at line {}: \
             rerun with OUTBOX_UPDATE_SNAPSHOTS=1 and review the file's diff",
            path.display(),
            first_difference + 1
        );
    }
}
