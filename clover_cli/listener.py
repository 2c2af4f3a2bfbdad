"""How `clover serve` runs its app: the listening socket, uvicorn, and the guards of its connections.

Against slow and many clients (uvicorn has no timeout for a request's head): a connection must send its request line
and headers within `header_timeout` seconds of opening (or of its previous response), else it is closed; at most
`max_connections` connections may be waiting for their head (past that the oldest are closed), and as many requests
may be in progress (503 past it); an idle kept-alive connection closes after 5 s; errors are logged at most a few a
minute (the rest counted). The app itself (the API, its queue and worker) is serve.py's Server.
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from .errors import CloverError

HEADER_TIMEOUT = 10.0  # seconds a connection has to send a request's line and headers
MAX_CONNECTIONS = 1024  # connections waiting for their request head; requests in progress (503 past it)
HEAD_GRACE = 0.5  # seconds a new connection is never closed in: to make room for newer ones
KEEP_ALIVE = 5  # seconds an idle kept-alive connection stays open
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def listen(host: str, port: int):
    """A socket bound to host:port (0: any free port), or a one-line error."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # a deep accept queue (the kernel caps it at net.core.somaxconn): with a short one, a burst of connections
        # overflows it and every client dropped, /health's too, waits 1-3 s to retry its connection
        return socket.create_server((host, port), family=family, backlog=4096)
    except OSError as e:
        raise CloverError(f"cannot listen on {host}:{port}: {e.strerror or e}")


class RateLimit:
    """At most `burst` messages a `period`: the rest are counted, and the next one let through says how many."""

    def __init__(self, burst: int = 5, period: float = 60.0, clock=time.monotonic):
        self.burst, self.period, self.clock = burst, period, clock
        self.start, self.passed, self.dropped = -period, 0, 0
        self.lock = threading.Lock()

    def allow(self) -> tuple[bool, int]:
        """(let this one through, how many were dropped before it)."""
        with self.lock:
            now = self.clock()
            if now - self.start >= self.period:
                self.start, self.passed = now, 0
            if self.passed >= self.burst:
                self.dropped += 1
                return False, 0
            self.passed += 1
            dropped, self.dropped = self.dropped, 0
            return True, dropped


def _dropped_note(n: int) -> str:
    return f" ({n} more error{'s' * (n > 1)} since the last one shown were not logged)" if n else ""


_errors = RateLimit(burst=10)


def log_error(line: str):
    """`clover serve: error: LINE` on standard error, at most ten a minute (many clients failing at once must not
    flood the log)."""
    ok, dropped = _errors.allow()
    if ok:
        print(f"clover serve: error: {line}{_dropped_note(dropped)}", file=sys.stderr)


_notes = RateLimit(burst=5)


def log_note(line: str):
    """`clover serve: note: LINE` on standard error, at most five a minute (the same client sends the same fields
    with every request)."""
    ok, dropped = _notes.allow()
    if ok:
        more = f" ({dropped} more note{'s' * (dropped > 1)} since the last one shown were not logged)" if dropped else ""
        print(f"clover serve: note: {line}{more}", file=sys.stderr)


class RateLimitedLog:
    """A logging filter: at most a few records a minute pass (their tracebacks with them); the next that passes
    says how many were held back. 20,000 slow connections once had asyncio log 468,991 tracebacks in 40 s."""

    def __init__(self, burst: int = 5, period: float = 60.0, clock=time.monotonic):
        self.limit = RateLimit(burst, period, clock)

    def filter(self, record) -> bool:
        ok, dropped = self.limit.allow()
        if ok and dropped:
            record.msg, record.args = record.getMessage() + _dropped_note(dropped), ()
        return ok


