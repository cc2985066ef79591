"""tests/tinker_mock.py's service over real HTTP on 127.0.0.1, to exercise the SDK's real network stack.

No respx: the SDK talks to a ThreadingHTTPServer through its own transport. By default the mock's
client/config leaves the pyqwest (Rust reqwest) transport on, as the hosted service does.
Use: `with serve(MockTinker(engine, pyqwest=True)) as base_url: ...`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tinker_mock import LONG_POLL_S, Dropped, MockTinker


def _handler_class(mock: MockTinker) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's pooled clients expect

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            path = self.path.split("?", 1)[0]
            ready = mock.wait_hint(path, body)
            if ready is not None:  # long-poll: this thread is the request's own
                deadline = time.monotonic() + LONG_POLL_S
                while not ready() and time.monotonic() < deadline:
                    time.sleep(0.005)
            try:
                reply = mock.handle(self.command, path, headers, body)
            except Dropped:
                # Drop the connection without an answer: the client sees a connection error.
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.send_response(reply.status)
            for k, v in reply.headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: object) -> None:  # quiet: the mock records requests itself
            pass

    return Handler


@contextlib.contextmanager
def serve(mock: MockTinker) -> Iterator[str]:
    """Serve `mock` on a free port of 127.0.0.1; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(mock))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
