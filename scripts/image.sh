#!/usr/bin/env bash
# Builds outbox-relay's container image with buildah, FROM scratch.
#   scripts/image.sh [BINARY] [TAG]
# BINARY defaults to target/release/outbox-relay (built if missing); TAG to
# localhost/outbox-relay:<version>. Stages packaging/rootfs/ (ignored by git): the stripped
# binary, the shared libraries it loads (from `ldd`), the CA certificates, and passwd/group
# entries for the unprivileged user 65532. Prints the image's name.
set -euo pipefail
cd "$(dirname "$0")/.."
# The staged files keep their modes in the image: under a builder's strict umask (027, as
# hardened machines set it) the binary and libc were not readable by the relay's user.
umask 022

binary=${1:-target/release/outbox-relay}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
tag=${2:-localhost/outbox-relay:$version}
if [[ ! -x $binary ]]; then
  if [[ $binary == target/release/outbox-relay ]]; then
    cargo build --release --locked -p outbox-relay >&2
  else
    echo "image.sh: no binary at $binary" >&2
    exit 1
  fi
fi
for tool in buildah ldd strip; do
  command -v "$tool" >/dev/null || { echo "image.sh: needs $tool (apt-get install buildah binutils)" >&2; exit 1; }
done
[[ -r /etc/ssl/certs/ca-certificates.crt ]] || {
  echo "image.sh: needs /etc/ssl/certs/ca-certificates.crt (apt-get install ca-certificates)" >&2
  exit 1
}

root=packaging/rootfs
rm -rf "$root" packaging/state
mkdir -p "$root"/{usr/local/bin,etc/ssl/certs,etc/outbox-relay,tmp} packaging/state
strip -o "$root/usr/local/bin/outbox-relay" "$binary"
# Every library the binary loads, and the loader, at the paths ldd resolved.
# (POSIX awk: Debian's default mawk has no \s.)
ldd "$binary" | awk '/=> \// {print $3} $1 ~ /^\// {print $1}' | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
printf 'root:x:0:0:root:/root:/sbin/nologin\nrelay:x:65532:65532:outbox-relay:/var/lib/outbox-relay:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nrelay:x:65532:\n' > "$root/etc/group"
chmod 1777 "$root/tmp"
# The working directory (packaging/state, copied with --chown) is the relay's; the rest
# stays root's and read-only to it.

# Docker format: OCI images drop HEALTHCHECK.
buildah bud --quiet --format docker --layers=false -f packaging/Containerfile -t "$tag" packaging >&2
echo "$tag"
