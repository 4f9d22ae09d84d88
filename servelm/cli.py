"""The ``servelm`` command: ``servelm serve`` runs the server, ``servelm chat`` talks to one.

Settings come from defaults < ``--config`` YAML < ``SERVELM_*`` environment
< flags. The ``serve`` flags are made from the settings model
(``servelm/settings.py``), whose descriptions are also the comments of
servelm.yaml and the settings table of docs/DEPLOY.md. A bad setting exits
with status 2 and a message naming it. The engine (and so torch) is
imported only when ``serve`` actually starts.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from servelm.benchmark.cli import add_bench_parser, run_bench
from servelm.chat_client import run_chat
from servelm.clients import api_key_from_env
from servelm.server import serve
from servelm.settings import (
    ENV_PREFIX,
    GROUPS,
    RateLimit,
    Settings,
    SettingsError,
    unknown_env_vars,
)

SUBCOMMANDS = ("serve", "chat", "bench")

# Flags that set one field of a nested setting: flag dest -> (flag, path in Settings).
NESTED_FLAGS = {
    "rate_limit_rpm": ("--rate-limit-rpm", ("rate_limits", "default", "requests_per_minute")),
    "rate_limit_tpm": ("--rate-limit-tpm", ("rate_limits", "default", "tokens_per_minute")),
}


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def setting_default(name: str) -> Any:
    """The default value of setting ``name``."""
    field = Settings.model_fields[name]
    return field.get_default(call_default_factory=True)


def flag_of(name: str) -> str | None:
    """The flag that sets setting ``name`` (``--[no-]x`` for a switch), or None when no flag does."""
    field = Settings.model_fields[name]
    flag = _extra(field).get("flag")
    if flag == "":
        return None
    flag = flag or "--" + name.replace("_", "-")
    return "--[no-]" + flag[2:] if field.annotation is bool else flag


def default_text(name: str) -> str:
    """How ``--help`` and the docs show setting ``name``'s default."""
    field = Settings.model_fields[name]
    text = _extra(field).get("default_text")
    if text:
        return str(text)
    value = setting_default(name)
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is Literal:
        return [str(c) for c in typing.get_args(annotation)]
    return None


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Annotated,):
        annotation = typing.get_args(annotation)[0]
    return typing.get_origin(annotation) is list


def _add_setting_flags(serve: argparse.ArgumentParser) -> None:
    groups = {"": serve}
    for title, description in GROUPS.items():
        groups[title] = serve.add_argument_group(title, description)  # type: ignore[assignment]
    for name, field in Settings.model_fields.items():
        flag = flag_of(name)
        if flag is None:
            continue
        extra = _extra(field)
        help_text = f"{field.description} (default: {default_text(name)})".replace("%", "%%")
        group = groups[extra.get("group", "")]
        kwargs: dict[str, Any] = {"dest": name, "help": help_text}
        if field.annotation is bool:
            group.add_argument(flag.replace("[no-]", ""), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        choices = _choices(field.annotation)
        if choices is not None:
            kwargs["choices"] = choices
        else:
            kwargs["metavar"] = extra.get("metavar") or "VALUE"
        if _is_list(field.annotation):
            kwargs["action"] = "append"
        group.add_argument(flag, **kwargs)
    limits = groups["rate limits"]
    for dest, (flag, path) in NESTED_FLAGS.items():
        description = RateLimit.model_fields[path[-1]].description
        limits.add_argument(flag, dest=dest, metavar="N", help=f"{description}, for every client (default: unlimited)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``servelm`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="servelm",
        description="An OpenAI-compatible LLM inference server with its own serving engine. "
        "With no subcommand, 'serve' is assumed.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,chat,bench}")

    serve_parser = sub.add_parser(
        "serve",
        help="load the models and serve the OpenAI-compatible API",
        description="Load the models, then serve the OpenAI-compatible API. Settings: defaults < --config "
        f"file < {ENV_PREFIX}* environment variables < these flags. A bad setting exits with status 2.",
        argument_default=argparse.SUPPRESS,
    )
    serve_parser.set_defaults(command_parser=serve_parser)
    _add_setting_flags(serve_parser)

    chat = sub.add_parser(
        "chat",
        help="chat with a running server in the terminal",
        description="Chat with a running servelm (or any OpenAI-compatible) server. Replies stream as they are "
        "generated; the conversation is kept. Exit with /quit or Ctrl-D; /reset starts over.",
    )
    chat.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server URL, with or without /v1 (default: %(default)s)"
    )
    chat.add_argument("--api-key", default=None, help=f"API key (default: the first of {ENV_PREFIX}API_KEYS, if set)")
    chat.add_argument("--model", default=None, help="model to chat with (default: the server's first model)")
    chat.add_argument("--system", default=None, metavar="PROMPT", help="system prompt")
    chat.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    chat.add_argument(
        "--max-tokens", type=int, default=None, help="longest reply in tokens (default: up to the context)"
    )
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
    for dest, (_, path) in NESTED_FLAGS.items():
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
    flags = {".".join(path): flag for flag, path in NESTED_FLAGS.values()}
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
            flag = flags.get(name) or (flag_of(top) if top in Settings.model_fields else None) or "config file"
        got = err.get("input")
        lines.append(
            f"invalid setting '{name}' ({flag} / {ENV_PREFIX}{top.upper()}): "
            f"{message.removeprefix('Value error, ')} (got {got!r})"
        )
    return "; ".join(lines)


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
