//! The packages: the container image (buildah), the Debian package and its systemd unit
//! (dpkg, systemd-analyze), the Kubernetes manifests (kustomize, the API's schemas) and the
//! quickstart. Each builds from this test build's relay binary; the release figures are in
//! the README and BENCHMARKS.md.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use outbox_testkit::eventually;

use crate::support;

use crate::support::{text, BIN};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a command to completion; its output. Panics, naming the fix, if it cannot start.
fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(repository())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {program}: {e} (scripts/servers.sh install installs it)")
        })
}

fn succeeded(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?} failed:\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// An image built with buildah, removed (with its containers) when dropped.
struct Image {
    tag: String,
    containers: Vec<String>,
}

impl Drop for Image {
    fn drop(&mut self) {
        for container in &self.containers {
            let _ = run("buildah", &["umount", container]);
            let _ = run("buildah", &["rm", container]);
        }
        let _ = run("buildah", &["rmi", "-f", &self.tag]);
    }
}

/// The image is built FROM scratch, with the user, entrypoint, port and health check a
/// runtime reads; its entrypoint runs from the image's own filesystem and relays events
/// from PostgreSQL to NATS, and its HEALTHCHECK command passes.
///
/// `podman run` is tried first. Where it cannot start a container (this machine's sandbox
/// refuses crun's setrlimit), the image is mounted (`buildah mount`) and its entrypoint run
/// under `chroot` as the image's user, with the image's environment: the binary, its
/// libraries and the CA bundle are then the image's, not the host's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_its_entrypoint_from_its_own_filesystem_and_relays_events() {
    let tag = format!(
        "localhost/outbox-relay:test-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let built = succeeded("scripts/image.sh", &[BIN, &tag]);
    assert_eq!(built.trim(), tag);
    let mut image = Image {
        tag: tag.clone(),
        containers: Vec::new(),
    };
    let env = the_images_configuration_is_a_scratch_relay(&tag);
    let podman = run("podman", &["run", "--rm", &tag, "--version"]);
    let podman_runs = podman.status.success();
    if !podman_runs {
        eprintln!(
            "podman cannot run containers here ({}); running the image's entrypoint under chroot",
            text(&podman.stderr).lines().last().unwrap_or_default()
        );
    }

    let container = succeeded("buildah", &["from", &tag]).trim().to_string();
    image.containers.push(container.clone());
    let root = succeeded("buildah", &["mount", &container])
        .trim()
        .to_string();
    let root = Path::new(&root);
    what_runs_is_the_images_own(root);
    the_images_relay_delivers_and_passes_its_healthcheck(root, &env).await;
}

