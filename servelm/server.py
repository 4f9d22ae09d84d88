"""The server process of ``servelm serve``: uvicorn around the app, the drain on SIGTERM, the engine watchdog.

``serve(settings)`` listens at once, loads the models in a background
thread, and serves until a signal (and its drain) or a fatal engine error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from servelm.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with servelm's lifecycle.

    Once its sockets listen it calls ``on_listen`` and starts ``watchdog``.
    The first SIGTERM or SIGINT runs ``drain`` (when given) instead of
    stopping at once; the server stops when the drain ends. A second signal
    is uvicorn's own: stop now.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        on_listen: Callable[[], None] | None,
        drain: Callable[[], Awaitable[None]] | None = None,
        watchdog: Callable[[], Awaitable[None]] | None = None,
    ):
        super().__init__(config)
        self.on_listen = on_listen
        self.drain = drain
        self.watchdog = watchdog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        self._loop = asyncio.get_running_loop()
        if self.on_listen is not None:
            self.on_listen()
        if self.watchdog is not None:
            self._spawn(self.watchdog())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # keep a reference: the loop holds tasks only weakly
        task.add_done_callback(self._tasks.discard)

    async def _drain_then_exit(self) -> None:
        try:
            assert self.drain is not None
            await self.drain()
        finally:
            self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain is None or self._loop is None or self._draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        if sig == signal.SIGINT:
            # Ctrl-C still ends as a KeyboardInterrupt once the drain is over
            # (uvicorn re-raises the signals it captured); SIGTERM ends with 0.
            self._captured_signals.append(sig)
        # A signal handler must not touch the loop directly.
        self._loop.call_soon_threadsafe(self._spawn, self._drain_then_exit())


# How often the server checks that its engine still lives.
_WATCHDOG_INTERVAL_S = 0.5


class ServelmServer:
    """The HTTP server of ``servelm serve``: uvicorn around an app from ``create_app``.

    It reports its URL once it listens (``on_ready``), drains on SIGTERM or
    Ctrl-C (``settings.shutdown_timeout``), and stops with ``exit_code`` 1
    when the connector reports a fatal error (its engine loop died, its
    models failed to load) rather than serving errors forever.
    """

    def __init__(
        self,
        app: FastAPI,
        settings: Settings,
        on_ready: Callable[[str], None] | None = None,
        sock: socket.socket | None = None,
    ):
        self.sock = sock  # bound already (``bind``), else uvicorn binds settings.host and port itself
        self.config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            # servelm's own access log (logger servelm.access) replaces uvicorn's,
            # and in JSON mode uvicorn's lines go through the same JSON handler.
            access_log=False,
            log_config=None if settings.log_format == "json" else LOGGING_CONFIG,
            # The drain has already let requests finish; this only bounds closing the rest.
            timeout_graceful_shutdown=5,
        )
        self.ctx = app.state.servelm.ctx
        self.settings = settings
        self.fatal_error: str | None = None  # set by the watchdog when it stops the server
        self.server = _Uvicorn(
            self.config,
            (lambda: on_ready(self.url)) if on_ready is not None else None,
            drain=self._drain,
            watchdog=self._watchdog,
        )

    @property
    def url(self) -> str:
        """The base URL actually bound (port 0 resolved)."""
        port = self.settings.port
        for server in getattr(self.server, "servers", []):
            for sock in server.sockets:
                port = sock.getsockname()[1]
                break
        host = self.settings.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    @property
    def exit_code(self) -> int:
        """The status ``servelm serve`` exits with: 1 after a fatal error, else 0."""
        return 0 if self.fatal_error is None else 1

    async def _drain(self) -> None:
        timeout = self.settings.shutdown_timeout
        logging.getLogger("servelm").info("shutting down: draining for up to %g s", timeout)
        await self.ctx.lifecycle.drain(timeout)

    async def _watchdog(self) -> None:
        while not self.server.should_exit:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            fatal = await self.ctx.connector.fatal_error()
            if fatal is not None:
                logging.getLogger("servelm").error("stopping the server: %s", fatal)
                self.fatal_error = fatal
                self.server.should_exit = True
                return

    def run(self) -> int:
        """Serve until a signal (and its drain) or a fatal engine error; returns the exit status."""
        self.server.run(sockets=None if self.sock is None else [self.sock])
        return self.exit_code


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (IPv6 where the host has a colon), as uvicorn binds one,
    not yet listening; raises OSError (the port in use, an address not of this machine)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _connector(settings: Settings, say: Callable[[str], None]) -> Any:
    """The engine in this process, or replicas on Ray Serve (None: the cluster cannot be reached, exit 2).

    The Ray cluster is started or joined here, in the main thread, before
    the server listens: Ray ties the processes it starts to the thread that
    started them, and an unreachable address must fail the start at once.
    """
    if not settings.use_ray:
        from servelm.connectors.local import LocalConnector

        return LocalConnector(
            settings.model,
            settings.embedding_model,
            settings.engine_config(),
            served_model_name=settings.served_model_name,
        )
    # Imported only here: the default path never loads Ray.
    from servelm.connectors.ray import RayConnector
    from servelm.connectors.ray_cluster import RayClusterError
    from servelm.connectors.ray_deploy import plan_from_settings

    connector = RayConnector(plan_from_settings(settings), settings.ray_address)
    say(f"connecting to {settings.ray_address or 'a local Ray cluster'}")
    try:
        connector.connect()
    except RayClusterError as exc:
        say(f"error: --ray-address: {exc}" if settings.ray_address else f"error: {exc}")
        return None
    return connector


def serve(settings: Settings, out: TextIO = sys.stderr) -> int:
    """Listen at once, load the models in the background, serve until SIGTERM/Ctrl-C or a fatal error.

    While the models load, /health and /ready answer 503 and requests get
    503 ``model_not_ready``. A load failure stops the server with status 1.
    """
    from servelm.api.access_log import configure_logging

    configure_logging(settings.log_level, settings.log_format)

    def say(message: str) -> None:
        print(f"servelm: {message}", file=out, flush=True)

    from servelm.models.registry import ModelPathError, resolve_model_path

    for flag, name in (("--model", settings.model), ("--embedding-model", settings.embedding_model)):
        if name is not None:
            try:
                resolve_model_path(name)
            except ModelPathError as exc:
                say(f"error: {flag}: {exc}")
                return 2

    from servelm.api import create_app

    # Bound before anything starts, Ray's processes included: a port in use fails the start at once, and
    # no process started below (Ray's) can take the port before the server listens on it.
    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        say(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}")
        return 2
    connector = _connector(settings, say)
    if connector is None:
        sock.close()
        return 2
    listening = threading.Event()
    app = create_app(connector, settings)
    server = ServelmServer(app, settings, on_ready=lambda url: listening.set(), sock=sock)

    def load() -> None:
        say(f"loading {settings.model}" + (f" and {settings.embedding_model}" if settings.embedding_model else ""))
        try:
            connector.load(progress=say)
        except Exception as exc:
            logging.getLogger("servelm").debug("loading failed", exc_info=True)
            say(f"error: could not load the models: {exc}")
            return  # the server's watchdog sees connector.fatal_error() and exits 1
        listening.wait()
        url = server.url
        say(f"ready: {url} (OpenAI base URL {url}/v1)")

    # A daemon thread: a signal during loading must not wait for the weights.
    threading.Thread(target=load, name="servelm-load", daemon=True).start()
    try:
        return server.run()
    except KeyboardInterrupt:
        return 130
    finally:
        connector.shutdown()
