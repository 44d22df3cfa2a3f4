"""An HTTP proxy on 127.0.0.1 that answers some requests with 503 instead of forwarding them.

Real S3 servers return 503 SlowDown / 500 InternalError under load; SeaweedFS on loopback never
does, so this proxy produces those answers in front of it. Every other request is forwarded
unchanged (the Host header too, so SigV4 signatures still verify upstream).
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Callable


class FlakyProxy:
    def __init__(self, upstream_port: int, fail: Callable[[str, str, int], bool]) -> None:
        self.upstream_port = upstream_port
        self.fail = fail  # (method, path, request number) -> answer 503?
        self.count = 0
        self.injected = 0
        self.seen: list[tuple[str, str, int]] = []  # every forwarded request: method, path, response body bytes sent
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.count += 1
                    n = proxy.count
                if proxy.fail(self.command, self.path, n):
                    with proxy.lock:
                        proxy.injected += 1
                    msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    conn.putheader(k, v)
                conn.endheaders(body or None)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                # A HEAD's answer has no body but the object's length (what an object store's metadata says).
                head_length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", head_length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                with proxy.lock:
                    proxy.seen.append((self.command, self.path, 0 if self.command == "HEAD" else len(data)))
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
