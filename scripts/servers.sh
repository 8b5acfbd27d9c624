#!/usr/bin/env bash
# Installs (from Debian packages, when missing) and starts the local servers the tests need,
# on 127.0.0.1 only, under one state directory; stops them again.
#
#   scripts/servers.sh start     # prints `export ...` lines for the tests' environment
#   scripts/servers.sh stop
#   scripts/servers.sh restart-postgres   # for the tests that restart the database
#
# OUTBOX_TEST_STATE (default /tmp/outbox-relay-test-servers) holds data, sockets and pids.
# OUTBOX_TEST_PG_PORT (default 54329) is PostgreSQL's port.
set -euo pipefail

STATE=${OUTBOX_TEST_STATE:-/tmp/outbox-relay-test-servers}
PG_PORT=${OUTBOX_TEST_PG_PORT:-54329}
PG_BIN=/usr/lib/postgresql/15/bin

log() { echo "servers.sh: $*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_packages() {
  local missing=()
  [ -x "$PG_BIN/initdb" ] || missing+=(postgresql-15 postgresql-contrib)
  command -v openssl >/dev/null || missing+=(openssl)
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

start_postgres() {
  local dir=$STATE/pg
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    as_pg "$PG_BIN/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >/dev/null
  fi
  make_certs "$dir/tls"
  [ "$(id -u)" = 0 ] && chown -R postgres "$dir/tls"
  if ! as_pg "$PG_BIN/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    # fsync=off only speeds the tests up; the benchmarks run with the defaults.
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/log" -w start -o \
      "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $dir -c fsync=off -c full_page_writes=off -c max_connections=400 -c wal_level=logical -c ssl=on -c ssl_cert_file=$dir/tls/server.pem -c ssl_key_file=$dir/tls/server.key" >/dev/null
  fi
  log "postgres ready on 127.0.0.1:$PG_PORT"
  echo "export OUTBOX_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
  echo "export OUTBOX_TEST_PG_DATA=$dir/data"
  echo "export OUTBOX_TEST_PG_CA=$dir/tls/ca.pem"
}

stop_postgres() {
  local dir=$STATE/pg
  if [ -f "$dir/data/postmaster.pid" ]; then
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
  fi
}

case "${1:-}" in
  start)
    install_packages
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    start_postgres
    ;;
  stop)
    stop_postgres
    ;;
  restart-postgres)
    stop_postgres
    start_postgres >/dev/null
    ;;
  *)
    echo "usage: $0 start|stop|restart-postgres" >&2
    exit 2
    ;;
esac