def guarded_protocol(header_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with what it lacks against slow and many clients.

    A connection has `header_timeout` seconds, from when it opens (or its previous response ends), to send a whole
    request head, else it is closed. Of the connections waiting for their head at most `max_connections` are kept:
    past that the oldest are closed, each once it has waited HEAD_GRACE seconds (a request sent at once, such as a
    health check amid a flood of new connections, has its head read by then). uvicorn's limit_concurrency (503 past
    it) counts the connections with a request in progress only: slow heads do not push a prompt request out."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # the connections waiting for a request head -> since when, oldest first (an OrderedDict: a dict whose oldest
    # entries keep being removed gets slower to iterate from its start until it is resized)
    waiting: collections.OrderedDict = collections.OrderedDict()
    sweep = {"handle": None}

    class Active:
        """What the protocol counts for limit_concurrency: uvicorn's set of connections, less those waiting."""

        def __init__(self, connections: set):
            self.connections = connections

        def add(self, protocol):
            self.connections.add(protocol)

        def discard(self, protocol):
            self.connections.discard(protocol)

        def __len__(self):
            return len(self.connections) - len(waiting)

    class Protocol(H11Protocol):
        head_timer = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.connections = Active(self.connections)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._await_head()
            if len(waiting) > max_connections:
                close_oldest(self.loop)

        def data_received(self, data: bytes):
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._head_came()

        def on_response_complete(self):
            super().on_response_complete()  # may start a pipelined request at once
            if not self.transport.is_closing():
                self._await_head()

        def connection_lost(self, exc):
            self._head_came()
            super().connection_lost(exc)

        def _await_head(self):
            self._head_came()
            if self.conn.their_state is h11.IDLE:
                waiting[self] = self.loop.time()
                self.head_timer = self.loop.call_later(header_timeout, self._late)

        def _head_came(self):
            waiting.pop(self, None)
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _late(self):
            self.head_timer = None
            if self.conn.their_state is h11.IDLE:
                self._close()

        def _close(self):
            self._head_came()
            if not self.transport.is_closing():
                self.transport.close()

    def close_oldest(loop):
        if sweep["handle"] is not None:
            return
        now = loop.time()
        while len(waiting) > max_connections:
            oldest, since = next(iter(waiting.items()))
            if now - since < HEAD_GRACE:  # again when it has had its grace
                sweep["handle"] = loop.call_at(since + HEAD_GRACE, swept, loop)
                return
            oldest._close()

    def swept(loop):
        sweep["handle"] = None
        close_oldest(loop)

    return Protocol


def _open_files(max_connections: int) -> int:
    """Raise the limit of open files toward what `max_connections` needs (the connections waiting for a head, as
    many with a request in progress, the new ones of a flood within their grace, and some for the model); returns
    the connections it allows."""
    import resource

    need = 4 * max_connections + 256
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < need:
            soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    except (ValueError, OSError):
        return max_connections
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    allowed = max(16, (soft - 256) // 4)
    print(f"clover: warning: --max-connections lowered to {allowed}: this process may open {soft} files "
          f"(ulimit -n)", file=sys.stderr)
    return allowed


def run(server, sock, on_ready=None, header_timeout: float = HEADER_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS):
    """Serve `server` (serve.Server) on `sock` until Ctrl-C (or SIGTERM); access lines on standard error."""
    import logging

    import uvicorn

    access = logging.getLogger("uvicorn.access")
    if not access.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    for name in ("uvicorn.error", "asyncio"):  # what many clients failing at once would flood the log with
        log = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLog) for f in log.filters):
            log.addFilter(RateLimitedLog())
    max_connections = _open_files(max_connections)
    config = uvicorn.Config(server.app, log_config=None, access_log=True, timeout_graceful_shutdown=2,
                            h11_max_incomplete_event_size=64 * 1024, lifespan="off", ws="none",
                            http=guarded_protocol(header_timeout, max_connections),
                            timeout_keep_alive=KEEP_ALIVE, limit_concurrency=max_connections)
    uv = uvicorn.Server(config)
    if on_ready is not None:
        on_ready(uv)
    try:
        uv.run(sockets=[sock])
    finally:
        server.close()
