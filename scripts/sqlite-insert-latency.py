#!/usr/bin/env python3
"""An application's insert latency on a SQLite outbox beside a stuck key.

One key's head waits an hour to retry and holds back 300,000 rows behind it; the relay
runs on the file while this script inserts 200 rows of other keys, one transaction each
(BEGIN IMMEDIATE), 10 ms apart, and prints their latency. Each insert wakes the relay,
whose claim walks the held-back rows. Usage: scripts/sqlite-insert-latency.py [BINARY]
"""
import sqlite3, subprocess, sys, time, os, tempfile, statistics
binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/outbox-relay"
d = tempfile.mkdtemp()
db = os.path.join(d, "o.db")
subprocess.run([binary, "migrate", "--database-url", "sqlite:" + db], check=True, capture_output=True)
c = sqlite3.connect(db, timeout=30, isolation_level=None)
now = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
c.execute("INSERT INTO outbox (destination, partition_key, event_type, payload, attempts, last_error, available_at) VALUES ('stuck','k','t','{}',1,'down'," + now + " + 3600000)")
c.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM n WHERE i < 300000) INSERT INTO outbox (destination, partition_key, event_type, payload) SELECT 'stuck','k','t','{}' FROM n")
relay = subprocess.Popen([binary, "run", "--database-url", "sqlite:" + db, "--sink", "file:" + os.path.join(d, "out.jsonl"), "--http-addr", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(3)
lat = []
for i in range(200):
    t = time.perf_counter()
    c.execute("BEGIN IMMEDIATE")
    c.execute("INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ('live','x%d','t','{}')" % i)
    c.execute("COMMIT")
    lat.append((time.perf_counter() - t) * 1000)
    time.sleep(0.01)
relay.terminate(); relay.wait()
lat.sort()
print("%s: insert ms p50 %.2f p99 %.2f max %.2f" % (os.path.basename(binary), lat[len(lat)//2], lat[int(len(lat)*0.99)], lat[-1]))
