//! Bad input given to the binary: a setting that cannot apply, a value that cannot work, a
//! name that is no identifier. Each is a configuration error (exit 2) that names the setting
//! and the fix; runtime failures (exit 1) carry a fix about their own cause. And the logs
//! tell the truth about how the relay wakes, without colour codes in a redirected file.

use crate::support;

use std::path::Path;
use std::process::{Command, Output};

use crate::support::BIN;

/// Runs `outbox-relay <args>` in `dir` with `env` set, stdout and stderr captured (so stderr is
/// not a terminal), and no database URL inherited.
fn relay(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .env_remove("OUTBOX_RELAY_DATABASE_URL");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("run outbox-relay")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// The configuration is refused with exit 2, and the message names `setting` and `fix`.
#[track_caller]
fn refused(out: Output, setting: &str, fix: &str) {
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "exit 2 expected: {err}");
    assert!(err.contains(setting), "the message names {setting}: {err}");
    assert!(err.contains(fix), "the message says {fix:?}: {err}");
    assert!(!err.contains(".rs:"), "no source location: {err}");
}

const PG: &str = "postgres://relay@127.0.0.1:1/app";

/// An outbox table name that fits PostgreSQL's 63 bytes with `_dead_letters` but not with
/// WAL capture's `_confirm_marks`: WAL capture took the outbox table itself for its marks
/// table, and `check` and `run --drain` said nothing of a mark that could not be kept.
#[test]
fn an_outbox_name_too_long_for_wal_captures_tables_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifty = "o".repeat(50);
    for command in ["run", "check", "migrate"] {
        let mut args = vec![command];
        if command == "migrate" {
            args.push("--print");
        }
        args.extend([
            "--capture",
            "wal",
            "--database-url",
            PG,
            "--outbox-table",
            &fifty,
        ]);
        refused(
            relay(dir.path(), &args, &[]),
            &format!("{fifty}_confirm_marks"),
            "1 characters shorter",
        );
    }
}

#[test]
fn one_webhook_secret_for_several_receivers_is_refused_naming_each_sink() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let two = "[sinks.billing]\nuri = \"https://127.0.0.1:1/billing\"\n\
               [sinks.partner]\nuri = \"https://127.0.0.1:1/partner\"\n\
               [[routes]]\ndestinations = \"billing.*\"\nsink = \"billing\"\n\
               [[routes]]\ndestinations = \"*\"\nsink = \"partner\"\n";
    std::fs::write(d.join("relay.toml"), two).unwrap();
    let secret = (
        "OUTBOX_RELAY_WEBHOOK_SECRET",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    );
    let run = [
        "--config",
        "relay.toml",
        "run",
        "--drain",
        "--http-addr",
        "",
    ];
    refused(
        relay(d, &run, &[secret]),
        "billing, partner",
        "its own secret",
    );
    // Each with a secret of its own: the shared one signs for nobody, and nothing is refused
    // for it (the drain goes on to the empty SQLite outbox).
    let own = two.replace(
        "/partner\"\n",
        "/partner\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n",
    );
    std::fs::write(d.join("relay.toml"), own).unwrap();
    let out = relay(d, &run, &[secret]);
    assert!(!stderr(&out).contains("its own secret"), "{}", stderr(&out));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_setting_that_has_no_effect_is_refused_with_exit_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // SQLite (the default database) has no NOTIFY to gate or to name a channel for.
    refused(
        relay(d, &["run", "--drain", "--wakeup", "gated"], &[]),
        "--wakeup gated",
        "remove it",
    );
    refused(
        relay(
            d,
            &["run", "--drain"],
            &[("OUTBOX_RELAY_NOTIFY_CHANNEL", "events")],
        ),
        "notify_channel",
        "remove the setting",
    );
    // Named even when it is PostgreSQL's default channel: a name given is no default.
    refused(
        relay(
            d,
            &["run", "--drain"],
            &[("OUTBOX_RELAY_NOTIFY_CHANNEL", "outbox_relay")],
        ),
        "notify_channel",
        "remove the setting",
    );
    // A fixed-rate relay never listens: the gate would wake nobody.
    refused(
        relay(
            d,
            &[
                "run",
                "--drain",
                "--database-url",
                PG,
                "--poll-fixed-rate",
                "--wakeup",
                "gated",
            ],
            &[],
        ),
        "--poll-fixed-rate",
        "use --wakeup poll",
    );
    // A Redis setting on a NATS sink.
    std::fs::write(
        d.join("maxlen.toml"),
        "[sinks.main]\nuri = \"nats://127.0.0.1:4222\"\nmaxlen = 1000\n",
    )
    .unwrap();
    refused(
        relay(d, &["--config", "maxlen.toml", "run", "--drain"], &[]),
        "`sinks.main`",
        "`maxlen` has no effect on a nats sink",
    );
    // --sink replaces the routes, which would silently stop applying.
    std::fs::write(
        d.join("routes.toml"),
        "[sinks.main]\nuri = \"stdout\"\n[[routes]]\ndestinations = \"*\"\nsink = \"main\"\n",
    )
    .unwrap();
    refused(
        relay(
            d,
            &[
                "--config",
                "routes.toml",
                "run",
                "--drain",
                "--sink",
                "stdout",
            ],
            &[],
        ),
        "--sink",
        "not both",
    );
    // A seed's layout on SQLite, and table names SQLite does not use.
    refused(
        relay(d, &["run", "--drain", "--layout", "open-outbox"], &[]),
        "layout = \"open-outbox\"",
        "remove --layout",
    );
    refused(
        relay(d, &["run", "--drain", "--outbox-table", "events"], &[]),
        "outbox_table",
        "remove them",
    );
    // With the HTTP server off, an admin token protects nothing: the operator would believe
    // an API guarded that is not there.
    let no_server = ["run", "--drain", "--http-addr", ""];
    refused(
        relay(
            d,
            &no_server,
            &[("OUTBOX_RELAY_ADMIN_TOKEN", "0123456789abcdef0123")],
        ),
        "admin token",
        "set http_addr",
    );
    refused(
        relay(
            d,
            &no_server,
            &[("OUTBOX_RELAY_ALLOWED_HOSTS", "relay.internal")],
        ),
        "allowed_hosts",
        "remove it",
    );
}

