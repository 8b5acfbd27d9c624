#!/usr/bin/env python3
"""Peak RSS of `run --drain` over N events of 1 MiB (SQLite) behind a webhook that answers
each request after 500 ms. Usage: scripts/polling-memory.py BINARY [N]"""
import http.server, threading, time, subprocess, sys, os, tempfile, sqlite3
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get('content-length', 0)); self.rfile.read(n)
        time.sleep(0.5); self.send_response(204); self.end_headers()
    def do_HEAD(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
binary = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
d = tempfile.mkdtemp(); db = os.path.join(d, "o.db")
subprocess.run([binary, "migrate", "--database-url", "sqlite:" + db], check=True, capture_output=True)
c = sqlite3.connect(db); big = '"' + "x" * (1024 * 1024) + '"'
for i in range(n):
    c.execute("INSERT INTO outbox (destination, partition_key, event_type, payload) VALUES ('d', ?, 't', ?)", ("k%d" % i, big))
c.commit()
out = subprocess.run(["/usr/bin/time", "-v", binary, "run", "--drain", "--database-url", "sqlite:" + db, "--sink", "http://127.0.0.1:%d/in" % srv.server_address[1], "--http-addr", ""], capture_output=True, text=True)
rss = [l for l in out.stderr.splitlines() if "Maximum resident" in l]
wall = [l for l in out.stderr.splitlines() if "Elapsed (wall" in l]
print(os.path.basename(binary), n, "events of 1 MiB:", rss[0].strip() if rss else out.stderr[-500:], "|", wall[0].strip() if wall else "")
