"""bench/compare_table.py: the markdown table of several servers' ``--result-json`` files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark.bench_scripts import bench_script

compare_table = bench_script("compare_table")


def _dist(median: float) -> dict:
    return {"count": 10, "mean": median * 1.1, "median": median, "p90": median * 2, "p99": median * 3}


def _level(concurrency: int, tok_s: float, itl: float, ttft: float, failed: int = 0) -> dict:
    return {
        "concurrency": concurrency,
        "request_rate": None,
        "completed": 16 - failed,
        "failed": failed,
        "output_throughput": tok_s,
        "ttft_ms": _dist(ttft),
        "itl_ms": _dist(itl),
        "tpot_ms": _dist(itl),
        "e2el_ms": _dist(ttft + 63 * itl),
    }


def _write(folder: Path, name: str, levels: list[dict]) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"benchmark": "servelm bench serve", "params": {}, "levels": levels}))
    return path


def _rows(table: str) -> dict[str, list[str]]:
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")
    ]
    return {row[0]: row[1:] for row in rows}


def test_table_has_a_row_per_server_and_ratios_to_servelm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "vllm-cpu", [_level(1, 50.0, 20.0, 30.0), _level(8, 200.0, 40.0, 90.0)])
    _write(tmp_path, "servelm", [_level(1, 100.0, 10.0, 15.0), _level(8, 300.0, 25.0, 60.0)])

    assert compare_table.main([str(tmp_path)]) == 0
    rows = _rows(capsys.readouterr().out)

    header = rows["server"]
    assert header[:3] == ["c=1 tok/s", "c=1 ITL p50 ms", "c=1 TTFT p50 ms"]
    assert header[-2:] == ["servelm/server c=1", "servelm/server c=8"]
    assert list(rows)[2] == "servelm"  # the reference row comes first, after the header and rule
    assert rows["servelm"] == ["100.0", "10.0", "15.0", "300.0", "25.0", "60.0", "1.00x", "1.00x"]
    assert rows["vllm-cpu"] == ["50.0", "20.0", "30.0", "200.0", "40.0", "90.0", "2.00x", "1.50x"]


def test_missing_levels_metrics_and_bad_files_show_as_dashes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servelm = _write(tmp_path, "servelm", [_level(1, 100.0, 10.0, 15.0), _level(32, 400.0, 50.0, 80.0)])
    partial = _level(1, 80.0, 12.0, 14.0, failed=2)
    del partial["itl_ms"]
    partial["ttft_ms"] = {"p50": 14.0}  # the other spelling of the median
    dead = {**_level(32, 0.0, 0.0, 0.0), "completed": 0, "failed": 16}
    peer = _write(tmp_path, "llama-server", [partial, dead])
    junk = tmp_path / "notes.json"
    junk.write_text("[1, 2, 3]")

    assert compare_table.main([str(servelm), str(peer), str(junk)]) == 0
    out = capsys.readouterr()
    rows = _rows(out.out)
    assert rows["llama-server"] == ["80.0 (2 failed)", "-", "14.0", "- (16 failed)", "0.0", "0.0", "1.25x", "-"]
    assert "notes.json" in out.err


def test_without_the_reference_there_are_no_ratio_columns(tmp_path: Path) -> None:
    results = {"vllm-cpu": {1: _level(1, 50.0, 20.0, 30.0)}}
    table = compare_table.make_table(results)
    assert "servelm/server" not in table
    assert "no 'servelm' results" in table


def test_no_results_is_an_error(tmp_path: Path) -> None:
    assert compare_table.main([str(tmp_path)]) == 1


# A model small enough to cost by hand: per layer q, k, v, o are 4x4 (16 weights
# each) and gate, up, down 4x8 (32 each): 160 matmul weights; the LM head 10x4 = 40.
TINY_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_size": 4,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 8,
    "vocab_size": 10,
    "tie_word_embeddings": True,
}
LIMITS = {
    "cpu": "Test CPU",
    "threads": 2,
    "bf16_gemm_flops": 6.4e9,
    "bf16_gemm_how": "F.linear bf16 8x8x8",
    "int8_gemm_ops": 3.2e10,
    "int8_gemm_how": "torch._int_mm 8x8x8",
    "read_bytes_per_s": 4e9,
    "read_how": "sum",
}


def _tiny_level(tpot_ms: float) -> dict:
    # Two requests of 3 prompt and 2 output tokens in 1 us. Each request feeds 3 + 2 - 1 = 4
    # tokens through the layer (2 * 160 * 4 = 1280 FLOPs), makes 2 logit rows (2 * 40 * 2 =
    # 160) and attends over 1 + 2 + 3 + 4 = 10 keys at 2 * 2 * 4 = 16 FLOPs each (160):
    # 1600 FLOPs, 3200 for both, so 3.2 GFLOP/s: 50% of 6.4 GFLOP/s, 10% of 32 GOP/s.
    level = _level(1, 2e6, 0.1, 0.5)
    level.update(completed=2, failed=0, duration_s=1e-6, total_input_tokens=6, total_output_tokens=4)
    level["tpot_ms"] = _dist(tpot_ms)
    return level


def _write_meta(folder: Path, memory: dict[str, dict]) -> None:
    meta = folder / "meta"
    meta.mkdir()
    (meta / "limits.json").write_text(json.dumps(LIMITS))
    (meta / "model-config.json").write_text(json.dumps(TINY_CONFIG))
    for name, doc in memory.items():
        (meta / f"memory-{name}.json").write_text(json.dumps(doc))


def _tables(out: str) -> list[dict[str, list[str]]]:
    """Each markdown table of the output: {first cell: other cells}, the header row under "server"."""
    tables, current = [], None
    for line in out.splitlines():
        if line.startswith("|"):
            if current is None:
                current = {}
                tables.append(current)
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            current[cells[0] if cells[0] == "server" or not current.get("server") else " ".join(cells[:3])] = cells
        else:
            current = None
    return tables


def test_limits_table_puts_each_level_against_the_machines_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A decoding step reads the 200 weights and one sequence's K/V at context 3 + 2/2 = 4
    # (1 layer x K and V x 4 dims x 2 bytes = 16 bytes a token): 400 + 64 = 464 bytes in
    # bfloat16, 200 + 64 = 264 in int8. Over a TPOT of 0.464 us: 1.0 GB/s, 25% of 4 GB/s.
    _write(tmp_path, "servelm", [_tiny_level(tpot_ms=0.000464)])
    _write(tmp_path, "servelm-int8", [_tiny_level(tpot_ms=0.000264)])
    _write_meta(tmp_path, {})

    assert compare_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    _, limits = _tables(out)
    assert limits["server"] == [
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
    assert limits["servelm bf16 1"] == [
        "servelm",
        "bf16",
        "1",
        "2000000.0",
        "0.5",
        "0.1",
        "3.2",
        "50.0%",
        "10.0%",
        "1.0",
        "25.0%",
    ]
    assert limits["servelm-int8 int8 1"][6:] == ["3.2", "50.0%", "10.0%", "1.0", "25.0%"]
    assert "bf16 GEMM 6.4 GFLOP/s (F.linear bf16 8x8x8)" in out
    assert "int8 GEMM 32.0 GOP/s (torch._int_mm 8x8x8)" in out
    assert "memory read 4.0 GB/s (sum)" in out
    assert "1 layers, hidden 4, 1 heads / 1 KV heads of 4, MLP 8, vocabulary 10" in out


def test_memory_table_gives_idle_and_loaded_memory_beside_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, "servelm", [_level(1, 100.0, 10.0, 15.0), _level(32, 400.0, 50.0, 80.0)])
    _write(tmp_path, "vllm-cpu", [_level(1, 50.0, 20.0, 30.0), _level(32, 300.0, 60.0, 90.0)])
    _write(tmp_path, "llama-server", [_level(1, 60.0, 20.0, 30.0)])
    mib = 2**20
    _write_meta(
        tmp_path,
        {
            "servelm": {
                "idle": {"rss_median": 2048 * mib, "pss_median": 1900 * mib, "processes_max": 1},
                "load": {"rss_max": 2500 * mib, "pss_max": 2400 * mib, "processes_max": 1},
            },
            # RSS counts the pages vLLM's two processes share twice; PSS once.
            "vllm-cpu": {
                "idle": {"rss_median": 6000 * mib, "pss_median": 5000 * mib, "processes_max": 2},
                "load": {"rss_max": 6100 * mib, "pss_max": None, "processes_max": 3},
            },
        },
    )

    assert compare_table.main([str(tmp_path)]) == 0
    tables = _tables(capsys.readouterr().out)
    memory = tables[-1]
    assert memory["server"] == [
        "server",
        "RSS idle MiB",
        "PSS idle MiB",
        "RSS load max MiB",
        "PSS load max MiB",
        "processes",
        "c=32 tok/s",
    ]
    rows = {cells[0]: cells[1:] for key, cells in memory.items() if key != "server"}
    assert rows["servelm"] == ["2048", "1900", "2500", "2400", "1", "400.0"]
    assert rows["vllm-cpu"] == ["6000", "5000", "6100", "-", "3", "300.0"]
    assert "llama-server" not in rows  # no memory file, no row


def test_without_meta_there_is_only_the_throughput_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "servelm", [_level(1, 100.0, 10.0, 15.0)])

    assert compare_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert len(_tables(out)) == 1
    assert "no table against the machine's limits" in out


@pytest.mark.parametrize(
    ("server", "weights"),
    [
        ("servelm", "bf16"),
        ("servelm-bf16", "bf16"),
        ("servelm-fp32", "fp32"),
        ("servelm-int8", "int8"),
        ("servelm-w8a8", "w8a8"),
        ("servelm-w8a8-kv8", "w8a8"),
        ("servelm-bf16-kv8", "bf16"),
        ("vllm-cpu", "bf16"),
        ("llama-server", "f16"),
        ("llama-server-q8_0", "q8_0"),
        ("transformers-serve", "bf16"),
    ],
)
def test_weight_format_follows_compare_sh_labels(server: str, weights: str) -> None:
    assert compare_table.weight_format(server) == weights