/// Settings a run would have ignored or cut short without a word (a review's findings):
/// each is refused with exit 2, naming it and the fix.
#[test]
fn settings_a_run_would_ignore_or_cut_short_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let drain = ["run", "--drain"];
    // Routes without their sinks sent every event to stdout and exited 0; an
    // `[[outboxes]]` entry setting its routes replaces the top level's [sinks].
    std::fs::write(
        d.join("routes.toml"),
        "[[routes]]\ndestinations = \"*\"\nsink = \"main\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "routes.toml"][..], &drain].concat(), &[]),
        "[[routes]] sends to the sink \"main\"",
        "add [sinks.main]",
    );
    std::fs::write(
        d.join("entry.toml"),
        "[sinks.main]\nuri = \"file:main.jsonl\"\n[[outboxes]]\nname = \"a\"\n\
         database_url = \"sqlite:a.db\"\n[[outboxes.routes]]\ndestinations = \"*\"\n\
         sink = \"main\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "entry.toml"][..], &drain].concat(), &[]),
        "invalid [[outboxes]] `a`",
        "sets its [sinks] too",
    );
    // The engine ends a publish at publish_timeout: a longer sink timeout never applied.
    std::fs::write(
        d.join("slow.toml"),
        "publish_timeout = \"2s\"\n[sinks.main]\nuri = \"http://127.0.0.1:1/hook\"\n\
         timeout = \"30s\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "slow.toml"][..], &drain].concat(), &[]),
        "the sink main's timeout (30s) must be shorter than publish_timeout (2s)",
        "raise publish_timeout",
    );
    // A webhook request waits up to half its timeout for a free slot, then has its whole
    // timeout: 15 s of timeout is 22.5 s, past a publish_timeout of 20 s, which would cut
    // such a batch short and retry its delivered events too. A NATS sink does not wait.
    std::fs::write(
        d.join("queued.toml"),
        "publish_timeout = \"20s\"\nlease = \"40s\"\n[sinks.main]\n\
         uri = \"http://127.0.0.1:1/hook\"\ntimeout = \"15s\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "queued.toml"][..], &drain].concat(), &[]),
        "the sink main may take 22.5s for a batch",
        "under two thirds of publish_timeout",
    );
    // No wait between attempts dead-lettered a backlog within a second's outage; a 1 ns
    // poll interval claimed in a busy loop; 0 attempts for a type was taken as 1.
    refused(
        relay(
            d,
            &[
                &drain[..],
                &["--retry-base-delay", "0s", "--retry-max-delay", "0s"],
            ]
            .concat(),
            &[],
        ),
        "retry.base_delay must be at least 10ms",
        "a short outage",
    );
    refused(
        relay(
            d,
            &[&drain[..], &["--wakeup", "poll", "--poll-interval", "1ns"]].concat(),
            &[],
        ),
        "poll_interval must be at least 10ms",
        "each tick",
    );
    std::fs::write(
        d.join("attempts.toml"),
        "[retry.max_attempts_by_type]\n\"order.placed\" = 0\n",
    )
    .unwrap();
    refused(
        relay(
            d,
            &[&["--config", "attempts.toml"][..], &drain].concat(),
            &[],
        ),
        "max_attempts_by_type.order.placed must be at least 1",
        "attempted once",
    );
    // Partitions are leased only by PostgreSQL's native polling relays.
    let mysql = "mysql://relay@127.0.0.1:1/app";
    for args in [
        &["--database-url", mysql][..],
        &["--database-url", PG, "--layout", "debezium"],
        &["--database-url", PG, "--capture", "wal"],
    ] {
        refused(
            relay(
                d,
                &[&drain[..], args].concat(),
                &[("OUTBOX_RELAY_PARTITIONS", "128")],
            ),
            "partitions has no effect here",
            "remove it",
        );
    }
    // A capture's stream wakes it: a NOTIFY channel or a polling wake-up did nothing.
    refused(
        relay(
            d,
            &[&drain[..], &["--database-url", PG, "--capture", "wal"]].concat(),
            &[("OUTBOX_RELAY_NOTIFY_CHANNEL", "events")],
        ),
        "notify_channel",
        "use --capture poll",
    );
    refused(
        relay(
            d,
            &[
                &drain[..],
                &[
                    "--database-url",
                    mysql,
                    "--capture",
                    "binlog",
                    "--wakeup",
                    "poll",
                ],
            ]
            .concat(),
            &[],
        ),
        "wakeup (--wakeup): the binary log wakes the relay",
        "use --capture poll",
    );
    // `nats://` alone was accepted, and reconnected to nothing for good (the fix's own
    // `user:password@` was shown as `user:***@`).
    let out = relay(d, &[&drain[..], &["--sink", "nats://"]].concat(), &[]);
    refused(out, "the NATS URI names no host", "use nats://host:port");
    // A nodes table a layout never reads, and a nodes schema MySQL never uses.
    refused(
        relay(
            d,
            &[
                &drain[..],
                &[
                    "--database-url",
                    PG,
                    "--layout",
                    "debezium",
                    "--nodes-table",
                    "n",
                ],
            ]
            .concat(),
            &[],
        ),
        "nodes_table and nodes_schema have no effect with layout = \"debezium\"",
        "remove them",
    );
    refused(
        relay(
            d,
            &[
                &drain[..],
                &["--database-url", mysql, "--nodes-schema", "ops"],
            ]
            .concat(),
            &[],
        ),
        "nodes_schema has no effect on MySQL/MariaDB",
        "remove it",
    );
    // An empty node id (`--node-id "$POD_NAME"`, the variable unset) would be every such
    // node's; one past 64 characters did not fit MySQL's nodes table.
    for node_id in ["", " ", "a\tb"] {
        refused(
            relay(d, &[&drain[..], &["--node-id", node_id]].concat(), &[]),
            "is not a node id",
            "printable characters",
        );
    }
    let long = "n".repeat(65);
    refused(
        relay(
            d,
            &[&drain[..], &["--database-url", mysql, "--node-id", &long]].concat(),
            &[],
        ),
        "is longer than the 64 characters MySQL/MariaDB keep",
        "shorten it",
    );
}

#[test]
fn bad_values_and_names_exit_2_naming_where_they_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused(
        relay(d, &["run", "--drain", "--lease", "10"], &[]),
        "--lease",
        "write it with a unit",
    );
    refused(
        relay(d, &["run", "--drain"], &[("OUTBOX_RELAY_LEASE", "10")]),
        "environment variable OUTBOX_RELAY_LEASE",
        "write it with a unit",
    );
    std::fs::write(d.join("relay.toml"), "poll_interval = \"soon\"\n").unwrap();
    refused(
        relay(d, &["--config", "relay.toml", "run", "--drain"], &[]),
        "setting `poll_interval` in",
        "write it with a unit",
    );
    refused(
        relay(
            d,
            &[
                "run",
                "--drain",
                "--database-url",
                PG,
                "--outbox-table",
                "orders\"; DROP",
            ],
            &[],
        ),
        "invalid table name",
        "ASCII letters, digits or underscores",
    );
    refused(
        relay(
            d,
            &[
                "migrate",
                "--database-url",
                PG,
                "--print",
                "--role",
                "relay role",
            ],
            &[],
        ),
        "--role: invalid role name",
        "ASCII letters, digits or underscores",
    );
    // WAL capture's memory budget: none at all would never read the stream.
    refused(
        relay(
            d,
            &[
                "run",
                "--drain",
                "--database-url",
                PG,
                "--capture",
                "wal",
                "--wal-memory-mib",
                "0",
            ],
            &[],
        ),
        "wal_memory_mib must be between 1 and 65536",
        "MiB of events WAL capture may hold",
    );
    refused(
        relay(d, &["run", "--drain", "--wal-memory-mib", "64"], &[]),
        "wal_memory_mib apply to WAL capture only",
        "add --capture wal",
    );
    // Given at their defaults, they passed as if they were not there.
    for (flag, default) in [
        ("--publication", "outbox_relay"),
        ("--wal-memory-mib", "32"),
    ] {
        refused(
            relay(d, &["run", "--drain", flag, default], &[]),
            "apply to WAL capture only",
            "add --capture wal",
        );
    }
    // Binlog capture's budget, which could not be set at all (wal_memory_mib is refused
    // with binlog capture).
    refused(
        relay(
            d,
            &[
                "run",
                "--drain",
                "--database-url",
                "mysql://u@127.0.0.1:1/db",
                "--capture",
                "binlog",
                "--binlog-memory-mib",
                "0",
            ],
            &[],
        ),
        "binlog_memory_mib must be between 1 and 65536",
        "MiB of events binlog capture may hold",
    );
    refused(
        relay(d, &["run", "--drain", "--binlog-memory-mib", "64"], &[]),
        "binlog_memory_mib (--binlog-memory-mib) applies to binlog capture only",
        "add --capture binlog",
    );
}

/// A duration no setting can use (it would overflow a clock or a database's milliseconds)
/// is refused like any bad value, from every source, never accepted or a panic.
#[test]
fn absurd_durations_exit_2_naming_the_setting_and_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (flag, value) in [
        ("--lease", "100000000000000s"),
        ("--poll-interval", "584542046090y"),
        ("--retry-max-delay", "101y"),
    ] {
        refused(
            relay(d, &["run", "--drain", "--http-addr", "", flag, value], &[]),
            flag,
            "at most 100 years",
        );
    }
    refused(
        relay(
            d,
            &["run", "--drain", "--http-addr", ""],
            &[("OUTBOX_RELAY_LEASE", "100000000000000s")],
        ),
        "environment variable OUTBOX_RELAY_LEASE",
        "at most 100 years",
    );
    std::fs::write(
        d.join("sink.toml"),
        "[sinks.hooks]\nuri = \"https://127.0.0.1:1/\"\ntimeout = \"584542046090y\"\n",
    )
    .unwrap();
    refused(
        relay(d, &["--config", "sink.toml", "check"], &[]),
        "setting `sinks.hooks`",
        "at most 100 years",
    );
}