/// Its user, entrypoint, command, port and HEALTHCHECK, over one layer; returns its
/// environment.
fn the_images_configuration_is_a_scratch_relay(tag: &str) -> Vec<String> {
    let inspect: serde_json::Value =
        serde_json::from_str(&succeeded("buildah", &["inspect", "--type", "image", tag])).unwrap();
    let config = &inspect["Docker"]["config"];
    assert_eq!(config["User"], "65532:65532", "{config}");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/usr/local/bin/outbox-relay"])
    );
    assert_eq!(config["Cmd"], serde_json::json!(["run"]));
    assert!(config["ExposedPorts"]["2259/tcp"].is_object(), "{config}");
    assert_eq!(
        config["Healthcheck"]["Test"],
        serde_json::json!(["CMD", "/usr/local/bin/outbox-relay", "health"])
    );
    // FROM scratch: one layer, the staged root.
    let layers = inspect["Docker"]["rootfs"]["diff_ids"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{inspect}");
    let env: Vec<String> = config["Env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();

    env
}

/// What runs is the image's: its binary, its loader and libraries, its CA bundle.
fn what_runs_is_the_images_own(root: &Path) {
    for file in [
        "usr/local/bin/outbox-relay",
        "etc/ssl/certs/ca-certificates.crt",
        "etc/passwd",
    ] {
        assert!(
            root.join(file).is_file(),
            "{file} is missing from the image"
        );
    }
    assert!(
        !root.join("bin/sh").exists(),
        "a shell in a FROM scratch image"
    );
    // The working directory, where the default SQLite database goes, is the relay user's:
    // COPY made it root's (mode 0700) whatever the staging gave it.
    use std::os::unix::fs::MetadataExt;
    let state = std::fs::metadata(root.join("var/lib/outbox-relay")).unwrap();
    assert_eq!((state.uid(), state.gid()), (65532, 65532));
    // Every library ldd names, the dynamic loader too, is in the image.
    let ldd = succeeded("ldd", &[BIN]);
    for path in ldd.split_whitespace().filter(|w| w.starts_with('/')) {
        assert!(
            root.join(path.trim_start_matches('/')).exists(),
            "{path} is missing from the image"
        );
    }
}

/// Started as a runtime would start it, the image's relay migrates, delivers from
/// PostgreSQL to NATS, passes its HEALTHCHECK and readiness, and stops cleanly.
async fn the_images_relay_delivers_and_passes_its_healthcheck(root: &Path, env: &[String]) {
    let database = outbox_testkit::fresh_pg_database().await;
    let nats_url = std::env::var("OUTBOX_TEST_NATS_URL")
        .expect("OUTBOX_TEST_NATS_URL is not set: source /tmp/servers.env");
    let (js, prefix) = support::nats_stream().await;
    let port = outbox_testkit::server::free_port();
    // The settings file, where a volume would mount it (read-only to the relay's user);
    // the secrets in the environment.
    std::fs::write(
        root.join("etc/outbox-relay/outbox-relay.toml"),
        format!("sink = \"{nats_url}\"\nbatch_size = 7\n"),
    )
    .unwrap();
    // As a runtime would start it: only the image's environment and what the operator adds.
    let in_image = |args: &[&str]| {
        let mut command = Command::new("chroot");
        command
            .arg("--userspec=65532:65532")
            .arg(root)
            .arg("/usr/local/bin/outbox-relay")
            .args(args)
            .env_clear();
        for pair in env {
            if let Some((k, v)) = pair.split_once('=') {
                command.env(k, v);
            }
        }
        command
            .env("DATABASE_URL", &database)
            .env("OUTBOX_RELAY_CONFIG", "/etc/outbox-relay/outbox-relay.toml")
            .env("OUTBOX_RELAY_HTTP_ADDR", format!("0.0.0.0:{port}"))
            .env("OUTBOX_RELAY_ADMIN_TOKEN", "image-test-token-0123456789");
        command
    };
    let migrated = in_image(&["migrate"]).output().unwrap();
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));

    let log = tempfile::NamedTempFile::new().unwrap();
    let mut relay = in_image(&["run"])
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let pg = support::pg(&database).await;
    for i in 0..20 {
        pg.execute(
            "INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ($1, $2, 't', '{}')",
            &[&format!("{prefix}.orders"), &format!("k{}", i % 4)],
        )
        .await
        .unwrap();
    }
    let delivered = || support::stream_len(&js, &prefix);
    let logs = || std::fs::read_to_string(log.path()).unwrap_or_default();
    outbox_testkit::eventually_explained(
        "the image's relay to deliver 20 events",
        Duration::from_secs(60),
        logs,
        || async { (delivered().await == 20).then_some(()) },
    )
    .await;
    // The image's HEALTHCHECK command, and readiness, from inside the image.
    let healthy = eventually("the HEALTHCHECK to pass", Duration::from_secs(30), || {
        let out = in_image(&["health"]).output().unwrap();
        async move { out.status.success().then_some(out) }
    })
    .await;
    assert_eq!(text(&healthy.stdout).trim(), "ok");
    let ready = in_image(&["health", "--ready"]).output().unwrap();
    assert!(ready.status.success(), "{}", text(&ready.stderr));

    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let status = relay.wait().unwrap();
    assert!(status.success(), "{status:?}\n{}", logs());
    assert!(!logs().contains("panicked"), "{}", logs());
}

/// Whether the package is installed (`dpkg -s`).
fn installed() -> bool {
    run("dpkg", &["-s", "outbox-relay"]).status.success()
}

