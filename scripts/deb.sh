#!/usr/bin/env bash
# Builds outbox-relay's Debian package with dpkg-deb (no cargo-deb needed).
#   scripts/deb.sh [BINARY] [OUT_DIR]
# BINARY defaults to target/release/outbox-relay (built if missing); OUT_DIR to
# target/debian. Prints the package's path. OUTBOX_DEB_COMPRESSION (xz; gzip is faster)
# is dpkg-deb's -Z.
#
# The package holds the stripped binary (/usr/bin/outbox-relay), a sample configuration and
# environment file (/etc/outbox-relay/, kept on upgrade and removed on purge), the hardened
# systemd unit (/lib/systemd/system/outbox-relay.service, not enabled: configure, then
# `systemctl enable --now outbox-relay`), the README, the licence and the changelog.
set -euo pipefail
cd "$(dirname "$0")/.."
# Packaged files keep their modes: a builder's strict umask made docs and samples unreadable.
umask 022

binary=${1:-target/release/outbox-relay}
out=${2:-target/debian}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
if [[ ! -x $binary ]]; then
  if [[ $binary == target/release/outbox-relay ]]; then
    cargo build --release --locked -p outbox-relay >&2
  else
    echo "deb.sh: no binary at $binary" >&2
    exit 1
  fi
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/outbox-relay_${version}_$arch
install -d "$root/DEBIAN" "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/outbox-relay" \
  "$root/usr/share/doc/outbox-relay"
strip -o "$root/usr/bin/outbox-relay" "$binary"
chmod 755 "$root/usr/bin/outbox-relay"
install -m 644 packaging/debian/outbox-relay.service "$root/lib/systemd/system/"
install -m 644 packaging/debian/outbox-relay.toml "$root/etc/outbox-relay/"
# Secrets go in the environment file: readable by root only (systemd reads it as root).
install -m 600 packaging/debian/outbox-relay.env "$root/etc/outbox-relay/"
install -m 644 README.md "$root/usr/share/doc/outbox-relay/"
install -m 644 LICENSE "$root/usr/share/doc/outbox-relay/copyright"
gzip -9n -c CHANGELOG.md > "$root/usr/share/doc/outbox-relay/changelog.gz"

# The packages (and versions) the binary's libraries need, as dpkg-shlibdeps reads them
# from the binary's symbols: a glibc too old for it refuses the package.
depends=$(
  cd "$stage" && mkdir -p debian &&
    printf 'Source: outbox-relay\n\nPackage: outbox-relay\nArchitecture: any\n' > debian/control &&
    dpkg-shlibdeps -O "$root/usr/bin/outbox-relay" 2>/dev/null | sed -n 's/^shlibs:Depends=//p'
)
if [[ -z $depends ]]; then
  echo "deb.sh: dpkg-shlibdeps found no dependencies for $binary (apt-get install dpkg-dev)" >&2
  exit 1
fi
size=$(du -sk "$root" | cut -f1)
cat > "$root/DEBIAN/control" <<CONTROL
Package: outbox-relay
Version: $version
Architecture: $arch
Maintainer: outbox-relay developers <outbox-relay@localhost>
Installed-Size: $size
Depends: $depends
Section: net
Priority: optional
Description: transactional-outbox relay
 Publishes the rows an application writes to an outbox table (PostgreSQL,
 MySQL/MariaDB or SQLite) to NATS JetStream, Kafka, RabbitMQ, Redis Streams,
 HTTP webhooks, Ably, Amazon SQS/SNS/Kinesis/EventBridge, stdout or a file:
 at least once, in order per key, stamped with the event's id.
CONTROL
printf '/etc/outbox-relay/outbox-relay.toml\n/etc/outbox-relay/outbox-relay.env\n' > "$root/DEBIAN/conffiles"
# systemd learns of the unit (and forgets it) where systemd runs; nothing is started.
cat > "$root/DEBIAN/postinst" <<'SCRIPT'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload >/dev/null || true
  # An upgrade leaves a running relay on the old binary: a release with a schema step
  # refuses to run (exit 2, which the unit does not restart) until `migrate` has run, and a
  # restart here would stop relaying with nobody watching (unattended-upgrades).
  if [ "$1" = configure ] && [ -n "$2" ] && systemctl is-active --quiet outbox-relay.service; then
    echo "outbox-relay upgraded from $2: the running relay keeps the old version until" \
      "'systemctl restart outbox-relay'; run 'outbox-relay migrate' first if the changelog" \
      "names a schema step (/usr/share/doc/outbox-relay)." >&2
  fi
fi
SCRIPT
cat > "$root/DEBIAN/prerm" <<'SCRIPT'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
  systemctl disable --now outbox-relay.service >/dev/null 2>&1 || true
fi
SCRIPT
cat > "$root/DEBIAN/postrm" <<'SCRIPT'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then systemctl daemon-reload >/dev/null || true; fi
if [ "$1" = purge ]; then
  rm -rf /var/lib/outbox-relay /var/lib/private/outbox-relay
  # The credentials the README has the operator write beside the configuration.
  rm -f /etc/outbox-relay/database-url /etc/outbox-relay/admin-token
  rmdir /etc/outbox-relay 2>/dev/null || true
fi
SCRIPT
chmod 755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm" "$root/DEBIAN/postrm"

mkdir -p "$out"
deb="$out/outbox-relay_${version}_$arch.deb"
dpkg-deb --root-owner-group "-Z${OUTBOX_DEB_COMPRESSION:-xz}" --build "$root" "$deb" >&2
echo "$deb"