#[test]
fn a_redirected_log_has_no_colour_codes_and_sqlite_says_how_it_wakes() {
    let dir = tempfile::tempdir().unwrap();
    let out = relay(
        dir.path(),
        &[
            "run",
            "--drain",
            "--http-addr",
            "",
            "--sink",
            "file:events.jsonl",
        ],
        &[],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        !err.contains('\u{1b}'),
        "no ANSI escape in a redirected log: {err:?}"
    );
    assert!(
        err.contains("data_version watch + safety poll") && !err.contains("notify"),
        "SQLite has no NOTIFY: {err}"
    );
}

/// sqlx's form of a SQLite URL, `sqlite://app.db?mode=rwc` (and `DATABASE_URL` is read), was
/// taken as the file `app.db?mode=rwc`: SQLite reads parameters only in `file:` URIs, so the
/// relay made a new, empty database beside the application's and watched that.
#[test]
fn a_sqlite_url_with_parameters_opens_the_named_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for url in ["sqlite://app.db?mode=rwc", "sqlite:app.db?mode=rwc"] {
        let out = relay(d, &["migrate", "--database-url", url], &[]);
        assert!(out.status.success(), "{url}: {}", stderr(&out));
        let names: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains('?')), "{url}: {names:?}");
        assert!(names.contains(&"app.db".to_string()), "{url}: {names:?}");
    }
}

/// An operator command pointed at a SQLite file that is not there (a typo, or the default
/// `outbox.db` from the wrong directory) made an empty database and reported it: "no dead
/// letters", "0 pending", a purge of nothing, exit 0.
#[test]
fn an_operator_command_on_a_missing_sqlite_file_says_so_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for command in [
        &["stats"][..],
        &["dead", "list"][..],
        &["dead", "purge", "--all"][..],
        &["replay", "--since", "1h"][..],
    ] {
        let out = relay(
            d,
            &[command, &["--database-url", "sqlite:typo.db"]].concat(),
            &[],
        );
        assert_eq!(out.status.code(), Some(2), "{command:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("no SQLite database at typo.db"),
            "{command:?}: {}",
            stderr(&out)
        );
        assert!(!d.join("typo.db").exists(), "{command:?} made the file");
    }
    // `check` says so among its findings, and checks the rest.
    let out = relay(d, &["check", "--database-url", "sqlite:typo.db"], &[]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{report}");
    assert!(
        report.contains("problem: no SQLite database at typo.db") && report.contains("ok: sink"),
        "{report}"
    );
    assert!(!d.join("typo.db").exists(), "check made the file");
}

/// An empty sink setting (the Kubernetes Secret's template, `OUTBOX_RELAY_SINK: ""`) beside
/// [[routes]] was refused as replacing them, and alone as a URI of no scheme: neither said
/// the setting was empty.
#[test]
fn an_empty_sink_setting_is_refused_as_empty() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("routes.toml"),
        "[sinks.main]\nuri = \"stdout\"\n[[routes]]\ndestinations = \"*\"\nsink = \"main\"\n",
    )
    .unwrap();
    for config in [&[][..], &["--config", "routes.toml"][..]] {
        let out = relay(
            d,
            &[config, &["check"]].concat(),
            &[("OUTBOX_RELAY_SINK", "")],
        );
        refused(out, "OUTBOX_RELAY_SINK) is set but empty", "unset it");
    }
}

#[test]
fn a_read_only_sqlite_database_is_told_to_make_the_file_writable() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(relay(d, &["migrate"], &[]).status.success());
    let out = relay(
        d,
        &[
            "send",
            "--database-url",
            "sqlite:file:outbox.db?mode=ro",
            "--destination",
            "orders",
            "{}",
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("read-only for the relay's user") && err.contains("chmod"),
        "{err}"
    );
    assert!(
        !err.contains("grant"),
        "SQLite has no privileges to grant: {err}"
    );
    // A file that cannot be made there: the fix named the setting, not "fix the
    // configuration value named in the message" (which named none).
    let out = relay(
        d,
        &[
            "run",
            "--drain",
            "--database-url",
            "sqlite:no/such/dir/outbox.db",
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("its directory exists") && err.contains("--database-url"),
        "{err}"
    );
}

/// A failure is said once to a person reading a text log (it was said twice: as a log
/// line, then as the `error:` line), and a JSON log also gets it as a structured line.
#[test]
fn a_runtime_failure_is_said_once_in_a_text_log_and_as_a_json_line_too() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(relay(d, &["migrate"], &[]).status.success());
    let send = |format: &str| {
        let args = [
            "send",
            "--log-format",
            format,
            "--database-url",
            "sqlite:file:outbox.db?mode=ro",
            "--destination",
            "orders",
            "{}",
        ];
        let out = relay(d, &args, &[]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        stderr(&out)
    };
    let text = send("text");
    assert_eq!(
        text.matches("read-only for the relay's user").count(),
        1,
        "{text}"
    );
    assert!(text.starts_with("error: "), "{text}");
    let json = send("json");
    let logged: Vec<serde_json::Value> = json
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|l: &serde_json::Value| l["level"] == "ERROR")
        .collect();
    assert_eq!(logged.len(), 1, "{json}");
    assert!(
        logged[0]["error"].as_str().unwrap().contains("read-only"),
        "{json}"
    );
    assert!(json.lines().any(|l| l.starts_with("error: ")), "{json}");
}

#[test]
fn a_failed_tls_handshake_is_told_about_tls_not_about_the_host() {
    let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
        .expect("OUTBOX_TEST_DATABASE_URL is not set: source /tmp/servers.env");
    let dir = tempfile::tempdir().unwrap();
    // The test server's certificate is signed by a CA the system does not trust.
    let url = format!("{url}?sslmode=verify-full");
    let out = relay(
        dir.path(),
        &["check", "--database-url", &url, "--sink", "stdout"],
        &[],
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report.contains("TLS handshake") && report.contains("fix: check the URL's sslmode"),
        "{report}"
    );
    assert!(!report.contains("host, port and credentials"), "{report}");
}

/// Each setting's flag shows the default the relay uses, written once in `Config::default()`.
#[test]
fn the_help_shows_every_setting_default() {
    let dir = tempfile::tempdir().unwrap();
    let help =
        |args: &[&str]| String::from_utf8_lossy(&relay(dir.path(), args, &[]).stdout).to_string();
    let run = help(&["run", "--help"]);
    for (flag, default) in [
        ("--database-url", "sqlite:outbox.db"),
        ("--batch-size", "1000"),
        ("--max-in-flight", "10000"),
        ("--lease", "30s"),
        ("--publish-timeout", "20s"),
        ("--retry-base-delay", "500ms"),
        ("--retry-max-delay", "5m"),
        ("--max-attempts", "20"),
        ("--heartbeat-timeout", "10s"),
        ("--http-addr", "127.0.0.1:2259"),
        ("--outbox-schema", "public"),
    ] {
        let text = run
            .split(&format!("      {flag} "))
            .nth(1)
            .unwrap_or_else(|| panic!("{flag} is in the help: {run}"));
        let text = text.split("\n\n").next().unwrap_or_default();
        assert!(
            text.contains(&format!("[default: {default}]")),
            "{flag}: {text}"
        );
    }
    assert!(help(&["migrate", "--help"]).contains("[default: 64]"));
}

