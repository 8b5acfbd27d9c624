//! Records the commit the binary is built from, for `--version` and the admin API.
//!
//! `OUTBOX_BUILD_COMMIT` set at build time wins (a build from a source tarball, a package);
//! otherwise `git` is asked; a tree that is no git checkout says "unknown commit".

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOX_BUILD_COMMIT");
    let commit = std::env::var("OUTBOX_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown commit".into());
    println!("cargo:rustc-env=OUTBOX_BUILD_COMMIT={}", commit.trim());
}

fn git_commit() -> Option<String> {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    // Built again when HEAD moves (a commit, a checkout), not on every change to the tree.
    // (Only paths that exist: cargo runs the script again on every build for one that
    // does not.)
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        for path in ["HEAD", "refs/heads", "packed-refs"] {
            let path = std::path::Path::new(&dir).join(path);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}
