"""The HTTP front end's own ceiling: servelm's server over an engine that answers at once.

A fast engine (a GPU's, docs/BENCHMARKS.md "On a GPU") can produce tokens
faster than a Python front end streams them. This runs ``servelm serve``'s
own server and app (``ServelmServer`` around ``create_app``: validation,
admission, SSE, metrics, access log) in a subprocess on 127.0.0.1, over a
connector with no model behind it: every request streams ``--output-len``
tokens, one output per token, as fast as the event loop takes them. It
drives the server with ``servelm bench serve`` at each ``--concurrency``
and prints the tokens per second delivered and the server process's CPU
time per token (``/proc``): what the front end costs per streamed token, and
so the most one core of it can serve.

    .venv/bin/python bench/front_end.py --concurrency 1,32 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from serving import bench_serve, started

MODEL = "instant"
TICKS = os.sysconf("SC_CLK_TCK")


class InstantConnector:
    """The Connector protocol with nothing behind it: text is one token per character; a request streams
    ``max_tokens`` tokens at once, one output each."""

    async def models(self) -> list[Any]:
        from servelm.connectors.base import ModelCard

        return [ModelCard(MODEL, "generate", 1 << 20, created=1700000000)]

    async def health(self) -> bool:
        return True

    async def fatal_error(self) -> str | None:
        return None

    def load(self, progress: Any = None) -> None:
        """Nothing to load."""

    async def generate(self, model: str, request_id: str, prompt: str | list[int], params: Any) -> AsyncIterator[Any]:
        from servelm.engine.outputs import CompletionOutput, RequestOutput

        prompt_ids = await self.tokenize(model, prompt) if isinstance(prompt, str) else list(prompt)
        total = params.max_tokens or 16
        for i in range(total):
            done = i == total - 1
            token = 97 + i % 26
            yield RequestOutput(
                request_id,
                None,
                prompt_ids,
                [CompletionOutput(0, chr(token), [token], finish_reason="length" if done else None)],
                finished=done,
                delta=True,
                num_generated_tokens=i + 1,
                queue_time=0.0,
            )
            await asyncio.sleep(0)  # one output per turn of the event loop, as engine steps arrive

    async def abort(self, model: str, request_id: str) -> None:
        pass

    async def queue_depth(self) -> Any:
        from servelm.connectors.base import QueueDepth

        return QueueDepth(running=0, waiting=0)

    async def engine_stats(self) -> list[Any]:
        return []

    async def replicas(self) -> list[Any]:
        return []

    async def embed(self, model: str, inputs: Any) -> list[Any]:
        raise NotImplementedError("the instant connector serves no embeddings")

    async def tokenize(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50000 for c in text]

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    async def apply_chat_template(self, model: str, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        return "\n".join(str(m.get("content", "")) for m in messages)


def serve(port: int) -> int:
    """Run the server over the instant connector until SIGTERM (the subprocess side)."""
    from servelm.api import create_app
    from servelm.server import ServelmServer
    from servelm.settings import Settings

    settings = Settings(host="127.0.0.1", port=port, log_level="warning", embedding_model=None)
    return ServelmServer(create_app(InstantConnector(), settings), settings).run()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,32", help="comma-separated load levels")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the subprocess side
    args = ap.parse_args()
    if args.serve_port is not None:
        sys.exit(serve(args.serve_port))

    with started(lambda port: [sys.executable, __file__, "--serve-port", str(port)]) as (url, server):
        print(f"front end over an instant engine, 128-token prompts, {args.output_len} output tokens")
        print(f"{'level':>6s}{'out tok/s':>11s}{'server CPU ms/token':>21s}{'server cores busy':>19s}")
        for level in args.concurrency.split(","):
            cpu0 = _cpu_seconds(server.pid)
            summary = bench_serve(url, int(level), args.num_prompts, args.output_len, "completions", ("--model", MODEL))
            cpu = _cpu_seconds(server.pid) - cpu0
            tokens, seconds = summary["total_output_tokens"], summary["duration_s"]
            # The warm-up's CPU (up to 4 requests) is in `cpu` too: a small overcount against num_prompts.
            print(f"{'c=' + level:>6s}{tokens / seconds:11.1f}{cpu / tokens * 1e3:21.3f}{cpu / seconds:19.2f}")


if __name__ == "__main__":
    main()
