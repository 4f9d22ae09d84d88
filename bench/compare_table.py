"""Markdown tables from the ``servelm bench serve --result-json`` files of several servers.

The first table has a row per server (named by file stem: ``servelm.json`` ->
servelm), columns output throughput, ITL p50 and TTFT p50 at each
concurrency, then servelm's output throughput divided by the row's (above 1:
servelm is faster)::

    python bench/compare_table.py RESULTS_DIR            # every *.json in it, and RESULTS_DIR/meta/
    python bench/compare_table.py a.json b.json --reference servelm --meta RESULTS_DIR/meta

When the meta folder (``RESULTS_DIR/meta``, as bench/compare.sh writes it) has
the machine's limits (``limits.json``, from bench/machine_limits.py) and the
model's ``config.json`` (``model-config.json``), a second table puts every
server and level against those limits: achieved FLOP/s (bench/model_cost.py's
FLOPs of the level's requests over its wall time) as a fraction of the
bfloat16 and of the int8 GEMM peak, and decoding bytes/s (one step's weights
and K/V over the median TPOT) as a fraction of the memory read bandwidth,
beside output tok/s, TTFT and ITL. With ``memory-<server>.json`` files (from
bench/process_memory.py) a third table gives each server's resident memory
idle and under load beside its throughput.

A missing level, metric or file shows as "-"; a file that is not a result is
named on stderr and skipped. The JSON keys read are all in the block below, to
adjust in one place if the result format changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_cost import ModelCost, decode_bytes_per_second, flops_per_second

# --- the result JSON's layout -------------------------------------------------
LEVELS_KEY = "levels"  # top level: a list of per-level objects
CONCURRENCY_KEY = "concurrency"  # per level: the number of requests in flight
THROUGHPUT_KEY = "output_throughput"  # per level: output tokens/s
ITL_KEY = "itl_ms"  # per level: {"mean", "median"/"p50", "p90", "p99", ...} in ms
TTFT_KEY = "ttft_ms"
TPOT_KEY = "tpot_ms"
DURATION_KEY = "duration_s"  # per level: wall time, first request sent to last one finished
INPUT_TOKENS_KEY = "total_input_tokens"  # per level: prompt tokens of the completed requests (servers' usage)
OUTPUT_TOKENS_KEY = "total_output_tokens"
P50_KEYS = ("p50", "median")  # the first present is the median
COMPLETED_KEY = "completed"
FAILED_KEY = "failed"
# --- the meta folder (bench/compare.sh) ------------------------------------------
LIMITS_FILE = "limits.json"  # bench/machine_limits.py --json
MODEL_CONFIG_FILE = "model-config.json"  # the served model's config.json
MEMORY_PREFIX = "memory-"  # memory-<server>.json: bench/process_memory.py, phases "idle" and "load"
# -------------------------------------------------------------------------------

DEFAULT_REFERENCE = "servelm"


def load_result(path: Path) -> dict[int, dict[str, Any]] | None:
    """{concurrency: level object} of one result file; None if it is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"skipping {path}: {exc}", file=sys.stderr)
        return None
    levels = doc.get(LEVELS_KEY) if isinstance(doc, dict) else None
    if not isinstance(levels, list):
        print(f"skipping {path}: no {LEVELS_KEY!r} list", file=sys.stderr)
        return None
    by_concurrency: dict[int, dict[str, Any]] = {}
    for level in levels:
        if isinstance(level, dict) and isinstance(level.get(CONCURRENCY_KEY), int):
            by_concurrency[level[CONCURRENCY_KEY]] = level
    return by_concurrency


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def throughput(level: dict[str, Any] | None) -> float | None:
    """Output tokens/s of a level; None when missing, or when no request completed."""
    if level is None:
        return None
    if level.get(COMPLETED_KEY) == 0:
        return None
    return _number(level.get(THROUGHPUT_KEY))


def p50(level: dict[str, Any] | None, key: str) -> float | None:
    """The median of the distribution ``key`` of a level, in ms."""
    dist = level.get(key) if level else None
    if not isinstance(dist, dict):
        return None
    for name in P50_KEYS:
        if name in dist:
            return _number(dist[name])
    return None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _failures(level: dict[str, Any] | None) -> str:
    failed = level.get(FAILED_KEY) if level else None
    return f" ({failed} failed)" if isinstance(failed, int) and failed > 0 else ""


