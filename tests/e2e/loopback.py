"""A small HTTP server on loopback, in a thread, for the e2e tests that play
a party of their own (an identity provider, a web page's origin)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing (pytest shows the test's own output)."""

    def log_message(self, *args: Any) -> None:
        pass


class LoopbackServer:
    """`handler` served on a free loopback port until close()."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
