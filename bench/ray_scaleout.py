"""Scale-out on Ray Serve: overhead, scaling and prefix-aware routing, measured end to end.

Three experiments, each a pair of server configurations run in turn
(``--rounds`` times, interleaved, so a machine whose load drifts hurts both
sides alike); the figures are medians over rounds and the ratio B/A:

- ``overhead``: the in-process engine (A) against one replica on Ray (B,
  ``--replicas 1``) at c=1 and c=32: ITL p50 and output throughput.
- ``scaling``: one replica of ``--cpus`` cores (A; the server's ``--replica-cpus``) against N replicas
  of as many cores each (B, ``--replicas N``), c=32 on the chat endpoint:
  output throughput. On a machine with 2N cores or more use
  ``--replicas-b N``; each replica's threads follow its cores.
- ``prefix``: two replicas with ``--no-prefix-routing`` (A) against
  ``--prefix-routing`` (B) on 8 shared system prompts x 8 users: prefix-cache
  hit rate (from /metrics) and TTFT p50.

Servers run on 127.0.0.1 as subprocesses, started and stopped here by PID.

    .venv/bin/python bench/ray_scaleout.py --experiments overhead,scaling,prefix --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from serving import MODEL, bench_serve, median, ratio, server


def overhead(rounds: int, cpus: int, output_len: int, out) -> None:
    rows: dict[tuple[str, int], dict[str, list]] = {}
    env = {"OMP_NUM_THREADS": str(cpus)}
    for r in range(rounds):
        for name, args in (("in-process", []), ("1 replica on Ray", ["--replicas", "1", "--replica-cpus", str(cpus)])):
            with server(args, env) as url:
                for c, n in ((1, 4), (32, 32)):
                    level = bench_serve(url, c, n, output_len, "completions")
                    row = rows.setdefault((name, c), {"itl": [], "tput": []})
                    row["itl"].append(level["itl_ms"]["median"])
                    row["tput"].append(level["output_throughput"])
                    print(
                        f"round {r} {name} c={c}: ITL p50 {level['itl_ms']['median']:.1f} ms, "
                        f"{level['output_throughput']:.1f} tok/s",
                        file=out,
                        flush=True,
                    )
    print(
        "\n| c | ITL p50 in-process (ms) | ITL p50 on Ray (ms) | ratio | tok/s in-process | tok/s on Ray | ratio |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|", file=out)
    for c in (1, 32):
        a, b = rows[("in-process", c)], rows[("1 replica on Ray", c)]
        ia, ib, ta, tb = median(a["itl"]), median(b["itl"]), median(a["tput"]), median(b["tput"])
        print(f"| {c} | {ia:.1f} | {ib:.1f} | {ratio(ib, ia)} | {ta:.1f} | {tb:.1f} | {ratio(tb, ta)} |", file=out)


def scaling(rounds: int, cpus: int, replicas_b: int, output_len: int, out) -> None:
    tput: dict[str, list[float]] = {}
    configs = (
        ("1 replica", ["--replicas", "1", "--replica-cpus", str(cpus)]),
        (f"{replicas_b} replicas", ["--replicas", str(replicas_b), "--replica-cpus", str(cpus)]),
    )
    for r in range(rounds):
        for name, args in configs:
            with server(args) as url:
                level = bench_serve(url, 32, 32, output_len, "chat")
                tput.setdefault(name, []).append(level["output_throughput"])
                print(f"round {r} {name}: {level['output_throughput']:.1f} tok/s", file=out, flush=True)
    a, b = median(tput[configs[0][0]]), median(tput[configs[1][0]])
    print(f"\n| {cpus} core(s) per replica, c=32 chat | 1 replica | {replicas_b} replicas | ratio |", file=out)
    print("|---|---|---|---|", file=out)
    print(f"| output tok/s (median of {rounds}) | {a:.1f} | {b:.1f} | {ratio(b, a)} |", file=out)


def _system_prompt(i: int) -> str:
    rules = " ".join(
        f"Rule {k}: always answer questions about topic {k * 7 + i} politely and briefly." for k in range(20)
    )
    return f"You are assistant number {i}. {rules}"


def _prefix_counts(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if "replica" not in s.labels and s.name in (
                "servelm:prefix_cache_queries_total",
                "servelm:prefix_cache_hits_total",
            ):
                values[s.name] = s.value
    return values.get("servelm:prefix_cache_queries_total", 0.0), values.get("servelm:prefix_cache_hits_total", 0.0)


def _shared_prefix_run(url: str, concurrency: int) -> tuple[float, float]:
    """8 system prompts x 8 users; returns (hit rate, TTFT p50 ms)."""
    q0, h0 = _prefix_counts(url)
    rng = random.Random(17)  # shuffled rounds: see tests/ray_serve/test_ray_serve.py
    jobs = [(i, j) for j in range(8) for i in rng.sample(range(8), 8)]

    def one(job):
        i, j = job
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "messages": [
                {"role": "system", "content": _system_prompt(i)},
                {"role": "user", "content": f"User {j} asks: what is {j} + {i}?"},
            ],
        }
        start = time.perf_counter()
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    return (time.perf_counter() - start) * 1000
        return None

    with ThreadPoolExecutor(concurrency) as pool:
        ttfts = [t for t in pool.map(one, jobs) if t is not None]
    time.sleep(1.0)  # the replicas report every 0.25 s
    q1, h1 = _prefix_counts(url)
    return (h1 - h0) / max(q1 - q0, 1.0), statistics.median(ttfts)


def prefix(rounds: int, cpus: int, kv: str, out) -> None:
    results: dict[str, list[tuple[float, float]]] = {}
    configs = (("load only", ["--no-prefix-routing"]), ("prefix-aware", ["--prefix-routing"]))
    for r in range(rounds):
        for name, flag in configs:
            with server(["--replicas", "2", "--replica-cpus", str(cpus), "--kv-cache-memory", kv, *flag]) as url:
                rate, ttft = _shared_prefix_run(url, 4)
                results.setdefault(name, []).append((rate, ttft))
                print(f"round {r} {name}: hit rate {rate:.3f}, TTFT p50 {ttft:.0f} ms", file=out, flush=True)
    print("\n| 2 replicas, 8 system prompts x 8 users, c=4 | load only | prefix-aware | ratio |", file=out)
    print("|---|---|---|---|", file=out)
    ra, rb = (median([x[0] for x in results[n]]) for n, _ in configs)
    ta, tb = (median([x[1] for x in results[n]]) for n, _ in configs)
    print(f"| prefix-cache hit rate | {ra:.3f} | {rb:.3f} | {ratio(rb, ra)} |", file=out)
    print(f"| TTFT p50 (ms) | {ta:.0f} | {tb:.0f} | {ratio(tb, ta)} |", file=out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", default="overhead,scaling,prefix")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=1, help="cores per replica for scaling and prefix (default: 1)")
    p.add_argument(
        "--overhead-cpus",
        type=int,
        default=os.cpu_count() or 1,
        help="cores of the engine in the overhead pair (default: all)",
    )
    p.add_argument("--replicas-b", type=int, default=2, help="replicas of the scaling experiment's B side")
    p.add_argument(
        "--kv-cache-memory", default="64MiB", help="per replica in the prefix experiment (small, so eviction matters)"
    )
    p.add_argument("--output-len", type=int, default=32, help="tokens per request in overhead and scaling")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores; load average before: {os.getloadavg()}", flush=True)
    for name in args.experiments.split(","):
        print(f"\n== {name} ==", flush=True)
        if name == "overhead":
            overhead(args.rounds, args.overhead_cpus, args.output_len, sys.stdout)
        elif name == "scaling":
            scaling(args.rounds, args.cpus, args.replicas_b, args.output_len, sys.stdout)
        elif name == "prefix":
            prefix(args.rounds, args.cpus, args.kv_cache_memory, sys.stdout)
    print(f"\nload average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
