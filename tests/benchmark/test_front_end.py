"""bench/front_end.py runs servelm's server over its instant connector and reports each level."""

from __future__ import annotations

import re
import subprocess
import sys

from benchmark.bench_scripts import BENCH


def test_the_front_end_bench_reports_throughput_and_cpu_per_token_at_each_level():
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH / "front_end.py"),
            "--concurrency",
            "1,4",
            # 8192 tokens a level: ~0.3 s of the server's CPU here, well above /proc's 10 ms resolution
            # (a level of 128 tokens can read 0 ticks).
            "--num-prompts",
            "64",
            "--output-len",
            "128",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    rows = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"^\s+(c=\d+)\s+([\d.]+)\s+([\d.]+)", out, re.M)}
    assert set(rows) == {"c=1", "c=4"}
    for tok_s, cpu_ms in rows.values():
        assert tok_s > 0 and cpu_ms > 0