def make_table(results: dict[str, dict[int, dict[str, Any]]], reference: str = DEFAULT_REFERENCE) -> str:
    """The markdown table; ``results`` maps a server's name to {concurrency: level}, in row order."""
    concurrencies = sorted({c for levels in results.values() for c in levels})
    header = ["server"]
    for c in concurrencies:
        header += [f"c={c} tok/s", f"c={c} ITL p50 ms", f"c={c} TTFT p50 ms"]
    ref = results.get(reference)
    if ref is not None:
        header += [f"{reference}/server c={c}" for c in concurrencies]
    rows = [header, ["---"] + ["---:"] * (len(header) - 1)]
    for name, levels in results.items():
        row = [name]
        for c in concurrencies:
            level = levels.get(c)
            row += [_fmt(throughput(level)) + _failures(level), _fmt(p50(level, ITL_KEY)), _fmt(p50(level, TTFT_KEY))]
        if ref is not None:
            for c in concurrencies:
                mine, theirs = throughput(ref.get(c)), throughput(levels.get(c))
                row.append("-" if mine is None or not theirs else f"{mine / theirs:.2f}x")
        rows.append(row)
    table = _markdown(rows)
    if ref is None:
        table += f"\n\n(no {reference!r} results: no ratio columns)"
    return table


def _markdown(rows: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


KV_INT8_SUFFIX = "-kv8"  # servelm:bf16-kv8, servelm:w8a8-kv8: --kv-cache-dtype int8


def weight_format(server: str) -> str:
    """The weight format a server's row stands for, from its name (see bench/compare.sh's labels).

    ``servelm`` alone runs ``--dtype auto``: bfloat16 on CPUs with fast
    bfloat16 matmuls, which is what it is counted as.
    """
    server = server.removesuffix(KV_INT8_SUFFIX)
    for suffix in ("q8_0", "int8", "w8a8", "fp32"):
        if server.endswith(suffix):
            return suffix
    return "f16" if server.startswith("llama-server") else "bf16"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"skipping {path}: {exc}", file=sys.stderr)
        return None


@dataclass
class Meta:
    """What bench/compare.sh records beside the results: the limits, the model, each server's memory."""

    limits: dict[str, Any] | None = None
    model: ModelCost | None = None
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)


def load_meta(folder: Path) -> Meta:
    """The meta folder's files that are there; missing ones stay None (their table is left out)."""
    meta = Meta()
    if (folder / LIMITS_FILE).is_file():
        meta.limits = _read_json(folder / LIMITS_FILE)
    if (folder / MODEL_CONFIG_FILE).is_file():
        config = _read_json(folder / MODEL_CONFIG_FILE)
        meta.model = ModelCost.from_hf_config(config) if isinstance(config, dict) else None
    for path in sorted(folder.glob(f"{MEMORY_PREFIX}*.json")):
        doc = _read_json(path)
        if isinstance(doc, dict):
            meta.memory[path.stem[len(MEMORY_PREFIX) :]] = doc
    return meta


def _fraction(value: float | None, limit: Any) -> str:
    limit = _number(limit)
    return "-" if value is None or not limit else f"{100 * value / limit:.1f}%"