/// `check` reaches a webhook's server as it reaches every other broker's: a URL whose host
/// and port nothing answers fails it, naming the URL (it once said "reachable" without
/// trying, and `run` then retried every event); a server answering anything, a 404 to the
/// probe included, passes. A URL template whose host and port make no URL is refused by
/// `check` and by `run` (exit 2), naming the fix, instead of failing each event.
#[test]
fn check_fails_a_webhook_nothing_answers_and_a_url_template_that_is_no_url() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let migrated = relay(d, &["migrate"], &[]);
    assert!(migrated.status.success(), "{}", stderr(&migrated));
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let sink = format!("http://127.0.0.1:{closed}/hooks/{{destination}}");
    let out = relay(d, &["check", "--sink", &sink], &[]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}{}", stderr(&out));
    assert!(
        report.contains(&format!("problem: sink {sink}")),
        "{report}"
    );

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let mut stream = stream.unwrap();
            let mut request = [0u8; 4096];
            let _ = std::io::Read::read(&mut stream, &mut request);
            let _ = std::io::Write::write_all(
                &mut stream,
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
        }
    });
    let sink = format!("http://127.0.0.1:{port}/hooks/{{destination}}");
    let out = relay(d, &["check", "--sink", &sink], &[]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{report}{}", stderr(&out));
    assert!(
        report.contains(&format!("ok: sink {sink} is reachable")),
        "{report}"
    );

    let sink = "http://127.0.0.1:99999/hooks/{destination}";
    let out = relay(d, &["check", "--sink", sink], &[]);
    let report = String::from_utf8_lossy(&out.stdout);
    // A configuration error, as `run` says (it exited 1 here).
    assert_eq!(out.status.code(), Some(2), "{report}");
    assert!(
        report.contains("problem:") && report.contains("is no URL") && report.contains("99999"),
        "{report}"
    );
    refused(
        relay(d, &["run", "--drain", "--sink", sink], &[]),
        "99999",
        "is no URL",
    );
}

/// Neither `check`'s configuration line nor its sink report shows a secret of the sink's
/// URI: a token in the user info, a password, a secret query parameter.
#[test]
fn check_shows_no_secret_of_a_sink_uri() {
    let dir = tempfile::tempdir().unwrap();
    for sink in [
        "redis://s3cr3t-token@127.0.0.1:1",
        "redis://user:s3cr3t-password@127.0.0.1:1",
        "http://127.0.0.1:1/hook?access_token=s3cr3t-query",
    ] {
        let out = relay(dir.path(), &["check", "--sink", sink], &[]);
        let shown = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert!(shown.contains("configuration is valid"), "{shown}");
        assert!(!shown.contains("s3cr3t"), "{sink}: {shown}");
        // Readable: it printed the settings as a Rust debug dump, `Config { database: … }`.
        assert!(
            shown.contains("database: sqlite:outbox.db (layout native, capture poll")
                && shown.contains("sinks: ")
                && !shown.contains("Config {"),
            "{shown}"
        );
    }
}

/// A sink only the configuration can fix (a file sink without a path): `check` said
/// "configuration is valid", checked the database, and only then refused it. It is said
/// before anything else now, the database still checked, and `check` exits 2.
#[test]
fn check_refuses_a_sink_the_configuration_names_wrongly_before_calling_it_valid() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let url = format!("sqlite:{}", db.display());
    let migrated = relay(dir.path(), &["migrate", "--database-url", &url], &[]);
    assert!(migrated.status.success(), "{}", stderr(&migrated));
    let out = relay(
        dir.path(),
        &["check", "--database-url", &url, "--sink", "file:"],
        &[],
    );
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(2), "{shown}{}", stderr(&out));
    assert!(!shown.contains("configuration is valid"), "{shown}");
    let refusal = shown.find("needs a path").expect("the sink refused");
    let database = shown.find("ok: connected").expect("the database checked");
    assert!(refusal < database, "{shown}");
}

/// A URL given where a map, a list or an address is expected is refused (exit 2) without
/// its password: the type error quoted the whole value. A password with an unencoded space,
/// which the redaction cannot tell from the URL's end, is refused asking for it encoded.
#[test]
fn a_misplaced_or_unredactable_url_is_refused_without_its_password() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (env, fix) in [
        ("OUTBOX_RELAY_SINKS__MAIN", "found a string, expected a map"),
        ("OUTBOX_RELAY_SINKS", "found a string, expected a map"),
        ("OUTBOX_RELAY_ROUTES", "found a string, expected a sequence"),
        ("OUTBOX_RELAY_HTTP_ADDR", "use host:port"),
    ] {
        let out = relay(d, &["check"], &[(env, "nats://relay:s3cr3t-pw@nats:4222")]);
        assert_eq!(out.status.code(), Some(2), "{env}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains(fix), "{env}: {err}");
        assert!(!err.contains("s3cr3t"), "{env}: {err}");
    }
    for args in [
        [
            "check",
            "--database-url",
            "postgres://relay:s3cr3t pw@127.0.0.1:1/app",
        ],
        ["check", "--sink", "amqp://relay:s3cr3t pw@127.0.0.1:1/%2f"],
    ] {
        let out = relay(d, &args, &[]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("percent-encode it"), "{err}");
        assert!(!err.contains("s3cr3t"), "{err}");
    }
}

/// A PostgreSQL URL the client cannot read is refused naming what is wrong in it: "invalid
/// connection string" alone named nothing.
#[test]
fn a_database_url_the_client_cannot_read_is_refused_naming_the_part() {
    let dir = tempfile::tempdir().unwrap();
    for (url, part) in [
        (
            "postgres://relay:s3cr3t@127.0.0.1:notaport/app",
            "option `port`",
        ),
        (
            "postgres://relay:s3cr3t@127.0.0.1:1/app?bogus=1",
            "unknown option `bogus`",
        ),
    ] {
        let out = relay(dir.path(), &["check", "--database-url", url], &[]);
        refused(out, "invalid database URL", part);
    }
}

/// Each sink reads only its own settings: one of another sink's, from a file or the
/// environment, is refused when the configuration is read (before any command runs), naming
/// the setting, the sink and the fix; so is a URI no sink reads, and a sink that cannot be
/// set up from its settings is a configuration error too.
#[test]
fn a_setting_of_another_sink_is_refused_naming_the_setting_the_sink_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("sasl.toml"),
        "[sinks.events]\nuri = \"redis://relay:hunter2@127.0.0.1:6379\"\nsasl_mechanism = \"PLAIN\"\n",
    )
    .unwrap();
    let out = relay(d, &["--config", "sasl.toml", "migrate", "--print"], &[]);
    refused(
        out,
        "`sinks.events`",
        "`sasl_mechanism` has no effect on a redis sink (redis://relay:***@127.0.0.1:6379), which \
         does not read it: remove it, or check the sink's uri",
    );
    let err = stderr(&relay(
        d,
        &["--config", "sasl.toml", "migrate", "--print"],
        &[],
    ));
    assert!(
        !err.contains("hunter2"),
        "no password in the message: {err}"
    );
    refused(
        relay(
            d,
            &["run", "--drain"],
            &[
                ("OUTBOX_RELAY_SINKS__MAIN__URI", "stdout"),
                ("OUTBOX_RELAY_SINKS__MAIN__TIMEOUT", "5s"),
            ],
        ),
        "environment variable OUTBOX_RELAY_SINKS__MAIN",
        "`timeout` has no effect on a stdout sink",
    );
    std::fs::write(
        d.join("gopher.toml"),
        "[sinks.main]\nuri = \"gopher://x\"\n",
    )
    .unwrap();
    refused(
        relay(d, &["--config", "gopher.toml", "run", "--drain"], &[]),
        "`sinks.main`",
        "unknown URI scheme \"gopher\": use stdout, file:PATH, nats://",
    );
    // Set-up failures the configuration must fix exit 2 as well.
    refused(
        relay(d, &["run", "--drain", "--sink", "file:"], &[]),
        "sink `file:`",
        "needs a path",
    );
}

