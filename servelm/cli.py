"""The ``servelm`` command: ``servelm serve`` runs the server, ``servelm chat`` talks to one.

Settings come from defaults < ``--config`` YAML < ``SERVELM_*`` environment
< flags. A bad setting exits with status 2 and a message naming it. The
engine (and so torch) is imported only when ``serve`` actually starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

import httpx
import uvicorn
from pydantic import ValidationError
from uvicorn.config import LOGGING_CONFIG

from servelm.benchmark.cli import add_bench_parser, run_bench
from servelm.clients import api_key_from_env, envelope_message, server_base_url
from servelm.settings import ENV_PREFIX, Settings, SettingsError, unknown_env_vars

if TYPE_CHECKING:
    from fastapi import FastAPI

SUBCOMMANDS = ("serve", "chat", "bench")


def _default(name: str) -> Any:
    field = Settings.model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]


def _flag_names() -> dict[str, str]:
    """Setting name -> the flag that sets it, for error messages."""
    return {
        "api_keys": "--api-key",
        "cors_origins": "--cors-origin",
        "enable_prefix_caching": "--[no-]prefix-caching",
        "metrics_require_auth": "--[no-]metrics-require-auth",
        "prefix_routing": "--[no-]prefix-routing",
        "rate_limits": "--rate-limit-rpm",
        "rate_limits.default.requests_per_minute": "--rate-limit-rpm",
        "rate_limits.default.tokens_per_minute": "--rate-limit-tpm",
    }


# Flags that set one field of a nested setting: flag dest -> path in Settings.
_NESTED_FLAGS = {
    "rate_limit_rpm": ("rate_limits", "default", "requests_per_minute"),
    "rate_limit_tpm": ("rate_limits", "default", "tokens_per_minute"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``servelm`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="servelm",
        description="An OpenAI-compatible LLM inference server with its own serving engine. "
        "With no subcommand, 'serve' is assumed.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,chat,bench}")

    serve = sub.add_parser(
        "serve",
        help="load the models and serve the OpenAI-compatible API",
        description="Load the models, then serve the OpenAI-compatible API. Settings: defaults < --config "
        f"file < {ENV_PREFIX}* environment variables < these flags. A bad setting exits with status 2.",
        argument_default=argparse.SUPPRESS,
    )
    serve.set_defaults(command_parser=serve)
    d = _default
    serve.add_argument("--config", metavar="FILE", help="YAML config file (see servelm.yaml)")
    g = serve.add_argument_group("models")
    g.add_argument("--model", metavar="NAME_OR_PATH", help=f"chat/completions model: a bundled name, a Hugging Face folder or a GGUF file (default: {d('model')})")
    g.add_argument("--embedding-model", metavar="NAME_OR_PATH", help=f"embedding model, or 'none' to serve no embeddings (default: {d('embedding_model')})")
    g.add_argument("--served-model-name", metavar="NAME", help="the name clients send as 'model' for the chat model (default: --model as given)")
    g.add_argument("--chat-template", metavar="FILE", help="Jinja chat template file overriding the model's own (read at start-up)")
    g = serve.add_argument_group("engine")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help=f"weight and activation dtype; auto: bfloat16 on CUDA and on CPUs whose bfloat16 matmuls are fast (measured at start-up), else float32 (default: {d('dtype')})")
    g.add_argument("--device", metavar="DEVICE", help=f"cpu, cuda, cuda:N or auto (default: {d('device')})")
    g.add_argument("--max-num-seqs", metavar="N", help=f"most sequences running at once (default: {d('max_num_seqs')})")
    g.add_argument("--max-num-batched-tokens", metavar="N", help=f"token budget of one engine step (default: {d('max_num_batched_tokens')})")
    g.add_argument("--max-model-len", metavar="N", help="context length limit (default: the model's own)")
    g.add_argument("--kv-cache-memory", metavar="SIZE", help=f"KV cache size: bytes (1073741824, 4GiB, 512MB) or a fraction of free memory (0.5) (default: {d('kv_cache_memory')})")
    g.add_argument("--block-size", metavar="N", help=f"tokens per KV cache block, a power of two (default: {d('block_size')})")
    g.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction, help="reuse the KV cache of shared prompt prefixes (default: on)")
    g.add_argument("--seed", metavar="N", help=f"engine random seed (default: {d('seed')})")
    g.add_argument("--quantization", choices=["none", "int8"], help=f"weights: none, or int8 weight-only on CPU (per-row scales; decodes one sequence faster than float32 and bfloat16, more memory; see docs/BENCHMARKS.md) (default: {d('quantization')})")
    g = serve.add_argument_group("HTTP")
    g.add_argument("--host", metavar="HOST", help=f"address to listen on (default: {d('host')})")
    g.add_argument("--port", metavar="PORT", help=f"port to listen on, 0 for any free port (default: {d('port')})")
    g.add_argument("--api-key", dest="api_keys", metavar="KEY", action="append", help=f"require 'Authorization: Bearer KEY' (repeatable; also {ENV_PREFIX}API_KEYS, comma-separated) (default: no auth)")
    g.add_argument("--metrics-require-auth", action=argparse.BooleanOptionalAction, help="require the API key on /metrics too (default: off)")
    g.add_argument("--cors-origin", dest="cors_origins", metavar="ORIGIN", action="append", help="allow browser requests from ORIGIN, or '*' (repeatable) (default: CORS off)")
    g.add_argument("--max-body-bytes", metavar="N", help=f"largest request body accepted, larger gets 413 (default: {d('max_body_bytes')})")
    g.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], help=f"server log level (default: {d('log_level')})")
    g.add_argument("--log-format", choices=["text", "json"], help=f"log lines as text or as one JSON object each; access lines (logger servelm.access) carry request id, route, status, tokens, TTFT and total time (default: {d('log_format')})")
    g = serve.add_argument_group("admission control", "Bound the engine's queue and each request's time; 0 or 'none': no limit.")
    g.add_argument("--max-waiting", metavar="N", help=f"most requests waiting to start in the engine; past it new requests get 429 with Retry-After (default: {d('max_waiting')})")
    g.add_argument("--queue-timeout", metavar="SECONDS", help=f"a request still waiting to start after this long is aborted and gets 429 with Retry-After (default: {d('queue_timeout'):g})")
    g.add_argument("--request-timeout", metavar="SECONDS", help="a request running longer than this is aborted and gets 408 request_timeout (a stream: an error event, then [DONE]) (default: no limit)")
    g.add_argument("--shutdown-timeout", metavar="SECONDS", help=f"on SIGTERM or Ctrl-C: stop admitting (503 with Retry-After), give requests in flight this long to finish, abort the rest with an error, exit 0; a second signal stops at once (default: {d('shutdown_timeout'):g})")
    g = serve.add_argument_group(
        "scale-out on Ray Serve",
        "Run the engines as replicas of a Ray Serve deployment, on this machine or a Ray cluster (see docs/DEPLOY.md). "
        "Without --replicas, --ray-address or --min/--max-replicas the engine runs in this process and Ray is not loaded.",
    )
    g.add_argument("--replicas", metavar="N", help="engine replicas; alone, starts a local Ray cluster inside the server (default: no Ray)")
    g.add_argument("--ray-address", metavar="HOST:PORT", help="join the Ray cluster at HOST:PORT, or 'auto' for the one on this machine (started with 'ray start --head'); unreachable: exit status 2 (default: start one)")
    g.add_argument("--replica-cpus", metavar="N", help=f"CPUs Ray reserves for each replica (default: {d('replica_cpus'):g})")
    g.add_argument("--replica-gpus", metavar="N", help=f"GPUs Ray reserves for each replica (default: {d('replica_gpus'):g})")
    g.add_argument("--min-replicas", metavar="N", help="autoscale between --min-replicas and --max-replicas on requests in flight per replica (default: no autoscaling)")
    g.add_argument("--max-replicas", metavar="N", help="see --min-replicas")
    g.add_argument("--target-ongoing-requests", metavar="N", help=f"autoscaling: requests in flight per replica Serve aims for (default: {d('target_ongoing_requests'):g})")
    g.add_argument("--prefix-routing", action=argparse.BooleanOptionalAction, help="send a request to the replica that holds its prompt prefix in cache unless it is much busier than the others; --no-prefix-routing: load only (default: on)")
    g.add_argument("--ray-app-name", metavar="NAME", help=f"name of the Serve application, one per servelm server on a cluster (default: {d('ray_app_name')})")
    g = serve.add_argument_group("rate limits", "Per API key (per client address when no keys are set), on /v1/chat/completions, /v1/completions and /v1/embeddings; per-key overrides go in the config file (rate_limits.keys). Off by default.")
    g.add_argument("--rate-limit-rpm", metavar="N", help="requests per minute for each client (default: unlimited)")
    g.add_argument("--rate-limit-tpm", metavar="N", help="tokens per minute for each client: prompt plus max_tokens reserved, corrected to actual use (default: unlimited)")
    g.add_argument("--rate-limit-storage", metavar="URI", help=f"where the counters live: memory:// (this process) or a shared store such as redis://HOST:6379 (needs limits[async-redis]) (default: {d('rate_limit_storage')})")

    chat = sub.add_parser(
        "chat",
        help="chat with a running server in the terminal",
        description="Chat with a running servelm (or any OpenAI-compatible) server. Replies stream as they are "
        "generated; the conversation is kept. Exit with /quit or Ctrl-D; /reset starts over.",
    )
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="server URL, with or without /v1 (default: %(default)s)")
    chat.add_argument("--api-key", default=None, help=f"API key (default: the first of {ENV_PREFIX}API_KEYS, if set)")
    chat.add_argument("--model", default=None, help="model to chat with (default: the server's first model)")
    chat.add_argument("--system", default=None, metavar="PROMPT", help="system prompt")
    chat.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    chat.add_argument("--max-tokens", type=int, default=None, help="longest reply in tokens (default: up to the context)")
    add_bench_parser(sub)
    return parser


def _normalise_argv(argv: Sequence[str]) -> list[str]:
    # `servelm --model x` and `python -m servelm` mean `servelm serve ...`.
    argv = list(argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        return ["serve", *argv]
    return argv


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    """Settings from the parsed ``serve`` flags, the environment and the config file.

    Exits with status 2 (via ``parser.error``) naming the bad setting.
    """
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "command_parser")}
    for dest, path in _NESTED_FLAGS.items():
        if dest in flags:
            # pydantic-settings merges nested dicts across sources, so the
            # config file's other rate_limits entries survive this flag.
            node = flags.setdefault(path[0], {})
            for part in path[1:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = flags.pop(dest)
    unknown = unknown_env_vars()
    if unknown:
        parser.error(f"unknown environment variable(s) {', '.join(unknown)}: no such setting")
    try:
        return Settings(**flags)
    except SettingsError as exc:
        parser.error(str(exc))
    except ValidationError as exc:
        parser.error(describe_validation_error(exc))
    raise AssertionError("unreachable")


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad setting, naming it as a flag, an environment variable and a config key."""
    flags = _flag_names()
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if isinstance(p, str)]
        name = ".".join(loc)  # nested settings: rate_limits.default.requests_per_minute
        if err.get("type") == "extra_forbidden":
            lines.append(f"unknown setting '{name}' (in the config file)")
            continue
        message = err.get("msg", "invalid")
        if not name:
            lines.append(message.removeprefix("Value error, "))
            continue
        top = loc[0]
        if len(loc) > 1 and name not in flags:
            flag = "config file"  # a nested field no flag sets (rate_limits.keys...)
        else:
            flag = flags.get(name) or flags.get(top) or "--" + top.replace("_", "-")
        got = err.get("input")
        lines.append(
            f"invalid setting '{name}' ({flag} / {ENV_PREFIX}{top.upper()}): "
            f"{message.removeprefix('Value error, ')} (got {got!r})"
        )
    return "; ".join(lines)


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

    def __init__(self, app: FastAPI, settings: Settings, on_ready: Callable[[str], None] | None = None):
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
        self.server.run()
        return self.exit_code


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

    connector: Any
    if settings.use_ray:
        # Imported only here: the default path never loads Ray.
        from servelm.connectors.ray import RayConnector
        from servelm.connectors.ray_cluster import RayClusterError
        from servelm.connectors.ray_deploy import plan_from_settings

        connector = RayConnector(plan_from_settings(settings), settings.ray_address)
        where = settings.ray_address or "a local Ray cluster"
        say(f"connecting to {where}")
        try:
            connector.connect()
        except RayClusterError as exc:
            say(f"error: --ray-address: {exc}" if settings.ray_address else f"error: {exc}")
            return 2
    else:
        from servelm.connectors.local import LocalConnector

        connector = LocalConnector(
            settings.model,
            settings.embedding_model,
            settings.engine_config(),
            served_model_name=settings.served_model_name,
        )
    listening = threading.Event()
    app = create_app(connector, settings)
    server = ServelmServer(app, settings, on_ready=lambda url: listening.set())

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


