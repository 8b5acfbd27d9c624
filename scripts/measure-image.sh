#!/usr/bin/env bash
# Measures the container image: its size (as stored, and as a compressed archive a
# registry would carry) and its start time, from exec to /readyz answering 200, against the
# test servers' PostgreSQL and NATS (`eval "$(scripts/servers.sh start)"` first).
#   scripts/measure-image.sh [BINARY]   # default target/release/outbox-relay
# The image's entrypoint runs under chroot from the mounted image (podman cannot start
# containers on the machines this was written on), as the image's user and environment.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUTBOX_TEST_DATABASE_URL:?run eval \"\$(scripts/servers.sh start)\" first}"
binary=${1:-target/release/outbox-relay}
tag=localhost/outbox-relay:measure
scripts/image.sh "$binary" "$tag" >/dev/null
ctr=$(buildah from "$tag")
pid=
trap '[[ -n $pid ]] && kill "$pid" 2>/dev/null; buildah umount "$ctr" >/dev/null; buildah rm "$ctr" >/dev/null; buildah rmi -f "$tag" >/dev/null' EXIT
root=$(buildah mount "$ctr")

stored=$(buildah inspect --type image --format '{{.FromImageID}}' "$tag" >/dev/null; buildah images --format '{{.Size}}' "$tag")
archive=$(mktemp -d)
buildah push --quiet "$tag" "oci-archive:$archive/image.tar" >/dev/null
gzip -6 -c "$archive/image.tar" > "$archive/image.tar.gz"
echo "image: $tag"
echo "  stored size:            $stored"
echo "  binary (stripped):      $(du -h "$root/usr/local/bin/outbox-relay" | cut -f1)"
echo "  OCI archive, gzip -6:   $(du -h "$archive/image.tar.gz" | cut -f1)"
rm -rf "$archive"

database=${OUTBOX_TEST_DATABASE_URL%/postgres}/postgres
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
env_args=()
while IFS= read -r pair; do env_args+=("$pair"); done < <(buildah inspect --type image --format '{{range .Docker.Config.Env}}{{println .}}{{end}}' "$tag" | grep .)
# env and chroot exec what follows: a background job's pid is the relay's own.
in_image=(env -i "${env_args[@]}" DATABASE_URL="$database" OUTBOX_RELAY_SINK="$OUTBOX_TEST_NATS_URL"
  OUTBOX_RELAY_HTTP_ADDR="0.0.0.0:$port" OUTBOX_RELAY_ADMIN_TOKEN=measure-token-0123456789
  chroot --userspec=65532:65532 "$root" /usr/local/bin/outbox-relay)
"${in_image[@]}" migrate >/dev/null
times=()
for _ in 1 2 3 4 5; do
  start=$(date +%s%N)
  "${in_image[@]}" run 2>/dev/null &
  pid=$!
  until "${in_image[@]}" health --ready >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || { echo "measure-image.sh: the relay exited before it was ready" >&2; exit 1; }
    sleep 0.005
  done
  times+=($(( ($(date +%s%N) - start) / 1000000 )))
  kill -TERM "$pid"; wait "$pid" || true
  pid=
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n | paste -sd' ')
echo "  start to /readyz 200:   ${sorted} ms (5 runs; median $(printf '%s\n' "${times[@]}" | sort -n | sed -n 3p) ms)"