/// The database URL from a file, as a systemd credential or a Kubernetes Secret's volume
/// gives it: `migrate`, `send`, `check`, `run` and `stats` use it (the file's newline
/// trimmed), and its password shows in none of their output, not even at debug level. A
/// missing or empty file, or a URL beside it, exits 2 naming the file or both settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_url_file_serves_every_command_and_its_password_shows_nowhere() {
    let password = "pw-from-file-91c2e";
    let url = outbox_testkit::fresh_pg_database().await;
    // The test server trusts local connections: the password is carried, never checked.
    let url = url.replacen("://postgres@", &format!("://postgres:{password}@"), 1);
    assert!(url.contains(password), "{url}");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let file = d.join("database-url");
    std::fs::write(&file, format!("{url}\n")).unwrap();
    let file = file.to_str().unwrap();
    let sink = format!("file:{}", d.join("events.jsonl").display());
    let with_file = |args: &[&str]| {
        let mut all = vec!["--database-url-file", file, "--log-level", "debug"];
        all.extend_from_slice(args);
        relay(d, &all, &[])
    };
    for args in [
        &["migrate"][..],
        &["send", "--destination", "d", "{}"],
        &["check"],
        &["run", "--drain", "--sink", &sink, "--http-addr", ""],
        &["stats"],
        &["dead", "list"],
    ] {
        let out = with_file(args);
        let shown = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert!(out.status.success(), "{args:?}: {shown}");
        assert!(
            !shown.contains(password),
            "{args:?} shows the password: {shown}"
        );
        if args[0] == "check" {
            assert!(
                shown.contains("ok: connected to") && shown.contains(&format!("(from {file})")),
                "{shown}"
            );
        }
    }
    assert_eq!(support::read_lines(&d.join("events.jsonl")).len(), 1);
    // The environment's way, as the systemd unit's environment file sets it.
    let out = relay(d, &["check"], &[("OUTBOX_RELAY_DATABASE_URL_FILE", file)]);
    assert!(out.status.success(), "{}", stderr(&out));
    // A server that does not answer: the error names it without the password.
    let port = outbox_testkit::server::free_port();
    let closed = format!("postgres://postgres:{password}@127.0.0.1:{port}/app");
    let closed_file = d.join("closed-url");
    std::fs::write(&closed_file, &closed).unwrap();
    let out = relay(
        d,
        &[
            "check",
            "--database-url-file",
            closed_file.to_str().unwrap(),
        ],
        &[],
    );
    let shown = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(shown.contains("cannot connect to"), "{shown}");
    assert!(!shown.contains(password), "{shown}");

    let missing = d.join("no-such-file");
    let missing = missing.to_str().unwrap();
    for command in ["run", "check", "migrate"] {
        refused(
            relay(d, &[command, "--database-url-file", missing], &[]),
            &format!("cannot read the database URL file {missing}"),
            "--database-url-file",
        );
    }
    std::fs::write(d.join("empty"), "\n").unwrap();
    refused(
        relay(d, &["check", "--database-url-file", "empty"], &[]),
        "the database URL file empty is empty",
        "put the database URL on its first line",
    );
    let both = relay(
        d,
        &["check", "--database-url-file", file],
        &[("DATABASE_URL", &url)],
    );
    assert!(!stderr(&both).contains(password), "{}", stderr(&both));
    refused(both, "--database-url-file", "keep one");
}

/// Settings that some store, command or mode would have ignored, or crashed on, are refused
/// with exit 2 naming them; bad input to an operator command exits 2, not 1.
#[test]
fn settings_a_mode_would_ignore_or_crash_on_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let drain = ["run", "--drain", "--http-addr", ""];
    fn with<'a>(drain: &[&'a str], flags: &[&'a str]) -> Vec<&'a str> {
        [drain, flags].concat()
    }
    // SQLite (the default) has one connection, its own nodes table, and no CA to verify.
    refused(
        relay(d, &drain, &[("OUTBOX_RELAY_POOL_SIZE", "4")]),
        "pool_size",
        "remove it",
    );
    refused(
        relay(d, &with(&drain, &["--nodes-table", "n"]), &[]),
        "nodes_table",
        "remove them",
    );
    refused(
        relay(d, &with(&drain, &["--database-ca-file", "ca.pem"]), &[]),
        "database_ca_file",
        "remove it",
    );
    // A pool of absurd size panicked in the pool's allocation.
    refused(
        relay(
            d,
            &with(&drain, &["--database-url", PG]),
            &[("OUTBOX_RELAY_POOL_SIZE", "4000000000000000000")],
        ),
        "pool_size must be between 1 and",
        "got 4000000000000000000",
    );
    // The Ably connector's table deletes what it delivered: nothing would be retained.
    refused(
        relay(
            d,
            &with(
                &drain,
                &[
                    "--database-url",
                    PG,
                    "--layout",
                    "adbc",
                    "--retain-delivered",
                ],
            ),
            &[],
        ),
        "retain_delivered",
        "deletes a delivered row",
    );
    // 0 made the node heartbeat and renew its leases in a loop.
    refused(
        relay(d, &with(&drain, &["--heartbeat-interval", "0s"]), &[]),
        "heartbeat_interval",
        "at least",
    );
    // A process-level setting of `[[outboxes]]`, checked before the runtime starts (it
    // panicked in tokio's builder).
    std::fs::write(
        d.join("outboxes.toml"),
        "worker_threads = 0\n[[outboxes]]\nname = \"a\"\ndatabase_url = \"sqlite:a.db\"\n",
    )
    .unwrap();
    refused(
        relay(d, &["--config", "outboxes.toml", "check"], &[]),
        "worker_threads",
        "between 1 and",
    );
    // The Ably key the README documents is the sink's, no unknown setting.
    let ably = relay(
        d,
        &["check", "--sink", "ably:"],
        &[("OUTBOX_RELAY_ABLY_API_KEY", "app.key:secret")],
    );
    assert!(
        !stderr(&ably).contains("unknown setting"),
        "{}",
        stderr(&ably)
    );
    // What Kubernetes sets in every pod for a Service named `outbox-relay` (as the
    // manifests' own is): taken for unknown settings, they stopped every pod with exit 2.
    // (On a database that exists: `check` calls a missing one a configuration problem.)
    assert!(relay(d, &["migrate"], &[]).status.success());
    let linked = relay(
        d,
        &["check"],
        &[
            ("OUTBOX_RELAY_SERVICE_HOST", "10.96.0.12"),
            ("OUTBOX_RELAY_SERVICE_PORT", "2259"),
            ("OUTBOX_RELAY_SERVICE_PORT_HTTP", "2259"),
            ("OUTBOX_RELAY_PORT", "tcp://10.96.0.12:2259"),
            ("OUTBOX_RELAY_PORT_2259_TCP", "tcp://10.96.0.12:2259"),
            ("OUTBOX_RELAY_PORT_2259_TCP_PROTO", "tcp"),
            ("OUTBOX_RELAY_PORT_2259_TCP_PORT", "2259"),
            ("OUTBOX_RELAY_PORT_2259_TCP_ADDR", "10.96.0.12"),
        ],
    );
    assert_ne!(linked.status.code(), Some(2), "{}", stderr(&linked));
    assert!(
        !stderr(&linked).contains("unknown setting"),
        "{}",
        stderr(&linked)
    );
    // A name that ends in PORT without a link's value is someone's guess at a setting: it
    // was dropped with the links, and the relay ran on its default address.
    refused(
        relay(d, &["check"], &[("OUTBOX_RELAY_HTTP_PORT", "9090")]),
        "http_port",
        "unknown",
    );
    // Half a client certificate was dropped (the sink connected without one), and a
    // confirmation timeout of 0 timed everything out (or meant "never" to Kafka).
    std::fs::write(
        d.join("half.toml"),
        "[sinks.main]\nuri = \"nats://127.0.0.1:4222\"\ntls_cert_file = \"c.pem\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "half.toml"][..], &drain].concat(), &[]),
        "tls_cert_file needs tls_key_file",
        "give both, or neither",
    );
    std::fs::write(
        d.join("zero.toml"),
        "[sinks.main]\nuri = \"kafka://127.0.0.1:9092\"\ntimeout = \"0s\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "zero.toml"][..], &drain].concat(), &[]),
        "timeout \"0s\" is under a millisecond",
        "give e.g. \"10s\"",
    );
    // TLS files on a plain http:// webhook were accepted and unused.
    std::fs::write(
        d.join("plain.toml"),
        "[sinks.main]\nuri = \"http://127.0.0.1:1/hook\"\ntls_ca_file = \"ca.pem\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "plain.toml"][..], &drain].concat(), &[]),
        "a plain http:// URL",
        "use https://",
    );
    // Two ways to authenticate to NATS: the first won, the other was ignored.
    std::fs::write(
        d.join("nats.toml"),
        "[sinks.main]\nuri = \"nats://127.0.0.1:4222\"\ncreds_file = \"a.creds\"\ntoken = \"t0ken\"\n",
    )
    .unwrap();
    refused(
        relay(d, &[&["--config", "nats.toml"][..], &drain].concat(), &[]),
        "creds_file and token",
        "give one",
    );
    // A seed file that holds no seed: accepted, every connect then failed for good, and
    // nothing named the file.
    std::fs::write(d.join("seed.nk"), "SUNOTASEEDATALL\n").unwrap();
    std::fs::write(
        d.join("nkey.toml"),
        "[sinks.main]\nuri = \"nats://127.0.0.1:4222\"\nnkey_seed_file = \"seed.nk\"\n",
    )
    .unwrap();
    let out = relay(d, &[&["--config", "nkey.toml"][..], &drain].concat(), &[]);
    assert!(!stderr(&out).contains("SUNOTASEED"), "{}", stderr(&out));
    refused(
        out,
        "nkey seed file seed.nk holds no nkey seed",
        "beginning SU",
    );
    // Operator commands' bad input.
    refused(
        relay(d, &["send", "--destination", " ", "{}"], &[]),
        "--destination",
        "must not be blank",
    );
    refused(
        relay(d, &["replay", "--since", "yesterday"], &[]),
        "invalid time",
        "an age (2h, 7d)",
    );
    refused(
        relay(d, &["prune"], &[]),
        "--delivered-older-than",
        "e.g. 7d",
    );
    refused(
        relay(d, &["replay", "--since", "1h", "--until", "2h"], &[]),
        "--since must be before --until",
        "--since 2h --until 1h",
    );
    refused(
        relay(d, &["prune", "--delivered-older-than", "7x"], &[]),
        "--delivered-older-than",
        "unit",
    );
    refused(
        relay(
            d,
            &["prune", "--dead-older-than", "7d", "--batch-size", "0"],
            &[],
        ),
        "--batch-size",
        "between 1 and 50000",
    );
    refused(
        relay(d, &["send", "--destination", "d", "not json"], &[]),
        "not valid JSON",
        "quote text as JSON",
    );
    let check = relay(d, &["check", "--sink", "carrier-pigeon://x"], &[]);
    assert_eq!(
        check.status.code(),
        Some(2),
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        stderr(&check)
    );
}

