"""`runner serve`'s HTTP layer on aiohttp.web: one event loop owns the sockets (keep-alive, request parsing, body
limits, the listen backlog, chunked request bodies, streamed replies); the service's work runs on worker threads
(`Workers`), never on the loop.

The app behind it is anything with `handle(method, path, headers, body, base_url, gone) -> Reply` and `limits`
(backends/serve/service.py Service; tests/tinker_mock.py wraps one). `gone()` tells a worker whether its client hung
up (the transport closed): a /v1 request then stops its sampling. What aiohttp itself refuses (a malformed request
line or header, a line over its limits) is answered in the service's error shape, {"detail": ...}, as JSON; a body
over the cap is a 413 in the shape of its route (OpenAI's {"error": {...}} on /v1, Tinker's elsewhere).

Logging: requests at DEBUG; a client that hangs up mid-request or mid-reply is one DEBUG line, not a traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from backends.serve.chat_api import error_body
from backends.serve.limits import Limits
from backends.serve.replies import Reply, failed

log = logging.getLogger("runner.serve")

# The listen backlog: while the process is busy (a checkpoint loading for a sampler, the GIL held), a burst of
# clients fills it and the kernel drops or resets the rest (measured with the stdlib server's 5: 8 of 24 concurrent
# /v1 requests reset while a run dir's sampler loaded; 18 of 100 connects timed out over an 8 s stall, none with
# 128). The kernel caps it at net.core.somaxconn.
BACKLOG = 128
# Worker threads for requests: a long-polled retrieve_future holds one for up to LONG_POLL_S, as the stdlib server's
# thread per connection did; more than this many at once queue.
MAX_WORKERS = 1024
KEEPALIVE_S = 75.0  # an idle keep-alive connection is closed after this long (aiohttp's default)
# A body refused unread (over the cap): read and dropped this long before the connection closes, so the client, still
# sending, reads the 413 rather than a reset (aiohttp's default, 10 s, holds a half-closed client that long).
LINGER_S = 1.0
# The request line (the URL) and each header line: over them a 414 / 431. aiohttp's LineTooLong names only the limit
# it hit, so the two differ by one to tell them apart.
MAX_LINE = 65536
MAX_FIELD = MAX_LINE - 1
DISCONNECTS = (ConnectionError, TimeoutError)
_END = object()

P = ParamSpec("P")
T = TypeVar("T")


class App(Protocol):
    @property
    def limits(self) -> Limits: ...

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, base_url: str = "",
               gone: Callable[[], bool] | None = None) -> Reply: ...


class Workers(concurrent.futures.Executor):
    """Daemon worker threads, started as requests need them (up to `max_workers`) and kept: a long poll or a sampling
    request blocks its thread, never the event loop, and none delays the process's exit as ThreadPoolExecutor's
    joined threads would."""

    def __init__(self, max_workers: int = MAX_WORKERS):
        self.max_workers = max_workers
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None: a worker's stop
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
                    fut.set_exception(exc)

        with self._lock:
            if self._closed:
                raise RuntimeError("the server is stopping")
            self._jobs.put(job)
            if self._idle:
                self._idle -= 1
            elif self._threads < self.max_workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"serve-{self._threads}", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            for _ in range(self._threads):
                self._jobs.put(None)


def is_openai(path: str) -> bool:
    """Whether `path` is one of the /v1 OpenAI routes (backends/serve/openai_api.py), whose errors are OpenAI's shape;
    the rest (Tinker's /api/v1/...) answer {"detail": ...}."""
    route = path.split("?", 1)[0].removeprefix("/api/v1/").strip("/")
    return route == "v1" or route.startswith("v1/")


def _json_error(status: int, detail: str, path: str = "") -> web.Response:
    reply = Reply.json(error_body(status, detail), status) if is_openai(path) else Reply.error(status, detail)
    resp = web.Response(status=status, body=reply.body, headers=reply.headers)
    resp.force_close()
    return resp


class JsonErrors(RequestHandler):
    """aiohttp's connection handler, answering what its parser refuses as JSON (its own answer is text/plain, always
    400) with the status the fault has: 414 for an over-long request line, 431 for an over-long header, 405 for a
    method it does not know; logged at DEBUG (a port scanner is no error of ours).

    A client that half-closes (shuts its sending side after its request) still gets its answer: the connection then
    closes after it (asyncio's default, which aiohttp keeps, would close it at once). A /v1 request takes that end
    of input for a client that hung up (`peer_eof`), as it cannot tell the two apart."""

    peer_eof = False

    def eof_received(self) -> bool | None:  # pyright: ignore[reportIncompatibleMethodOverride]  # asyncio's type
        self.peer_eof = True
        if not self._messages and self._waiter is not None:
            return None  # an idle connection (waiting for its next request): close it
        self.close()  # answer what was asked, then close
        return True

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status == 500:
            return super().handle_error(request, status, exc, message)
        text = str(getattr(exc, "message", "") or message or exc or "bad request")
        if isinstance(exc, http_exceptions.LineTooLong):
            status = 431 if f"more than {MAX_FIELD} bytes" in text else 414
        elif isinstance(exc, http_exceptions.BadHttpMethod) and b" HTTP/1." in str(text).encode():
            status = 405
        log.debug("refused a malformed request (%d): %s", status, text[:200])
        if request.writer.output_size > 0:
            raise ConnectionError("a reply was already under way")
        if status == 405:
            return _json_error(405, "method is not served")
        return _json_error(status, f"bad request: {text[:200]}")


@dataclass
class Listening:
    """A bound server: its address (host, port) and base URL."""

    server_address: tuple[str, int]

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"


class Site:
    """`app` on aiohttp: start() binds and listens, stop() closes the socket and its connections."""

    def __init__(self, app: App, workers: Workers | None = None):
        self.app = app
        self.workers = workers or Workers()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None

    def make_app(self) -> web.Application:
        web_app = web.Application(client_max_size=self.app.limits.max_body_bytes)
        web_app.router.add_route("*", "/{tail:.*}", self._handle)
        return web_app

    async def start(self, host: str, port: int) -> Listening:
        loop = asyncio.get_running_loop()
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None

        def protocol() -> RequestHandler:
            # No access log: requests are logged at DEBUG by _handle (aiohttp takes None; its stub says Logger).
            return JsonErrors(server, loop=loop, keepalive_timeout=KEEPALIVE_S, max_line_size=MAX_LINE,
                              max_field_size=MAX_FIELD, lingering_time=LINGER_S,
                              access_log=None)  # pyright: ignore[reportArgumentType]

        self._server = await loop.create_server(protocol, host, port, backlog=BACKLOG, reuse_address=True)
        addr = self._server.sockets[0].getsockname()
        return Listening((str(addr[0]), int(addr[1])))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.workers.shutdown(wait=False)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        limits = self.app.limits
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            return _json_error(413, f"request body of {request.content_length} bytes; at most {limits.max_body_bytes}",
                               request.path)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _json_error(413, f"request body over {limits.max_body_bytes} bytes", request.path)
        except DISCONNECTS as exc:  # the client hung up mid-body
            log.debug("client %s disconnected mid-request: %s", request.remote, type(exc).__name__)
            return _gone(request)
        headers = {k.lower(): v for k, v in request.headers.items()}
        base_url = f"http://{request.host or '127.0.0.1'}"

        def gone() -> bool:
            transport = request.transport
            return transport is None or transport.is_closing() or getattr(request.protocol, "peer_eof", False)

        try:
            reply = await self._answer(request.method, request.raw_path, headers, body, base_url, gone)
        except DISCONNECTS as exc:  # the app drops the connection (tests/tinker_mock.py's injected faults)
            log.debug("dropped %s %s: %s", request.method, request.path[:200], type(exc).__name__)
            return _gone(request)
        log.debug("%s %s -> %d", request.method, request.path[:200], reply.status)
        if reply.status == Reply.GONE:  # the client hung up: its work was stopped, nobody reads a reply
            return _gone(request)
        if reply.stream is not None:
            return await self._stream(request, reply, reply.stream)
        if reply.file is not None:
            return web.FileResponse(reply.file, headers=reply.headers)
        return web.Response(status=reply.status, body=reply.body, headers=reply.headers)

    async def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes, base_url: str,
                      gone: Callable[[], bool]) -> Reply:
        """The app's reply: a long-poll awaited on the loop (no thread held), a request the app answers without
        blocking run in place, anything else on a worker thread."""
        pending = getattr(self.app, "pending", None)
        waiting = pending(method, path, headers, body) if pending is not None else None
        if waiting is not None:
            fut, timeout, later = waiting
            if await _wait(fut, timeout):
                return fut.result() if not fut.cancelled() else failed("cancelled", "user")
            return later
        inline = getattr(self.app, "inline", None)
        if inline is not None and inline(method, path, body):
            return self.app.handle(method, path, headers, body, base_url, gone)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.workers, self.app.handle, method, path, headers, body, base_url, gone)

    async def _stream(self, request: web.Request, reply: Reply, pieces: Iterator[bytes]) -> web.StreamResponse:
        """Each piece leaves as it is made (chunked). The pieces are made on one worker thread, which hands each to the
        loop as it comes (no hand-off per piece and back); a client gone mid-stream stops that thread at its next
        piece, and the iterator is closed there, which stops its sampling (backends/serve/streaming.py)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue[object] = asyncio.Queue()
        stop = threading.Event()

        def put(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped)
                loop.call_soon_threadsafe(ready.put_nowait, item)

        def produce() -> None:
            try:
                for piece in pieces:
                    if stop.is_set():
                        break
                    put(piece)
            except Exception:  # a bug of ours: the stream ends here
                log.exception("error while streaming %s", request.path[:200])
            finally:
                end = getattr(pieces, "close", None)
                if end is not None:
                    end()
                put(_END)

        resp = web.StreamResponse(status=reply.status, headers=reply.headers)
        self.workers.submit(produce)  # started first: however this ends, the thread closes the iterator
        try:
            await resp.prepare(request)
            while (piece := await ready.get()) is not _END:
                assert isinstance(piece, bytes)
                if piece:
                    await resp.write(piece)
            await resp.write_eof()
        except DISCONNECTS as exc:
            log.debug("client %s left mid-stream: %s", request.remote, type(exc).__name__)
        finally:
            stop.set()
        return resp


async def _wait(fut: concurrent.futures.Future[Reply], timeout: float) -> bool:
    """Whether `fut` is done within `timeout` s, waited for on the loop. The future is never cancelled by the wait
    (asyncio.wrap_future would cancel it on a timeout: it is a promise others still poll)."""
    if fut.done():
        return True
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    def done(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped)
            loop.call_soon_threadsafe(wake)

    fut.add_done_callback(done)
    try:
        await asyncio.wait_for(woken, timeout)
    except TimeoutError:
        return fut.done()
    return True


def _gone(request: web.Request) -> web.StreamResponse:
    """No reply: the connection closes (a client that hung up, or a drop the app asked for)."""
    transport = request.transport
    if transport is not None:
        transport.close()
    resp = web.Response(status=Reply.GONE)
    resp.force_close()
    return resp


@contextlib.contextmanager
def running(app: App, host: str = "127.0.0.1", port: int = 0) -> Iterator[Listening]:
    """Serve `app` from an event loop in a background thread (tests, benchmarks); yields the bound address."""
    loop = asyncio.new_event_loop()
    site = Site(app)
    bound: concurrent.futures.Future[Listening] = concurrent.futures.Future()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            bound.set_result(loop.run_until_complete(site.start(host, port)))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            bound.set_exception(exc)
            return
        loop.run_forever()
        loop.run_until_complete(site.stop())
        loop.close()

    thread = threading.Thread(target=run, name="serve-loop", daemon=True)
    thread.start()
    listening = bound.result()
    try:
        yield listening
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
