#!/usr/bin/env bash
# One WAL-capture drain, by hand, for profiling (outbox-bench is the measurement of record).
#
#   scripts/wal-drain.sh rows|emit EVENTS RELAY_BINARY...
#
# For each binary: a fresh database `wal_drain` on the test server ($OUTBOX_TEST_DATABASE_URL,
# from `scripts/servers.sh start`), `migrate --capture wal`, a slot (made by a drain of the
# empty outbox), EVENTS events written
# in transactions of 1,000 (outbox rows, or `outbox_emit` messages) while no relay runs, then
# `run --capture wal --drain` to a file. Prints the rate to the last line written, the
# exit, the relay's CPU and peak RSS. WAL_DRAIN_URL_QUERY (e.g. `?sslmode=disable`) is
# appended to the relay's database URL; wrap the relay with WAL_DRAIN_WRAP (e.g. `perf
# record -g --`).
set -euo pipefail
export PGOPTIONS="-c client_min_messages=warning"

form=${1:?rows or emit}
events=${2:?number of events}
shift 2
admin=${OUTBOX_TEST_DATABASE_URL:?run scripts/servers.sh start and source its output}
db="${admin%/*}/wal_drain"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

case $form in
rows) write="INSERT INTO outbox (destination, partition_key, event_type, payload) SELECT" ;;
emit) write="PERFORM outbox_emit(" ;;
*) echo "form: rows or emit" >&2; exit 2 ;;
esac
values="'orders', 'customer-' || (i % 1000), 'order.created', jsonb_build_object('seq', i, 'pad', repeat('x', 200))"
[ "$form" = emit ] && values="$values)"

for relay in "$@"; do
    psql -qX "$admin" -c "SELECT pg_drop_replication_slot('wal_drain') FROM pg_replication_slots WHERE slot_name = 'wal_drain'" >/dev/null
    psql -qX "$admin" -c "DROP DATABASE IF EXISTS wal_drain WITH (FORCE)" -c "CREATE DATABASE wal_drain" >/dev/null
    "$relay" migrate --database-url "$db" --capture wal >/dev/null
    # The slot, made by a drain of the empty outbox: the relay records it as its own
    # (`outbox_emit` refuses events until a slot so recorded streams).
    "$relay" run --database-url "$db" --capture wal --slot wal_drain --drain --sink stdout \
        --http-addr "" >/dev/null 2>&1
    psql -qX "$db" -c "DO \$fill\$ BEGIN
        FOR c IN 0..$(((events + 999) / 1000 - 1)) LOOP
            $write $values FROM generate_series(c * 1000::int8 + 1, least((c + 1) * 1000::int8, $events)) i;
            COMMIT;
        END LOOP; END \$fill\$"
    start=$(date +%s.%N)
    ${WAL_DRAIN_WRAP:-} /usr/bin/time -f "%e %U %S %M" -o "$work/time" "$relay" run \
        --database-url "$db${WAL_DRAIN_URL_QUERY:-}" --capture wal --slot wal_drain --drain \
        --sink "file:$work/out.jsonl" --http-addr "" >"$work/log" 2>&1 ||
        { tail -5 "$work/log" >&2; exit 1; }
    last=$(stat -c %.9Y "$work/out.jsonl")
    read -r wall user sys rss <"$work/time"
    printf '%s %s %s: %.0f events/s to the last line (%.2f s), exit %s s, CPU %.2f s, peak RSS %d MB, %d lines\n' \
        "$form" "$events" "$relay" "$(echo "$events / ($last - $start)" | bc -l)" \
        "$(echo "$last - $start" | bc -l)" "$wall" "$(echo "$user + $sys" | bc -l)" \
        $((rss / 1024)) "$(wc -l <"$work/out.jsonl")"
    rm -f "$work/out.jsonl"
done
psql -qX "$admin" -c "SELECT pg_drop_replication_slot('wal_drain') FROM pg_replication_slots WHERE slot_name = 'wal_drain'" \
    -c "DROP DATABASE IF EXISTS wal_drain WITH (FORCE)" >/dev/null