/// The package builds, installs, its unit verifies with an exposure of at most 2.0, the
/// installed binary relays with the packaged configuration as the unit runs it, and
/// removing then purging leaves nothing behind.
#[test]
fn the_debian_package_installs_a_hardened_unit_and_purges_cleanly() {
    assert!(
        !installed(),
        "outbox-relay is already installed on this machine: this test installs and purges \
         it, so remove it first (dpkg -P outbox-relay)"
    );
    let out_dir = tempfile::tempdir().unwrap();
    let deb = build_the_package(out_dir.path());
    struct Purge;
    impl Drop for Purge {
        fn drop(&mut self) {
            let _ = run("dpkg", &["-P", "outbox-relay"]);
        }
    }
    let _purge = Purge;
    succeeded("dpkg", &["-i", &deb]);
    assert!(installed());

    let unit = "/lib/systemd/system/outbox-relay.service";
    the_unit_verifies_with_an_exposure_of_at_most_2(unit);
    the_unit_is_hardened_and_takes_its_secrets_as_credentials(unit);
    the_installed_binary_relays_as_the_unit_runs_it();
    succeeded("dpkg", &["-r", "outbox-relay"]);
    assert!(!Path::new("/usr/bin/outbox-relay").exists());
    assert!(!Path::new(unit).exists());
    assert!(
        Path::new("/etc/outbox-relay/outbox-relay.toml").exists(),
        "remove keeps the configuration"
    );
    // The credentials the README has the operator write there.
    for secret in ["database-url", "admin-token"] {
        std::fs::write(Path::new("/etc/outbox-relay").join(secret), "secret\n").unwrap();
    }
    succeeded("dpkg", &["-P", "outbox-relay"]);
    assert!(!Path::new("/etc/outbox-relay").exists(), "purge removes it");
    assert!(!installed());
}

/// Built from the test build, versioned dependencies from the binary's symbols; the path of
/// the package.
fn build_the_package(out_dir: &Path) -> String {
    let built = Command::new("scripts/deb.sh")
        .args([BIN, out_dir.to_str().unwrap()])
        .env("OUTBOX_DEB_COMPRESSION", "gzip")
        .current_dir(repository())
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", text(&built.stderr));
    let deb = text(&built.stdout).trim().to_string();
    let info = succeeded("dpkg-deb", &["--info", &deb]);
    // Versioned, from the binary's symbols (dpkg-shlibdeps).
    assert!(info.contains("Depends: libc6 (>= "), "{info}");

    deb
}

fn the_unit_verifies_with_an_exposure_of_at_most_2(unit: &str) {
    let verify = run("systemd-analyze", &["verify", unit]);
    let said = format!("{}{}", text(&verify.stdout), text(&verify.stderr));
    assert!(
        verify.status.success() && !said.contains("outbox-relay.service:"),
        "systemd-analyze verify: {said}"
    );
    let security = succeeded(
        "systemd-analyze",
        &["security", "--offline=true", "--no-pager", unit],
    );
    let exposure: f64 = security
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for outbox-relay.service: ")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{security}"));
    assert!(exposure <= 2.0, "exposure {exposure}:\n{security}");
    eprintln!("systemd-analyze security --offline=true: exposure {exposure}");
}