/// `migrate --role app` applied the migration and granted nothing: `--role` only names the
/// role in what `--print` shows.
#[test]
fn a_role_for_the_printed_grants_without_print_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("o.db").display());
    refused(
        relay(
            dir.path(),
            &["migrate", "--role", "app"],
            &[("DATABASE_URL", &db)],
        ),
        "--role",
        "--grant-to",
    );
    assert!(
        !dir.path().join("o.db").exists(),
        "nothing was migrated before the refusal"
    );
}

/// A variable that is no UTF-8, anywhere in the environment (a locale's leftovers, a
/// binary secret): reading the environment for Kubernetes' service links panicked on it.
#[test]
fn a_variable_that_is_no_utf8_is_no_crash() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("o.db").display());
    let out = Command::new(BIN)
        .args(["migrate"])
        .current_dir(dir.path())
        .env_remove("OUTBOX_RELAY_DATABASE_URL")
        .env("DATABASE_URL", &db)
        .env(
            std::ffi::OsStr::from_bytes(b"OUTBOX_RELAY_PORT_2259_TCP"),
            std::ffi::OsStr::from_bytes(b"tcp://\xff"),
        )
        .env("NOT_OURS", std::ffi::OsStr::from_bytes(b"\xfe\xff"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `--config` naming a directory (a ConfigMap mounted whole) ran on the defaults without a
/// word, as did a pipe (`--config <(envsubst < t.toml)`): figment reads regular files alone.
/// A directory is refused, a pipe read.
#[test]
fn a_config_path_that_is_a_directory_is_refused_and_a_pipe_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("conf")).unwrap();
    refused(
        relay(d, &["--config", "conf", "check"], &[]),
        "conf is a directory",
        "point --config",
    );
    // A pipe the shell would give: a FIFO with a writer.
    let fifo = d.join("relay.toml.fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let writer = std::thread::spawn({
        let fifo = fifo.clone();
        move || std::fs::write(fifo, "batch_size = 0\n").unwrap()
    });
    // The file's own value, refused: it was read.
    refused(
        relay(d, &["--config", fifo.to_str().unwrap(), "check"], &[]),
        "batch_size",
        "between 1 and",
    );
    writer.join().unwrap();
}

/// The TOML parser quotes the line it could not read, and a database URL's password went
/// with it to the terminal and the logs. The error names the place alone: the file (it
/// named no file) and the line.
#[test]
fn a_toml_syntax_error_names_its_place_without_quoting_the_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bad.toml"),
        "database_url = \"postgres://relay:Hunter2Secret@db:5432/app\n",
    )
    .unwrap();
    let out = relay(dir.path(), &["--config", "bad.toml", "check"], &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("line 1, column"), "{err}");
    assert!(
        err.contains("config file") && err.contains("bad.toml"),
        "{err}"
    );
    assert!(!err.contains("Hunter2Secret"), "{err}");
}

/// Credentials written into a sink URI where the sink takes none: Kafka's reached
/// librdkafka as a broker's host name, logged at every attempt, and the run failed at
/// runtime (exit 1); an AWS URI's were quoted in the refusal.
#[test]
fn credentials_in_a_sink_uri_that_takes_none_are_refused_unshown() {
    let dir = tempfile::tempdir().unwrap();
    for (sink, secret, fix) in [
        (
            "kafka://relay:KafkaPw9@127.0.0.1:19092",
            "KafkaPw9",
            "sasl_username",
        ),
        (
            "sqs://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI@us-east-1/queue",
            "wJalrXUtnFEMI",
            "credentials come from the environment",
        ),
    ] {
        let out = relay(dir.path(), &["check", "--sink", sink], &[]);
        // `check` reports on stdout.
        let err = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert_eq!(out.status.code(), Some(2), "{sink}: {err}");
        assert!(err.contains(fix), "{sink}: {err}");
        assert!(!err.contains(secret), "{sink}: {err}");
    }
}

/// A secret given through the environment that no sink uses: rotating it through the
/// deployment changed nothing, without a word.
#[test]
fn a_secret_in_the_environment_that_no_sink_uses_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused(
        relay(
            d,
            &["check"],
            &[("OUTBOX_RELAY_WEBHOOK_SECRET", "whsec_bmV3LWVudi1rZXk=")],
        ),
        "OUTBOX_RELAY_WEBHOOK_SECRET is set, but no webhook sink signs with it",
        "unset it",
    );
    std::fs::write(
        d.join("wh.toml"),
        "[sinks.hooks]\nuri = \"http://127.0.0.1:9/hook\"\nsecret = \"whsec_b2xkLWZpbGUta2V5\"\n",
    )
    .unwrap();
    refused(
        relay(
            d,
            &["--config", "wh.toml", "check"],
            &[("OUTBOX_RELAY_WEBHOOK_SECRET", "whsec_bmV3LWVudi1rZXk=")],
        ),
        "each has a `secret` of its own",
        "remove the `secret`",
    );
    refused(
        relay(
            d,
            &["check"],
            &[("OUTBOX_RELAY_ABLY_API_KEY", "app.key:secret")],
        ),
        "OUTBOX_RELAY_ABLY_API_KEY is set, but no sink is an Ably one",
        "unset it",
    );
}