def _error_message(response: httpx.Response) -> str:
    message = envelope_message(response)
    return message if message is not None else f"HTTP {response.status_code}: {response.text[:200]}"


def run_chat(
    url: str,
    api_key: str | None = None,
    model: str | None = None,
    system: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    *,
    input_fn: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Interactive chat against a running server; returns the exit status."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = server_base_url(url)
    client = httpx.Client(
        base_url=base, headers=headers, timeout=httpx.Timeout(30.0, read=None), transport=transport
    )
    with client:
        try:
            if model is None:
                r = client.get("/v1/models")
                if r.status_code != 200:
                    print(f"error: {_error_message(r)}", file=out)
                    return 1
                models = r.json().get("data", [])
                if not models:
                    print("error: the server serves no models", file=out)
                    return 1
                model = models[0]["id"]
        except httpx.HTTPError as exc:
            print(f"error: cannot reach {base}: {exc}", file=out)
            return 1

        print(f"Chatting with {model} at {base}. /quit or Ctrl-D exits, /reset starts over.", file=out, flush=True)
        start = [{"role": "system", "content": system}] if system else []
        history: list[dict[str, str]] = list(start)
        while True:
            try:
                line = input_fn("you> ")
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            if text == "/reset":
                history = list(start)
                print("(conversation cleared)", file=out, flush=True)
                continue
            history.append({"role": "user", "content": text})
            body: dict[str, Any] = {"model": model, "messages": history, "stream": True}
            if temperature is not None:
                body["temperature"] = temperature
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            reply, error = _stream_reply(client, body, out)
            if error is not None:
                print(f"error: {error}", file=out, flush=True)
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})


def _stream_reply(client: httpx.Client, body: dict[str, Any], out: TextIO) -> tuple[str, str | None]:
    """Stream one reply to ``out``; returns (text, error message or None)."""
    parts: list[str] = []
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return "", _error_message(r)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    print(file=out)
                    return "".join(parts), event["error"].get("message", "stream error")
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        parts.append(piece)
                        print(piece, end="", file=out, flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]", file=out, flush=True)  # leaving the block closed the stream: the server aborts
        return "".join(parts), None
    except httpx.HTTPError as exc:
        return "", f"request failed: {exc}"
    print(file=out, flush=True)
    return "".join(parts), None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``servelm`` command."""
    parser = build_parser()
    args = parser.parse_args(_normalise_argv(sys.argv[1:] if argv is None else argv))
    if args.command == "chat":
        api_key = args.api_key if args.api_key is not None else api_key_from_env()
        return run_chat(args.url, api_key, args.model, args.system, args.temperature, args.max_tokens)
    if args.command == "bench":
        return run_bench(args)
    settings = settings_from_args(args, args.command_parser)
    return serve(settings)