fn the_unit_is_hardened_and_takes_its_secrets_as_credentials(unit: &str) {
    let unit_text = std::fs::read_to_string(unit).unwrap();
    for setting in [
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "Restart=on-failure",
        "EnvironmentFile=-/etc/outbox-relay/outbox-relay.env",
        // Room for up to 256 HTTP clients beside the database and broker connections.
        "LimitNOFILE=65536",
        // The stdout sink's events are journal lines: none dropped by its rate limit.
        "LogRateLimitIntervalSec=0",
    ] {
        assert!(unit_text.contains(setting), "{setting} missing");
    }
    // systemd takes a `#` after a value as part of it: uncommented, a hint on the token's
    // line became the token.
    let env_text = std::fs::read_to_string("/etc/outbox-relay/outbox-relay.env").unwrap();
    for line in env_text.lines().map(|l| l.trim_start_matches("# ")) {
        if line.starts_with("OUTBOX_RELAY_") || line.starts_with("DATABASE_URL") {
            assert!(!line.contains('#'), "a comment on a setting's line: {line}");
        }
    }
    // The database URL and the admin token as credentials, each with a default so that a
    // missing file does not fail the unit; the environment file's lines (commented out
    // until the files exist) name where systemd puts them.
    let env_file = std::fs::read_to_string("/etc/outbox-relay/outbox-relay.env").unwrap();
    let credentials = Path::new("/run/credentials/outbox-relay.service");
    for (id, variable) in [
        ("database-url", "OUTBOX_RELAY_DATABASE_URL_FILE"),
        ("admin-token", "OUTBOX_RELAY_ADMIN_TOKEN_FILE"),
    ] {
        let load = format!("LoadCredential={id}:/etc/outbox-relay/{id}");
        let default = format!("SetCredential={id}:\\n");
        assert!(unit_text.lines().any(|l| l == load), "{load} missing");
        assert!(unit_text.lines().any(|l| l == default), "{default} missing");
        let line = format!("# {variable}={}", credentials.join(id).display());
        assert!(env_file.lines().any(|l| l == line), "{line} missing");
    }
    // Secrets go in the environment file: root's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata("/etc/outbox-relay/outbox-relay.env")
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// The installed binary, with the packaged configuration in a state directory as the unit
/// runs it: credentials read from their files, an event sent and drained.
fn the_installed_binary_relays_as_the_unit_runs_it() {
    let version = succeeded("/usr/bin/outbox-relay", &["--version"]);
    assert!(
        version.contains(env!("CARGO_PKG_VERSION")) && version.contains('('),
        "{version}"
    );
    // As the unit runs it: the packaged configuration, in its state directory.
    let state = tempfile::tempdir().unwrap();
    let as_unit = |args: &[&str]| {
        Command::new("/usr/bin/outbox-relay")
            .args(["--config", "/etc/outbox-relay/outbox-relay.toml"])
            .args(args)
            .current_dir(state.path())
            .env_remove("DATABASE_URL")
            .output()
            .unwrap()
    };
    // The credentials as the unit hands them over: the URL from its file; the default (a
    // lone newline, when no file was written) refused by name.
    let creds = tempfile::tempdir().unwrap();
    let url_file = creds.path().join("database-url");
    std::fs::write(&url_file, "sqlite:from-credential.db\n").unwrap();
    let with_credential = Command::new("/usr/bin/outbox-relay")
        .args(["--config", "/etc/outbox-relay/outbox-relay.toml", "migrate"])
        .current_dir(state.path())
        .env_remove("DATABASE_URL")
        .env("OUTBOX_RELAY_DATABASE_URL_FILE", &url_file)
        .output()
        .unwrap();
    assert!(
        with_credential.status.success(),
        "{}",
        text(&with_credential.stderr)
    );
    assert!(state.path().join("from-credential.db").exists());
    std::fs::write(&url_file, "\n").unwrap();
    let unwritten = Command::new("/usr/bin/outbox-relay")
        .args(["--config", "/etc/outbox-relay/outbox-relay.toml", "run"])
        .current_dir(state.path())
        .env_remove("DATABASE_URL")
        .env("OUTBOX_RELAY_DATABASE_URL_FILE", &url_file)
        .output()
        .unwrap();
    assert_eq!(unwritten.status.code(), Some(2));
    assert!(
        text(&unwritten.stderr).contains("database-url is empty"),
        "{}",
        text(&unwritten.stderr)
    );
    let sent = as_unit(&["send", "--destination", "packaged", "{\"hello\":1}"]);
    assert!(sent.status.success(), "{}", text(&sent.stderr));
    let drained = as_unit(&["run", "--drain", "--http-addr", ""]);
    assert!(drained.status.success(), "{}", text(&drained.stderr));
    assert!(
        text(&drained.stdout).contains("\"destination\":\"packaged\""),
        "{}",
        text(&drained.stdout)
    );
}

/// Every overlay builds with kustomize, and validates (strictly) against the Kubernetes
/// 1.31 API schemas shipped by the PyPI `kubernetes-validate` package. The ServiceMonitor,
/// a CRD without a schema there, is checked against the Service it selects.
#[test]
fn the_kubernetes_manifests_build_and_validate_against_the_api_schemas() {
    let python = std::env::var("OUTBOX_TEST_PYTHON")
        .expect("OUTBOX_TEST_PYTHON is not set: source /tmp/servers.env");
    let validate = Path::new(&python).with_file_name("kubernetes-validate");
    let dir = tempfile::tempdir().unwrap();
    // kubectl's own kustomize, or where it is too old to build them (Debian 12's kubectl
    // 1.20), the kustomize scripts/servers.sh fetched.
    let kustomize = std::env::var("OUTBOX_TEST_KUSTOMIZE").ok();
    for overlay in ["production", "development"] {
        let path = format!("deploy/kubernetes/overlays/{overlay}");
        let built = match &kustomize {
            Some(kustomize) => succeeded(kustomize, &["build", &path]),
            None => succeeded("kubectl", &["kustomize", &path]),
        };
        let file = dir.path().join(format!("{overlay}.yaml"));
        std::fs::write(&file, &built).unwrap();
        let out = run(
            validate.to_str().unwrap(),
            &["-k", "1.31.0", "--strict", file.to_str().unwrap()],
        );
        let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{overlay}: {said}");
        // The overlay makes its namespace: `kubectl apply -k` on a new cluster was refused
        // ("namespaces \"outbox-relay\" not found").
        let namespace = match overlay {
            "production" => "outbox-relay",
            _ => "outbox-relay-dev",
        };
        let namespace_resource = format!("namespace/{namespace}");
        for resource in [
            namespace_resource.as_str(),
            "deployment/outbox-relay",
            "job/outbox-relay-migrate",
            "secret/outbox-relay-migrate",
            "poddisruptionbudget/outbox-relay",
            "service/outbox-relay",
            "secret/outbox-relay",
            "secret/outbox-relay-env",
            "configmap/outbox-relay-config",
            "networkpolicy/outbox-relay",
            "networkpolicy/outbox-relay-migrate",
        ] {
            assert!(
                said.contains(&format!("passed for resource {resource}")),
                "{overlay}: {resource} not validated: {said}"
            );
        }
        // What the schemas cannot say: probes, grace period, selectors, the monitor.
        let check = Command::new(&python)
            .arg("-c")
            .arg(MANIFEST_CHECKS)
            .arg(&file)
            .arg(overlay)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "{overlay}: {}{}",
            text(&check.stdout),
            text(&check.stderr)
        );
    }
}

