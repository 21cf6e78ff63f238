"""A minimal engine stand-in for the proxy's robustness tests: a stdlib HTTP server in its own
process (so a test can SIGSTOP it like a hung engine), started in ~0.1 s.

``python tests/_echo_engine.py NAME [MAX_MODEL_LEN]`` binds 127.0.0.1 port 0 and prints the
port on its first stdout line. Routes:

* ``GET /health`` 200 (or the status set by ``POST /control``).
* ``GET /v1/models``: vLLM's shape with ``max_model_len``.
* ``POST <any path>``: ``{"engine": NAME, "path", "headers", "body_bytes", "body"}`` (the JSON
  body as parsed, ``null`` when larger than 64 KiB); a body with ``"stream": true`` gets an
  SSE stream of three ``data:`` events and ``data: [DONE]``. ``x-request-id`` is echoed.
* ``POST /control`` ``{"health": status, "fail": [status, ...], "delay_s": s}``: the next
  answers to non-control POSTs use the ``fail`` statuses in order (then 200), each answer
  waits ``delay_s`` first.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = sys.argv[1] if len(sys.argv) > 1 else "engine"
MAX_MODEL_LEN = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
STATE = {"health": 200, "fail": [], "delay_s": 0.0}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        rid = self.headers.get("x-request-id")
        if rid:
            self.send_header("x-request-id", rid)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._send(STATE["health"], b"{}")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [
                {"id": "m", "object": "model", "owned_by": NAME,
                 "max_model_len": MAX_MODEL_LEN}]}).encode())
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        if self.path == "/control":
            with LOCK:
                STATE.update(json.loads(raw))
            self._send(200, b"{}")
            return
        with LOCK:
            status = STATE["fail"].pop(0) if STATE["fail"] else 200
            delay = STATE["delay_s"]
        if delay:
            time.sleep(delay)
        try:
            body = json.loads(raw) if n <= 65536 else None
        except ValueError:
            body = None
        if status == 200 and isinstance(body, dict) and body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {json.dumps({'engine': NAME, 'i': i})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            return
        out = {"engine": NAME, "path": self.path, "headers": dict(self.headers.items()),
               "body_bytes": n, "body": body}
        if status != 200:
            out = {"error": {"message": f"{NAME} answers {status}", "type": "Test",
                             "code": status}}
        self._send(status, json.dumps(out).encode())


def main() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
