"""``servelm bench serve``: the serving benchmark's flags and its run.

The client, runner and reports load only when ``bench serve`` runs, so
``servelm serve`` starts as fast as before. torch is imported only with a
local ``--tokenizer``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from servelm.benchmark.config import DEFAULT_INPUT_LEN, DEFAULT_NUM_PROMPTS, config_from_args
from servelm.clients import api_key_from_env

T = TypeVar("T")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _comma_list(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type for ``1,8,32``: each comma-separated part parsed by ``parse``."""

    def parse_list(text: str) -> list[T]:
        values = [parse(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} holds no values")
        return values

    return parse_list


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` (with its one subcommand, ``serve``) to the ``servelm`` subparsers."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark a running OpenAI-compatible server",
        description="Benchmarks. 'servelm bench serve' measures a running server's serving performance.",
    )
    inner = bench.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    p = inner.add_parser(
        "serve",
        help="load-test a running server over HTTP: throughput, TTFT, ITL, TPOT, end-to-end latency",
        description="Send streamed requests to a running OpenAI-compatible server (servelm, vLLM, ...) at one "
        "or more load levels and report throughput and latency per level. Every request asks for "
        "max_tokens output tokens with ignore_eos, streamed with usage. Latencies are in milliseconds.",
    )
    p.set_defaults(command_parser=p)

    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server URL, with or without /v1 (default: %(default)s)"
    )
    g.add_argument("--model", default=None, help="model to send as 'model' (default: the first of GET /v1/models)")
    g.add_argument(
        "--api-key", default=None, help="API key (default: the first of SERVELM_API_KEYS, else OPENAI_API_KEY)"
    )
    g.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions (prompt sent as token ids: exact lengths) or /v1/chat/completions (default: %(default)s)",
    )
    g.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="a request not finished after this long fails (default: %(default)s)",
    )

    g = p.add_argument_group("prompts")
    g.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"requests per level (default: {DEFAULT_NUM_PROMPTS}; with --prompt-file: the file's prompts)",
    )
    g.add_argument(
        "--input-len",
        type=_positive_int,
        default=None,
        metavar="TOKENS",
        help=f"synthetic prompt length in tokens (default: {DEFAULT_INPUT_LEN})",
    )
    g.add_argument(
        "--prompt-file",
        default=None,
        metavar="FILE",
        help='prompts to send instead of synthetic ones: one per line, or JSON lines with a "prompt"',
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="NAME_OR_PATH",
        help="build synthetic prompts with this local tokenizer (HF folder, GGUF file or bundled name; "
        "imports transformers) instead of the server's /tokenize; with neither, prompts are random words",
    )
    out = g.add_mutually_exclusive_group()
    out.add_argument(
        "--output-len",
        type=_positive_int,
        default=128,
        metavar="TOKENS",
        help="output tokens per request, sent as max_tokens (default: %(default)s)",
    )
    out.add_argument(
        "--output-len-range",
        default=None,
        metavar="LO:HI",
        help="output tokens per request drawn uniformly from LO..HI (inclusive)",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so every request generates its full length (vLLM, servelm) (default: on)",
    )
    g.add_argument(
        "--min-tokens",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also send min_tokens = max_tokens, for servers that take it but not ignore_eos (default: off)",
    )
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    g.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="a JSON object merged into every request's body, e.g. '{\"response_format\": {...}}' (default: none)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of prompts, output lengths and arrivals (default: %(default)s)"
    )

    g = p.add_argument_group("load", "Each concurrency (and each rate) is one level; levels run in turn.")
    g.add_argument(
        "--concurrency",
        type=_comma_list(_positive_int),
        default=None,
        metavar="N[,N...]",
        help="requests in flight: alone, a closed loop; with --request-rate, a cap (default: 1)",
    )
    g.add_argument(
        "--request-rate",
        type=_comma_list(_positive_float),
        default=None,
        metavar="R[,R...]",
        help="Poisson arrivals at R requests/s ('inf': all at once) (default: off)",
    )
    g.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="requests sent before the first level and not counted (default: %(default)s)",
    )

    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput (requests/s meeting all), e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)",
    )
    g.add_argument(
        "--result-json",
        default=None,
        metavar="FILE",
        help="write every metric of every level, and the parameters, as JSON",
    )
    g.add_argument("--save-detailed", action="store_true", help="also put each request's timings in --result-json")
    g.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="plot latency against output throughput across levels (needs matplotlib)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return bench


def default_api_key() -> str | None:
    """The first of SERVELM_API_KEYS (comma-separated), else OPENAI_API_KEY."""
    return api_key_from_env() or os.environ.get("OPENAI_API_KEY") or None


def run_bench(args: argparse.Namespace) -> int:
    """Run ``servelm bench serve``: 0 on success, 1 when every request failed, 2 (exit) on bad arguments."""
    parser: argparse.ArgumentParser = args.command_parser
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if config.plot is not None:
        from servelm.benchmark.report import PLOT_INSTALL_HINT, plot_available

        if not plot_available():
            parser.error(PLOT_INSTALL_HINT)
    if config.api_key is None:
        config.api_key = default_api_key()

    import asyncio

    from servelm.benchmark.session import run_session

    try:
        return asyncio.run(run_session(config))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