/// Checks of the built manifests that a schema cannot make (PyYAML, which moto brings).
const MANIFEST_CHECKS: &str = r#"
import sys, yaml, re
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
overlay = sys.argv[2]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
namespace = by_kind["Namespace"][0]["metadata"]["name"]
for d in docs:
    if d["kind"] != "Namespace":
        assert d["metadata"].get("namespace") == namespace, (d["kind"], d["metadata"])
deploy = by_kind["Deployment"][0]
pod = deploy["spec"]["template"]
c = pod["spec"]["containers"][0]
assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", c
assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", c
assert c["resources"]["requests"]["memory"], c
assert c["securityContext"]["readOnlyRootFilesystem"] is True
assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
# Service links would put OUTBOX_RELAY_SERVICE_HOST and the like in the relay's settings.
assert pod["spec"]["enableServiceLinks"] is False
labels = pod["metadata"]["labels"]
for kind in ("PodDisruptionBudget",):
    sel = by_kind[kind][0]["spec"]["selector"]["matchLabels"]
    assert all(labels.get(k) == v for k, v in sel.items()), (kind, sel, labels)
svc = by_kind["Service"][0]
assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
ports = {p["name"] for p in svc["spec"]["ports"]}
# The grace period covers shutdown_timeout plus the relay's 2 s backstop.
config = by_kind["ConfigMap"][0]["data"]["outbox-relay.toml"]
timeout = int(re.search(r'shutdown_timeout = "(\d+)s"', config).group(1))
assert deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= timeout + 2 + 5
secrets = {s["metadata"]["name"]: s for s in by_kind["Secret"]}
env = {e["name"]: e.get("value") for e in c["env"]}
assert "OUTBOX_RELAY_NODE_ID" in env
# The database URL and the admin token are files of a Secret's volume, read through
# *_FILE settings; neither is in the environment.
mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
files = [v for v in volumes.values() if "secret" in v]
assert len(files) == 1, volumes
secret_volume = files[0]
secret = secrets[secret_volume["secret"]["secretName"]]["stringData"]
directory = mounts[secret_volume["name"]]
assert env["OUTBOX_RELAY_DATABASE_URL_FILE"] == directory + "/database-url", env
assert env["OUTBOX_RELAY_ADMIN_TOKEN_FILE"] == directory + "/admin-token", env
assert "database-url" in secret and "admin-token" in secret, secret
for s in secrets.values():
    for key in s["stringData"]:
        assert key not in ("DATABASE_URL", "OUTBOX_RELAY_DATABASE_URL", "OUTBOX_RELAY_ADMIN_TOKEN"), key
