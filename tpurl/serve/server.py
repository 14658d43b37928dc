"""Running the application: uvicorn on a socket this module binds, until a signal stops it.

`serve` binds `host:port` itself (port 0: a free one), so the address is known, and printed, before
the first request can arrive; uvicorn serves on that socket, and SIGINT/SIGTERM stop it (it stops taking
requests and finishes the open ones, 10 s at most; a second Ctrl-C ends them at once). Then
`serve` returns, and the caller closes the service: the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from typing import Callable

import uvicorn

from tpurl.serve.app import Endpoint, create_app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (port 0: a free one); a one-line OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(endpoint: Endpoint, sock: socket.socket, *, on_ready: Callable[[], None] | None = None,
          log_level: str = "warning") -> None:
    """Serve `endpoint` on `sock` until SIGINT/SIGTERM (or `server.should_exit`); closes `sock`."""
    with contextlib.closing(sock):
        server = make_server(endpoint, on_ready=on_ready, log_level=log_level)
        server.run(sockets=[sock])


def make_server(endpoint: Endpoint, *, on_ready: Callable[[], None] | None = None,
                log_level: str = "warning") -> uvicorn.Server:
    """The uvicorn server of `endpoint` (not started); `on_ready()` once it takes requests."""
    app = create_app(endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if on_ready is not None:
            on_ready()
        yield

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=10)
    return _Server(config)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGINT/SIGTERM that stopped it is not raised again once it
    has (the caller still has the engine to close, and the stop it asked for is a success), and
    that `stop()` stops it at once: uvicorn looks for a stop every 0.1 s and then waits 0.1 s for
    the connections it closes, ~0.15 s that each agent rollout, which starts and stops a server,
    would pay."""

    TICK_S = 0.1  # uvicorn's

    async def main_loop(self) -> None:
        """uvicorn's loop (`on_tick` every `TICK_S`) that `stop()` wakes."""
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()  # after `_wake`: `stop()` reads `_loop` first
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.TICK_S)

    def stop(self) -> None:
        """Stop serving (from any thread): at once, where `should_exit` waits for the next tick."""
        self.should_exit = True
        loop = getattr(self, "_loop", None)
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server has stopped
                loop.call_soon_threadsafe(self._wake.set)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown; with no connection or request open, without its wait for them."""
        if self.server_state.connections or self.server_state.tasks:
            return await super().shutdown(sockets)
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
