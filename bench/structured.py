"""Structured outputs under load: every request under a JSON schema, against the same load unconstrained.

One ``servelm serve`` (started and stopped here, by PID), then:

- first use: what compiling costs, apart from the load runs. In this
  process, on the model's tokenizer: the first compile (which builds
  xgrammar's tokenizer info once per engine), a new schema once warm, and
  a cache hit. Over HTTP: the latency of a 1-token chat request,
  unconstrained, with a schema the server has never seen, and with that
  schema again (cached).
- load: ``--rounds`` interleaved rounds of ``servelm bench serve`` at
  ``--concurrency`` on the chat endpoint, A unconstrained and B with
  ``response_format`` = the schema, same prompts and ``--output-len``. The
  schema (an object with a list of at least 64 people) cannot end before
  ``max_tokens``, so both sides generate exactly ``--output-len`` tokens per
  request. Medians over rounds, and B/A.

    .venv/bin/python bench/structured.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx
from serving import MODEL, bench_serve, median, ratio, server

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "people": {"type": "array", "items": PERSON, "minItems": 64}},
    "required": ["title", "people"],
}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "people", "schema": schema, "strict": True}}


def compile_times(out) -> None:
    """Compile the schema in this process, on the served model's tokenizer: first use, a new schema, a hit."""
    from servelm.engine.grammar_compiler import GrammarCompiler
    from servelm.engine.structured_outputs import StructuredOutputsParams
    from servelm.models.registry import resolve_model_path
    from servelm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    rows = []
    for label, schema in (
        ("first compile (with the tokenizer info)", SCHEMA),
        ("a new schema", {**SCHEMA, "description": "another"}),
        ("the same schema again (cache hit)", SCHEMA),
    ):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        rows.append((label, (time.perf_counter() - start) * 1000))
    print("\n| in-process compile | ms |\n|---|---|", file=out)
    for label, ms in rows:
        print(f"| {label} | {ms:.1f} |", file=out)


def first_use_latency(url: str, repeats: int, out) -> None:
    """Latency of 1-token chat requests: unconstrained, a schema never seen (compiled), the schema again (cached)."""

    def one(fields: dict) -> float:
        body = {
            "model": MODEL,
            "max_tokens": 1,
            "temperature": 0,
            "messages": [{"role": "user", "content": "List people as JSON."}],
            **fields,
        }
        start = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return (time.perf_counter() - start) * 1000

    one({})  # the server's first request warms up what every request uses
    check = httpx.post(
        url + "/v1/chat/completions",
        timeout=600,
        json={
            "model": MODEL,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": response_format(SCHEMA),
        },
    )
    text = check.json()["choices"][0]["message"]["content"]
    if not text.startswith('{"title": "'):
        raise RuntimeError(f"the server did not follow the schema: {text!r}")
    free = [one({}) for _ in range(repeats)]
    fresh = [one({"response_format": response_format({**SCHEMA, "description": f"fresh {i}"})}) for i in range(repeats)]
    cached = [one({"response_format": response_format(SCHEMA)}) for _ in range(repeats + 1)][1:]
    print("\n| 1-token chat request over HTTP | median ms |\n|---|---|", file=out)
    print(f"| unconstrained | {statistics.median(free):.1f} |", file=out)
    print(f"| a schema the server has not seen (compiled first) | {statistics.median(fresh):.1f} |", file=out)
    print(f"| the same schema again (cached) | {statistics.median(cached):.1f} |", file=out)


def load(url: str, rounds: int, concurrency: int, num_prompts: int, output_len: int, out) -> None:
    sides = (
        ("unconstrained", ()),
        ("JSON schema", ("--extra-body", json.dumps({"response_format": response_format(SCHEMA)}))),
    )
    figures: dict[str, dict[str, list]] = {name: {"tput": [], "ttft": [], "itl": []} for name, _ in sides}
    for r in range(rounds):
        for name, extra in sides:
            level = bench_serve(url, concurrency, num_prompts, output_len, "chat", extra)
            failed = level.get("failed", 0)
            if failed:
                raise RuntimeError(f"{name}: {failed} requests failed: {level.get('errors')}")
            row = figures[name]
            row["tput"].append(level["output_throughput"])
            row["ttft"].append(level["ttft_ms"]["median"])
            row["itl"].append(level["itl_ms"]["median"])
            print(
                f"round {r} {name}: {level['output_throughput']:.1f} tok/s, TTFT p50 {level['ttft_ms']['median']:.0f} ms, "
                f"ITL p50 {level['itl_ms']['median']:.1f} ms",
                file=out,
                flush=True,
            )
    a, b = figures["unconstrained"], figures["JSON schema"]
    print(f"\n| c={concurrency}, {output_len} tokens each, chat | unconstrained | JSON schema | ratio |", file=out)
    print("|---|---|---|---|", file=out)
    for label, key, fmt in (
        ("output tok/s", "tput", ".1f"),
        ("TTFT p50 (ms)", "ttft", ".0f"),
        ("ITL p50 (ms)", "itl", ".1f"),
    ):
        ma, mb = median(a[key]), median(b[key])
        print(f"| {label} (median of {rounds}) | {ma:{fmt}} | {mb:{fmt}} | {ratio(mb, ma)} |", file=out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per side per round")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--first-use-repeats", type=int, default=3)
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores; load average before: {os.getloadavg()}", flush=True)
    compile_times(sys.stdout)
    with server([]) as url:
        first_use_latency(url, args.first_use_repeats, sys.stdout)
        print(flush=True)
        load(url, args.rounds, args.concurrency, args.num_prompts, args.output_len, sys.stdout)
    print(f"\nload average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