for source in c["envFrom"]:
    assert source["secretRef"]["name"] in secrets, source
    assert source["secretRef"]["name"] != secret_volume["secret"]["secretName"]
# Room for what the bounded HTTP server can hold (about 105 MB of header buffers from 256
# connections, 22 MB of admin bodies) beside the relay's own 41 MB peak and its in-flight
# events: at least 512 MiB.
limit = c["resources"]["limits"]["memory"]
assert limit.endswith("Mi") and int(limit[:-2]) >= 512, limit
# The NetworkPolicy: the relay's pods, ingress to the HTTP port only, egress to DNS, the
# database and the broker only; its peers select Prometheus and DNS, not the relay.
policy = [p["spec"] for p in by_kind["NetworkPolicy"] if p["metadata"]["name"] == "outbox-relay"][0]
assert all(labels.get(k) == v for k, v in policy["podSelector"]["matchLabels"].items())
assert policy["podSelector"]["matchLabels"], policy
assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
http = [p for p in c["ports"] if p["name"] == "http"][0]
for rule in policy["ingress"]:
    assert [p["port"] for p in rule["ports"]] in (["http"], [http["containerPort"]]), rule
    for peer in rule["from"]:
        assert "ipBlock" not in peer, peer
        assert peer["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "prometheus", peer
egress_ports = sorted(p["port"] for rule in policy["egress"] for p in rule["ports"])
assert egress_ports == [53, 53, 4222, 5432], egress_ports
dns = [r for r in policy["egress"] if any(p["port"] == 53 for p in r["ports"])][0]
assert dns["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}, dns
# The migration Job: `migrate` with the relays' settings file and image, as the role of a
# Secret of its own (the relays' role needs no DDL), in a pod no relay selector matches.
job = by_kind["Job"][0]
jpod = job["spec"]["template"]
jc = jpod["spec"]["containers"][0]
assert jc["args"][0] == "migrate" and "--grant-to" in jc["args"], jc
assert jc["envFrom"] == c["envFrom"], (jc["envFrom"], c["envFrom"])
assert jc["image"] == c["image"], (jc["image"], c["image"])
jenv = {e["name"]: e.get("value") for e in jc["env"]}
assert jenv["OUTBOX_RELAY_CONFIG"] == env["OUTBOX_RELAY_CONFIG"], jenv
jvolumes = {v["name"]: v for v in jpod["spec"]["volumes"]}
jmounts = {m["name"]: m["mountPath"] for m in jc["volumeMounts"]}
[jsecret] = [v for v in jvolumes.values() if "secret" in v]
assert jsecret["secret"]["secretName"] != secret_volume["secret"]["secretName"], jsecret
assert "database-url" in secrets[jsecret["secret"]["secretName"]]["stringData"]
assert jenv["OUTBOX_RELAY_DATABASE_URL_FILE"] == jmounts[jsecret["name"]] + "/database-url", jenv
[jconfig] = [v for v in jvolumes.values() if "configMap" in v]
assert jconfig["configMap"]["name"] == by_kind["ConfigMap"][0]["metadata"]["name"]
assert jpod["spec"]["restartPolicy"] == "OnFailure"
assert job["spec"]["ttlSecondsAfterFinished"] > 0
assert jpod["spec"]["enableServiceLinks"] is False
assert jpod["spec"]["securityContext"]["runAsNonRoot"] is True
assert jc["securityContext"]["readOnlyRootFilesystem"] is True
jlabels = jpod["metadata"]["labels"]
policies = {p["metadata"]["name"]: p["spec"] for p in by_kind["NetworkPolicy"]}
for selector in (svc["spec"]["selector"], by_kind["PodDisruptionBudget"][0]["spec"]["selector"]["matchLabels"],
                 policies["outbox-relay"]["podSelector"]["matchLabels"]):
    assert not all(jlabels.get(k) == v for k, v in selector.items()), (selector, jlabels)
# Its own policy: no ingress, egress to DNS and the database only.
jpolicy = policies["outbox-relay-migrate"]
assert all(jlabels.get(k) == v for k, v in jpolicy["podSelector"]["matchLabels"].items())
assert sorted(jpolicy["policyTypes"]) == ["Egress", "Ingress"] and not jpolicy.get("ingress")
assert sorted(p["port"] for rule in jpolicy["egress"] for p in rule["ports"]) == [53, 53, 5432]
if overlay == "production":
    assert deploy["spec"]["replicas"] == 3
    assert c["image"].startswith("registry.example.com/outbox-relay:"), c["image"]
    mon = by_kind["ServiceMonitor"][0]
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in mon["spec"]["selector"]["matchLabels"].items())
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= ports
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"
else:
    assert deploy["spec"]["replicas"] == 1
    assert "ServiceMonitor" not in by_kind
print("ok")
"#;

/// `scripts/quickstart.sh --events N` starts its own PostgreSQL and NATS, migrates, runs
/// the relay and the demo writer, and exits 0 once the subscriber saw every event.
#[test]
fn the_quickstart_shows_events_flowing_and_stops_what_it_started() {
    let state = tempfile::tempdir().unwrap();
    // Its own servers on free ports: on its default ports, another test's server given one of
    // them as a free port answered the quickstart's readiness check, then went away.
    // NATS's monitoring port too: the one after its client port was once another test's relay,
    // whose /healthz passed for a NATS that never started. All four different: PostgreSQL
    // and NATS were once given the same one.
    let [port, pg_port, nats_port, nats_monitor_port] = outbox_testkit::server::free_ports();
    let out = Command::new("scripts/quickstart.sh")
        .args(["--events", "6"])
        .env("OUTBOX_QUICKSTART_BIN", BIN)
        .env("OUTBOX_QUICKSTART_STATE", state.path())
        .env("OUTBOX_QUICKSTART_HTTP", format!("127.0.0.1:{port}"))
        .env("OUTBOX_QUICKSTART_PG_PORT", pg_port.to_string())
        .env("OUTBOX_QUICKSTART_NATS_PORT", nats_port.to_string())
        .env(
            "OUTBOX_QUICKSTART_NATS_MONITOR_PORT",
            nats_monitor_port.to_string(),
        )
        .current_dir(repository())
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let received = stdout.lines().filter(|l| l.starts_with("received")).count();
    assert_eq!(received, 6, "{stdout}");
    assert!(stdout.contains("received  demo.orders"), "{stdout}");
    // Nothing it started is left running. (Its servers' processes, not their ports: another
    // test's server may be given 54242 or 54349 as a free port once they are let go.)
    if let Ok(nats_pid) = std::fs::read_to_string(state.path().join("nats/nats.pid")) {
        assert!(
            !Path::new("/proc").join(nats_pid.trim()).exists(),
            "nats-server {} is still running",
            nats_pid.trim()
        );
    }
    assert!(
        !state.path().join("pg/data/postmaster.pid").exists(),
        "PostgreSQL is still running"
    );
}

/// `scripts/servers.sh` counts NATS as started only when its own monitoring port names its
/// client port: another server answering `/healthz` on that port (another test's relay,
/// once) passed for a NATS that never started, and the script said it was ready.
#[test]
fn the_test_servers_script_does_not_take_another_http_server_for_nats() {
    let state = tempfile::tempdir().unwrap();
    // On the port after NATS's, where NATS monitors by default: a free port whose
    // predecessor is free too.
    let (monitor, nats_port) = loop {
        let monitor = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let nats_port = monitor.local_addr().unwrap().port() - 1;
        if std::net::TcpListener::bind(("127.0.0.1", nats_port)).is_ok() {
            break (monitor, nats_port);
        }
    };
    // Answers 200 to every request, as a relay's `/healthz` does.
    std::thread::spawn(move || {
        for stream in monitor.incoming().flatten() {
            use std::io::{Read, Write};
            let mut stream = stream;
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        }
    });
    let out = Command::new("scripts/servers.sh")
        .arg("start")
        .env("OUTBOX_TEST_STATE", state.path())
        .env("OUTBOX_TEST_SERVERS", "nats")
        .env("OUTBOX_TEST_NATS_PORT", nats_port.to_string())
        .current_dir(repository())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    let _ = Command::new("scripts/servers.sh")
        .arg("stop")
        .env("OUTBOX_TEST_STATE", state.path())
        .env("OUTBOX_TEST_SERVERS", "nats")
        .current_dir(repository())
        .output();
    assert!(
        !out.status.success(),
        "said ready: {}\n{stderr}",
        text(&out.stdout)
    );
    assert!(stderr.contains("nats-server did not start"), "{stderr}");
}
