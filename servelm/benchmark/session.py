"""One benchmark run from start to end: find the model, build the prompts, run each level, report."""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, TextIO

import aiohttp

from servelm.benchmark import report
from servelm.benchmark.client import BenchClient, RequestResult, SamplingOptions, send_request
from servelm.benchmark.config import BenchConfig, Level
from servelm.benchmark.dataset import (
    BenchRequest,
    LocalTokenizer,
    PromptTokenizer,
    ServerTokenizer,
    file_requests,
    output_lengths,
    synthetic_requests,
    token_pool,
)
from servelm.benchmark.metrics import LevelSummary, summarize
from servelm.benchmark.runner import run_level


class BenchError(Exception):
    """A run that cannot start (server unreachable, no model); the message says why."""


async def first_model(client: BenchClient) -> str:
    """The id of the first model GET /v1/models lists."""
    try:
        async with client.request("GET", "/v1/models") as r:
            text = await r.text(errors="replace")
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"cannot reach {client.root}: {type(exc).__name__}: {exc}") from None
    if status != 200:
        raise BenchError(f"GET /v1/models answered HTTP {status}: {text[:200]}")
    try:
        models = json.loads(text).get("data") or []
    except (ValueError, AttributeError):
        raise BenchError(f"GET /v1/models answered no model list: {text[:200]}") from None
    if not models:
        raise BenchError("the server lists no models; name one with --model")
    return str(models[0]["id"])


async def pick_tokenizer(config: BenchConfig, client: BenchClient, model: str) -> PromptTokenizer | None:
    """A local --tokenizer when given, else the server's /tokenize when it has one, else None (words)."""
    if config.tokenizer is not None:
        try:
            return LocalTokenizer(config.tokenizer)
        except Exception as exc:
            raise BenchError(f"--tokenizer {config.tokenizer}: {exc}") from None
    return await ServerTokenizer.probe(client, model)


async def build_requests(
    config: BenchConfig,
    tokenizer: PromptTokenizer | None,
    pool: list[int] | None,
    rng: random.Random,
    count: int,
    offset: int,
) -> list[BenchRequest]:
    """``count`` requests: from the prompt file (from ``offset`` on) or synthetic (ids from ``pool``)."""
    lengths = output_lengths(count, rng, fixed=config.output_len, span=config.output_len_range)
    if config.prompts is not None:
        return file_requests(config.prompts, lengths, offset)
    return await synthetic_requests(
        lengths, config.input_len, rng, tokenizer=tokenizer, as_token_ids=config.endpoint == "completions", pool=pool
    )


def _detail(result: RequestResult) -> dict[str, Any]:
    data = asdict(result)
    data["started"] = None  # a perf_counter reading means nothing outside this process
    return data


def _progress(total: int, label: str, enabled: bool | None) -> Any:
    from tqdm import tqdm

    # disable=None: tqdm shows the bar only when stderr is a terminal.
    return tqdm(
        total=total,
        desc=label,
        unit="req",
        file=sys.stderr,
        disable=None if enabled is None else not enabled,
        leave=True,
    )


async def run_session(config: BenchConfig, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run every level of ``config``; prints the table to ``out`` and notes to ``err``.

    Returns 0 when some request completed, 1 when every one failed or the run
    could not start.
    """
    out = out or sys.stdout
    err = err or sys.stderr

    def note(message: str) -> None:
        print(f"bench: {message}", file=err, flush=True)

    pool_size = max([lv.concurrency or config.num_prompts for lv in config.levels] + [1])
    client = BenchClient(config.base_url, config.api_key, connections=pool_size, timeout=config.timeout)
    async with client:
        try:
            model = config.model or await first_model(client)
            tokenizer = await pick_tokenizer(config, client, model) if config.prompts is None else None
        except BenchError as exc:
            note(f"error: {exc}")
            return 1
        if config.prompts is not None:
            source = f"{len(config.prompts)} prompts from {config.prompt_file}"
        elif tokenizer is not None:
            source = f"{config.input_len}-token random prompts, tokenizer {tokenizer.description}"
        else:
            source = f"{config.input_len}-word random prompts (no tokenizer: about one token a word)"
        note(
            f"{config.base_url} model {model}, /v1/{'chat/completions' if config.endpoint == 'chat' else 'completions'}, {source}"
        )

        rng = random.Random(config.seed)
        options = SamplingOptions(
            ignore_eos=config.ignore_eos,
            send_min_tokens=config.min_tokens,
            temperature=config.temperature,
            extra_body=config.extra_body,
        )

        async def send(req: BenchRequest) -> RequestResult:
            return await send_request(client, config.endpoint, model, req, options, config.timeout)

        try:
            pool = await token_pool(tokenizer) if tokenizer is not None else None
            warmup = await build_requests(config, tokenizer, pool, rng, config.warmup, 0)
            # Each level gets fresh prompts, so no level finds its prompts in the prefix cache.
            batches = [
                await build_requests(
                    config, tokenizer, pool, rng, config.num_prompts, config.warmup + i * config.num_prompts
                )
                for i in range(len(config.levels))
            ]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            note(f"error: could not build the prompts: {type(exc).__name__}: {exc}")
            return 1
        arrival_rngs = [random.Random(rng.getrandbits(64)) for _ in config.levels]

        if warmup:
            first = config.levels[0].concurrency or len(warmup)
            results, _ = await run_level(send, warmup, concurrency=min(first, len(warmup)))
            failed = sum(1 for r in results if r.error is not None)
            note(f"warmup: {len(results) - failed}/{len(results)} ok")

        summaries: list[LevelSummary] = []
        for level, requests, arrival_rng in zip(config.levels, batches, arrival_rngs):
            summaries.append(await _run_one(config, level, requests, arrival_rng, send))
            note(report.level_line(summaries[-1]))

    cpu_s = sum(s.client_cpu_s for s in summaries)
    wall_s = sum(s.duration_s for s in summaries)
    print(report.format_table(summaries), file=out)
    print(report.cpu_line(cpu_s, wall_s), file=out, flush=True)
    status = 0
    try:
        if config.result_json:
            params = config.params() | {"model": model, "prompt_source": source}
            report.write_json(config.result_json, report.result_document(params, summaries, cpu_s, wall_s))
            note(f"results written to {config.result_json}")
        if config.plot:
            report.plot(config.plot, summaries, title=f"{model}: {source}")
            note(f"plot written to {config.plot}")
    except OSError as exc:
        note(f"error: could not write the results: {exc}")
        status = 1
    if not any(s.completed for s in summaries):
        note("error: every request failed")
        return 1
    return status


async def _run_one(
    config: BenchConfig,
    level: Level,
    requests: list[BenchRequest],
    rng: random.Random,
    send: Callable[[BenchRequest], Awaitable[RequestResult]],
) -> LevelSummary:
    """Run one level with a progress bar and summarize it, with the client's CPU time over the level."""
    with _progress(len(requests), level.label, config.progress) as bar:
        cpu0 = time.process_time()
        results, duration = await run_level(
            send,
            requests,
            concurrency=level.concurrency,
            request_rate=level.request_rate,
            rng=rng,
            on_result=lambda _: bar.update(1),
        )
        cpu_s = time.process_time() - cpu0
    summary = summarize(
        results,
        duration,
        concurrency=level.concurrency,
        request_rate=level.request_rate,
        slos=config.slos,
        client_cpu_s=cpu_s,
    )
    if config.save_detailed:
        summary.requests = [_detail(r) for r in results]
    return summary