/// A reader that leaves early (`| head`): the command panicked writing its output, and
/// said the relay had a bug. It now ends with its own exit code, quietly.
#[test]
fn a_command_whose_reader_left_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(relay(d, &["migrate"], &[]).status.success());
    for command in [&["settings"][..], &["dead", "list"][..], &["check"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(BIN)
            .args(command)
            .current_dir(d)
            .env_remove("DATABASE_URL")
            .env_remove("OUTBOX_RELAY_DATABASE_URL")
            .stdout(writer)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(0), "{command:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("bug"),
            "{command:?}: {err}"
        );
    }
    // A failing check still fails (`check | head -1` under pipefail).
    let empty = tempfile::tempdir().unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(BIN)
        .arg("check")
        .current_dir(empty.path())
        .env_remove("DATABASE_URL")
        .env_remove("OUTBOX_RELAY_DATABASE_URL")
        .stdout(writer)
        .output()
        .unwrap();
    let told = relay(empty.path(), &["check"], &[]);
    assert_ne!(
        told.status.code(),
        Some(0),
        "the unmigrated outbox fails the check"
    );
    assert_eq!(out.status.code(), told.status.code(), "{}", stderr(&out));
}

/// SQLite: commands that should make no database made one (`migrate --print`,
/// `drop-slot`, a `mode=rw` URI), and `--role`, which has no meaning there, passed
/// unnoticed. (`send` creates the file: a relay and `send` may start together on a new
/// one.)
#[test]
fn sqlite_commands_that_should_create_nothing_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let printed = relay(
        d,
        &["migrate", "--print", "--database-url", "sqlite:p.db"],
        &[],
    );
    assert!(printed.status.success(), "{}", stderr(&printed));
    assert!(String::from_utf8_lossy(&printed.stdout).contains("CREATE TABLE"));
    let out = relay(d, &["drop-slot", "--database-url", "sqlite:ds.db"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = relay(
        d,
        &["migrate", "--database-url", "sqlite:file:rw.db?mode=rw"],
        &[],
    );
    assert_ne!(out.status.code(), Some(0), "{}", stderr(&out));
    for file in ["typo.db", "p.db", "ds.db", "rw.db"] {
        assert!(!d.join(file).exists(), "{file} was made");
    }
    refused(
        relay(
            d,
            &[
                "migrate",
                "--print",
                "--role",
                "app",
                "--database-url",
                "sqlite:p.db",
            ],
            &[],
        ),
        "--role: SQLite has no roles",
        "read and write access",
    );
}

/// An empty log level (`OUTBOX_RELAY_LOG_LEVEL=` in a unit file) turned every log line off
/// without a word.
#[test]
fn an_empty_log_level_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    refused(
        relay(dir.path(), &["check"], &[("OUTBOX_RELAY_LOG_LEVEL", "")]),
        "the log level is empty",
        "`off` logs nothing",
    );
}

/// A level spelled wrong (`warning`) was read as a target logged alone: the relay then
/// logged nothing, errors included, and said nothing of it.
#[test]
fn a_misspelled_log_level_is_refused_with_the_level_meant() {
    let dir = tempfile::tempdir().unwrap();
    refused(
        relay(
            dir.path(),
            &["check"],
            &[("OUTBOX_RELAY_LOG_LEVEL", "warning")],
        ),
        "invalid log level \"warning\"",
        "did you mean \"warn\"?",
    );
    refused(
        relay(
            dir.path(),
            &["--log-level", "info,outbox_engine", "check"],
            &[],
        ),
        "\"outbox_engine\" is no level",
        "did you mean \"outbox_engine=debug\"?",
    );
}

/// `settings --config FILE` listed the defaults alone, as if the file set nothing. A setting
/// the configuration gives another value now shows it beside its default, with the URL's
/// password redacted; a configuration that does not load still gets the reference, then the
/// error and exit 2.
#[test]
fn settings_shows_what_the_configuration_sets_beside_each_default() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("given.toml"),
        "batch_size = 50\ndatabase_url = \"postgres://u:hunter2@db.example/app\"\n[retry]\nmax_attempts = 3\n",
    )
    .unwrap();
    let out = relay(d, &["settings", "--config", "given.toml"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    for line in [
        "batch_size = 50    (default: 1000)",
        "retry.max_attempts = 3    (default: 20)",
        "database_url = \"postgres://u:***@db.example/app\"    (default: \"sqlite:outbox.db\")",
        "max_in_flight = 10000\n",
    ] {
        assert!(said.contains(line), "{line:?} in {said}");
    }
    assert!(!said.contains("hunter2"), "{said}");

    std::fs::write(d.join("bad.toml"), "batch_size = \"many\"\n").unwrap();
    let out = relay(d, &["settings", "--config", "bad.toml"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("batch_size = 1000\n"));
    assert!(stderr(&out).contains("batch_size"), "{}", stderr(&out));
}

/// A NATS sink whose host does not resolve: the client's every reconnect attempt was logged
/// at INFO (ten lines in `check`'s first second, one a second after), and `check` said only
/// "is Pending". The loss is now said once, and `check` names the last error.
#[test]
fn check_names_why_nats_is_unreachable_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(relay(d, &["migrate"], &[]).status.success());
    let out = relay(
        d,
        &["check", "--sink", "nats://no-such-host.invalid:4222"],
        &[],
    );
    let (said, err) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_ne!(out.status.code(), Some(0), "{said}{err}");
    assert!(
        said.contains("no-such-host.invalid:4222 is Pending, the last attempt: nats:"),
        "{said}"
    );
    let lines = err.lines().filter(|l| l.contains("nats")).count();
    assert_eq!(lines, 1, "one line about the connection: {err}");
}

/// `send` from another directory than the relay's made a new `outbox.db` there, inserted
/// the event into it and said only "inserted": no relay read that file. It still makes the
/// file (send first, run later), and now says where, once.
#[test]
fn send_says_where_it_made_a_new_sqlite_database() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let send = || relay(d, &["send", "--destination", "d", "--type", "t", "{}"], &[]);
    let first = send();
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let made = d.canonicalize().unwrap().join("outbox.db");
    assert!(
        stderr(&first).contains(&format!("made a new SQLite database at {}", made.display())),
        "{}",
        stderr(&first)
    );
    let second = send();
    assert_eq!(second.status.code(), Some(0), "{}", stderr(&second));
    assert!(
        !stderr(&second).contains("made a new"),
        "{}",
        stderr(&second)
    );
}

/// A settings file that sets a secret, or a token or URL file, that every user of the host
/// may read is named in a warning with its fix; the relay runs on (libpq does the same with
/// a readable password file). A file private to the relay, or a settings file with no
/// secret in it, is not named.
#[test]
fn a_secret_every_user_may_read_is_warned_about_naming_the_file_and_the_fix() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let set = |name: &str, mode: u32| {
        std::fs::set_permissions(d.join(name), std::fs::Permissions::from_mode(mode)).unwrap()
    };
    // The temporary directory is private: made passable, as /etc/outbox-relay would be.
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(
        d.join("relay.toml"),
        "admin_token = \"0123456789abcdef0123\"\n\
         [sinks.hooks]\nuri = \"http://127.0.0.1:1/h\"\nsecret = \"hook-signing-secret\"\n\
         [[routes]]\ndestinations = \"*\"\nsink = \"hooks\"\n",
    )
    .unwrap();
    std::fs::write(d.join("plain.toml"), "batch_size = 50\n").unwrap();
    std::fs::write(d.join("token"), "0123456789abcdef0123\n").unwrap();
    for name in ["relay.toml", "plain.toml", "token"] {
        set(name, 0o644);
    }

    let out = relay(d, &["--config", "relay.toml", "settings"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("the settings file relay.toml (it sets admin_token, sinks.hooks.secret) can be read by every user of this host (mode 0644)"),
        "{err}"
    );
    assert!(err.contains("chmod 600 relay.toml"), "{err}");
    assert!(
        !err.contains("hook-signing-secret") && !err.contains("0123456789abcdef"),
        "{err}"
    );

    let token = d.join("token");
    let out = relay(
        d,
        &["--config", "plain.toml", "settings"],
        &[("OUTBOX_RELAY_ADMIN_TOKEN_FILE", token.to_str().unwrap())],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "the admin token file {} can be read by every user",
            token.display()
        )),
        "{err}"
    );
    assert!(
        !err.contains("plain.toml"),
        "a settings file without a secret: {err}"
    );

    set("relay.toml", 0o640);
    set("token", 0o600);
    let out = relay(d, &["--config", "relay.toml", "settings"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("every user"), "{}", stderr(&out));
    let out = relay(
        d,
        &["--config", "plain.toml", "settings"],
        &[("OUTBOX_RELAY_ADMIN_TOKEN_FILE", token.to_str().unwrap())],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("every user"), "{}", stderr(&out));
}