def _giga(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


def level_rates(
    cost: ModelCost, level: dict[str, Any], weights: str, kv_int8: bool = False
) -> tuple[float | None, float | None]:
    """(achieved FLOP/s, decoding bytes/s) of one level; None where the level lacks what it needs."""
    completed = level.get(COMPLETED_KEY)
    duration = _number(level.get(DURATION_KEY))
    prompt, output = _number(level.get(INPUT_TOKENS_KEY)), _number(level.get(OUTPUT_TOKENS_KEY))
    if not isinstance(completed, int) or completed <= 0 or duration is None or prompt is None or output is None:
        return None, None
    flops = flops_per_second(cost, completed, int(prompt), int(output), duration)
    tpot = p50(level, TPOT_KEY)
    concurrency = level.get(CONCURRENCY_KEY)
    batch = min(concurrency, completed) if isinstance(concurrency, int) else 1
    step_bytes = None
    if tpot is not None:
        step_bytes = decode_bytes_per_second(
            cost, batch, prompt / completed, output / completed, tpot / 1000, weights, kv_int8
        )
    return flops, step_bytes


def limits_header(limits: dict[str, Any], cost: ModelCost) -> str:
    """The limits and the model the second table is measured against, in two lines."""

    def rate(limit: str, key: str, unit: str) -> str:
        return f"{_giga(_number(limits.get(key)))} {unit} ({limits.get(f'{limit}_how') or '-'})"

    machine = (
        f"Machine limits ({limits.get('cpu', '?')}, {limits.get('threads', '?')} threads): "
        f"bf16 GEMM {rate('bf16_gemm', 'bf16_gemm_flops', 'GFLOP/s')}, "
        f"int8 GEMM {rate('int8_gemm', 'int8_gemm_ops', 'GOP/s')}, "
        f"memory read {rate('read', 'read_bytes_per_s', 'GB/s')}."
    )
    model = (
        f"Model: {cost.layers} layers, hidden {cost.hidden}, {cost.heads} heads / {cost.kv_heads} KV heads of "
        f"{cost.head_dim}, MLP {cost.intermediate}, vocabulary {cost.vocab}: {cost.params / 1e6:.1f}M parameters, "
        f"{cost.body_params / 1e6:.1f}M in the layers' matmuls + {cost.head_params / 1e6:.1f}M LM head; "
        f"{cost.kv_bytes_per_token / 1024:.1f} KiB of K/V per token."
    )
    return machine + "\n" + model


def limits_table(results: dict[str, dict[int, dict[str, Any]]], limits: dict[str, Any], cost: ModelCost) -> str:
    """A row per server and level: tok/s, TTFT, ITL, then FLOP/s and bytes/s against the machine's limits."""
    header = [
        "server",
        "weights",
        "c",
        "out tok/s",
        "TTFT p50 ms",
        "ITL p50 ms",
        "GFLOP/s",
        "of bf16 peak",
        "of int8 peak",
        "decode GB/s",
        "of read BW",
    ]
    rows = [header, ["---", "---"] + ["---:"] * (len(header) - 2)]
    for name, levels in results.items():
        weights = weight_format(name)
        for c in sorted(levels):
            level = levels[c]
            flops, step_bytes = level_rates(cost, level, weights, name.endswith(KV_INT8_SUFFIX))
            rows.append(
                [
                    name,
                    weights,
                    str(c),
                    _fmt(throughput(level)) + _failures(level),
                    _fmt(p50(level, TTFT_KEY)),
                    _fmt(p50(level, ITL_KEY)),
                    _giga(flops),
                    _fraction(flops, limits.get("bf16_gemm_flops")),
                    _fraction(flops, limits.get("int8_gemm_ops")),
                    _giga(step_bytes),
                    _fraction(step_bytes, limits.get("read_bytes_per_s")),
                ]
            )
    return limits_header(limits, cost) + "\n\n" + _markdown(rows)


def memory_table(results: dict[str, dict[int, dict[str, Any]]], memory: dict[str, dict[str, Any]]) -> str:
    """A row per server with memory figures: RSS and PSS of its process tree idle and under load, beside its throughput."""
    top = max((c for levels in results.values() for c in levels), default=None)
    header = [
        "server",
        "RSS idle MiB",
        "PSS idle MiB",
        "RSS load max MiB",
        "PSS load max MiB",
        "processes",
        f"c={top} tok/s",
    ]
    rows = [header, ["---"] + ["---:"] * (len(header) - 1)]
    for name, levels in results.items():
        doc = memory.get(name)
        if doc is None:
            continue
        idle, load = doc.get("idle") or {}, doc.get("load") or {}
        processes = (load or idle).get("processes_max", "-")
        rows.append(
            [
                name,
                _mib(idle.get("rss_median")),
                _mib(idle.get("pss_median")),
                _mib(load.get("rss_max")),
                _mib(load.get("pss_max")),
                str(processes),
                _fmt(throughput(levels.get(top))),
            ]
        )
    return _markdown(rows)


def _mib(value: Any) -> str:
    value = _number(value)
    return "-" if value is None else f"{value / 2**20:.0f}"


def collect(paths: list[Path]) -> dict[str, dict[int, dict[str, Any]]]:
    """{name: levels} of the given files and of every *.json in the given folders, in order."""
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for file in files:
        levels = load_result(file)
        if levels is not None:
            results[file.stem] = levels
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="result JSON files, or folders of them")
    ap.add_argument(
        "--reference", default=DEFAULT_REFERENCE, help="the row the ratios divide by (default: %(default)s)"
    )
    ap.add_argument(
        "--meta",
        type=Path,
        help="the folder of limits, model config and memory files (default: meta/ in the first folder given)",
    )
    args = ap.parse_args(argv)
    results = collect(args.paths)
    if not results:
        print("no result files", file=sys.stderr)
        return 1
    # The reference row first, the others in the order given.
    if args.reference in results:
        results = {args.reference: results[args.reference], **{k: v for k, v in results.items() if k != args.reference}}
    print(make_table(results, args.reference))
    folder = args.meta or next((p / "meta" for p in args.paths if p.is_dir()), None)
    meta = load_meta(folder) if folder is not None else Meta()
    if meta.limits is not None and meta.model is not None:
        print("\n" + limits_table(results, meta.limits, meta.model))
    else:
        print(
            f"\n(no {LIMITS_FILE} and {MODEL_CONFIG_FILE} in {folder or 'a meta folder'}: no table against the machine's limits)"
        )
    if meta.memory:
        print("\n" + memory_table(results, meta.memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
