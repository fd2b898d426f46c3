"""A local JSON-over-HTTP fake server on 127.0.0.1 (for fakes of web APIs and GPU servers in tests).

    server, base_url = serve_json(handle)   # handle(path, headers, body) -> (status, payload[, headers])
    ...
    server.shutdown(); server.server_close()

Every POST body is decoded as JSON and handed to `handle` on the server's thread; the payload is
sent back as JSON with the extra response headers given (e.g. Retry-After).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve_json(handle) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, payload, *extra = handle(self.path, self.headers, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            headers = {"Content-Type": "application/json", "Content-Length": str(len(data)), **(extra[0] if extra else {})}
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