/// A Kafka broker that refuses connections: librdkafka reported each attempt as a log line
/// and twice more as identical "Global error" lines, three ERROR lines a time. Its global
/// errors now go to debug; its own log line, which says why, stays.
#[test]
fn a_kafka_broker_that_refuses_connections_is_reported_once_an_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sink = format!("kafka://127.0.0.1:{port}");
    let out = relay(dir.path(), &["check", "--sink", &sink], &[]);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("Connection refused"), "{said}");
    assert!(!said.contains("Global error"), "{said}");
}

/// A sink's `max_message_bytes` above what the sink can ever send (librdkafka's
/// `message.max.bytes`, a service's limit) was taken, and each event between the two was
/// refused anyway by the sink's own check, its error naming neither setting.
#[test]
fn a_max_message_bytes_above_the_sinks_own_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (sink, fix) in [
        (
            "uri = \"kafka://127.0.0.1:9\"\nmax_message_bytes = 3000000\n",
            "message.max.bytes",
        ),
        (
            "uri = \"sns:\"\nregion = \"us-east-1\"\nmax_message_bytes = 5000000\n",
            "the service takes no more",
        ),
    ] {
        std::fs::write(
            dir.path().join("big.toml"),
            format!("[sinks.main]\n{sink}[[routes]]\ndestinations = \"*\"\nsink = \"main\"\n"),
        )
        .unwrap();
        let out = relay(
            dir.path(),
            &["--config", "big.toml", "check"],
            &[
                ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
                ("AWS_SECRET_ACCESS_KEY", "x"),
            ],
        );
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert_eq!(out.status.code(), Some(2), "{sink}: {said}");
        assert!(
            said.contains("max_message_bytes") && said.contains(fix),
            "{sink}: {said}"
        );
    }
}

/// An in-memory SQLite database lives inside one process: `send` said it inserted an event
/// that no relay could ever read, and `migrate` and `run` reported success on nothing.
#[test]
fn an_in_memory_sqlite_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "sqlite::memory:",
        "sqlite:file::memory:?cache=shared",
        "sqlite:file:outbox.db?mode=memory",
    ] {
        for command in [&["send", "--destination", "d", "{}"][..], &["migrate"][..]] {
            let args: Vec<&str> = command
                .iter()
                .copied()
                .chain(["--database-url", url])
                .collect();
            refused(
                relay(dir.path(), &args, &[]),
                "in-memory SQLite",
                "give a file",
            );
        }
    }
}

/// A database the relay may read but not write (here opened `mode=ro`, as SQLite opens a
/// file its user may not write): `check` said ok, and `run` failed on its first write.
#[test]
fn check_fails_a_sqlite_database_the_relay_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let migrated = relay(dir.path(), &["migrate"], &[]);
    assert!(migrated.status.success(), "{}", stderr(&migrated));
    let out = relay(
        dir.path(),
        &["check", "--database-url", "sqlite:file:outbox.db?mode=ro"],
        &[],
    );
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("the relay cannot write the database") && said.contains("chmod"),
        "{said}"
    );
    // What only reads needs no write: `stats` serves a database it may only read.
    let stats = relay(
        dir.path(),
        &["stats", "--database-url", "sqlite:file:outbox.db?mode=ro"],
        &[],
    );
    assert!(stats.status.success(), "{}", stderr(&stats));
    let writable = relay(dir.path(), &["check"], &[]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&writable.stdout),
        stderr(&writable)
    );
    assert!(!said.contains("cannot write"), "{said}");
}

/// `send` of a payload too long for a command line (about 128 KiB) could not be done at all:
/// `-` reads it from stdin, `@FILE` from a file. A header given twice lost its first value
/// without a word; it is refused.
#[test]
fn send_reads_a_large_payload_from_a_file_or_stdin_and_refuses_a_header_twice() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(512 * 1024));
    std::fs::write(d.join("payload.json"), &big).unwrap();
    let from_file = relay(d, &["send", "--destination", "d", "@payload.json"], &[]);
    assert!(from_file.status.success(), "{}", stderr(&from_file));
    let mut child = Command::new(BIN)
        .args(["send", "--destination", "d", "-"])
        .current_dir(d)
        .env_remove("DATABASE_URL")
        .env_remove("OUTBOX_RELAY_DATABASE_URL")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(big.as_bytes())
        .unwrap();
    let from_stdin = child.wait_with_output().unwrap();
    assert!(from_stdin.status.success(), "{}", stderr(&from_stdin));
    let drained = relay(
        d,
        &[
            "run",
            "--drain",
            "--http-addr",
            "",
            "--sink",
            "file:out.jsonl",
        ],
        &[],
    );
    assert!(drained.status.success(), "{}", stderr(&drained));
    let out = std::fs::read_to_string(d.join("out.jsonl")).unwrap();
    assert_eq!(out.lines().count(), 2);
    assert!(out.lines().all(|l| l.len() > 512 * 1024), "payloads cut");
    refused(
        relay(d, &["send", "--destination", "d", "@missing.json"], &[]),
        "cannot read the payload from missing.json",
        "UTF-8 JSON",
    );
    refused(
        relay(
            d,
            &[
                "send",
                "--destination",
                "d",
                "--header",
                "a=b",
                "--header",
                "a=c",
                "{}",
            ],
            &[],
        ),
        "header \"a\" is given more than once",
        "give each header once",
    );
}

/// A file that is no SQLite database: the fix said "fix the configuration value named in
/// the message", which named none.
#[test]
fn a_file_that_is_no_sqlite_database_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("notes.db"),
        "hello, these are notes\n".repeat(100),
    )
    .unwrap();
    let out = relay(
        dir.path(),
        &["check", "--database-url", "sqlite:notes.db"],
        &[],
    );
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("not an SQLite database") && said.contains("--database-url"),
        "{said}"
    );
}

/// A table named `outbox` that is not the relay's (an application's own): `migrate` failed
/// with "no such column: sequence_id in …", the whole DDL quoted, and again the same way.
#[test]
fn migrate_names_a_foreign_outbox_table() {
    let dir = tempfile::tempdir().unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("outbox.db")).unwrap();
    conn.execute_batch("CREATE TABLE outbox (id INTEGER PRIMARY KEY, payload TEXT)")
        .unwrap();
    drop(conn);
    refused(
        relay(dir.path(), &["migrate"], &[]),
        "a table named outbox already exists, with other columns (id, payload)",
        "rename that table",
    );
}

/// A drain that dead-lettered every event said "the rest was delivered", of nothing.
#[test]
fn a_drain_that_delivered_nothing_does_not_say_the_rest_was_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for key in ["a", "b"] {
        let sent = relay(d, &["send", "--destination", "d", "--key", key, "{}"], &[]);
        assert!(sent.status.success(), "{}", stderr(&sent));
    }
    let out = relay(
        d,
        &[
            "run",
            "--drain",
            "--http-addr",
            "",
            "--sink",
            "file:/dev/full",
            "--max-attempts",
            "1",
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("2 events were dead-lettered"), "{err}");
    assert!(!err.contains("the rest was delivered"), "{err}");
}
