#!/bin/bash
# Drains N events from a SQLite outbox to RabbitMQ (100 keys, confirms on) and prints the
# rate and the queue's depth after. Needs a RabbitMQ at $AMQP_URL and python3 with pika
# (PYTHON, default python3). Usage: scripts/rabbitmq-drain.sh BINARY N
set -eu
AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}; PYTHON=${PYTHON:-python3}
declare=/tmp/rabbitmq-drain-declare.py
cat > "$declare" <<PY
import pika, sys
c = pika.BlockingConnection(pika.URLParameters(sys.argv[1])); ch = c.channel()
if sys.argv[2] == "reset": ch.queue_delete(queue="bench"); ch.queue_declare(queue="bench", durable=True)
print(ch.queue_declare(queue="bench", passive=True).method.message_count); c.close()
PY
BIN=$1; N=$2
d=$(mktemp -d /tmp/rb.XXXX); cd $d
$BIN migrate --database-url sqlite:$d/o.db >/dev/null 2>&1 || { echo migrate failed; exit 1; }
sqlite3 $d/o.db "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM c WHERE i < $N) INSERT INTO outbox (destination, partition_key, event_type, payload) SELECT 'bench', 'k' || (i % 100), 'bench.made', '{\"n\":' || i || ',\"pad\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}' FROM c;"
"$PYTHON" "$declare" "$AMQP_URL" reset >/dev/null
s=$(date +%s.%N)
$BIN run --drain --database-url sqlite:$d/o.db --sink "$AMQP_URL" --http-addr "" > $d/log 2>&1 || { echo run failed; tail -5 $d/log; }
e=$(date +%s.%N)
echo "$(basename "$BIN") $N events: $(python3 -c "print(round($N/($e-$s)))")/s, queue depth $("$PYTHON" "$declare" "$AMQP_URL" count)"
rm -rf "$d"
