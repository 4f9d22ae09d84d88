"""``servelm bench serve`` run for real against servelm's API app (fake connector) over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from servelm.cli import main

from .conftest import PacedFake

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench(*args: str) -> int:
    return main(["bench", "serve", *args])


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_two_levels_end_to_end(endpoint, serve_fake, tmp_path, capsys):
    fake = PacedFake(step_delay=0.002)
    url = serve_fake(fake)
    result_json, png = tmp_path / "result.json", tmp_path / "plot.png"
    code = bench(
        "--base-url",
        url + "/v1",
        "--endpoint",
        endpoint,
        "--num-prompts",
        "20",
        "--concurrency",
        "1,4",
        "--input-len",
        "32",
        "--output-len-range",
        "4:12",
        "--warmup",
        "2",
        "--seed",
        "3",
        "--goodput",
        "ttft:5000",
        "tpot:5000",
        "--result-json",
        str(result_json),
        "--save-detailed",
        "--plot",
        str(png),
        "--progress",
    )
    out, err = capsys.readouterr()
    assert code == 0, err

    # the server saw the warmup and both levels, each asking for ignore_eos and a fixed length
    assert fake.calls == 2 + 2 * 20
    assert all(params.ignore_eos and params.max_tokens in range(4, 13) for *_, params in fake.generate_calls)
    if endpoint == "completions":
        prompts = [tuple(prompt) for _, _, prompt, _ in fake.generate_calls]
        assert all(len(p) == 32 for p in prompts)
        assert len(set(prompts)) == len(prompts)  # every request a fresh prompt

    doc = json.loads(result_json.read_text())
    assert doc["benchmark"] == "servelm bench serve"
    assert doc["params"]["model"] == "fake-chat" and doc["params"]["endpoint"] == endpoint
    assert doc["params"]["num_prompts"] == 20 and doc["params"]["api_key"] is None
    assert doc["client_cpu"]["percent_of_one_core"] > 0 and doc["client_cpu"]["wall_s"] > 0
    assert [(lv["concurrency"], lv["request_rate"]) for lv in doc["levels"]] == [(1, None), (4, None)]
    for level in doc["levels"]:
        assert level["completed"] == 20 and level["failed"] == 0 and level["errors"] == {}
        for key in (
            "duration_s",
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "goodput",
            "client_cpu_percent",
        ):
            assert level[key] > 0, key
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(level[metric]) == {"count", "mean", "std", "median", "p90", "p99", "min", "max"}
            assert level[metric]["median"] > 0
        assert level["goodput"] == pytest.approx(level["request_throughput"])  # generous SLOs: all meet them
        requests = level["requests"]
        assert len(requests) == 20
        for r in requests:
            assert r["error"] is None
            assert r["output_tokens"] == r["output_len"]  # exactly the requested length
            assert 0 < r["ttft"] <= r["e2e"]
            assert len(r["itl"]) == r["output_tokens"] - 1  # the fake streams one token a chunk
            if endpoint == "completions":
                assert r["prompt_tokens"] == 32
            else:
                assert r["prompt_tokens"] > 32  # the chat template adds its own tokens
        assert level["total_output_tokens"] == sum(r["output_len"] for r in requests)
        assert level["ttft_ms"]["median"] <= level["e2el_ms"]["median"]

    assert png.read_bytes().startswith(PNG_SIGNATURE)
    table = out.splitlines()
    assert table[0].split()[:3] == ["level", "ok", "fail"]
    assert any(line.startswith("c=1 ") for line in table) and any(line.startswith("c=4 ") for line in table)
    assert "client CPU:" in out and "% of one core" in out
    assert "tokenizer the server's" in err  # prompts were built with /tokenize
    assert "c=4" in err and "req" in err  # the progress bar


def test_failures_are_counted_and_the_run_goes_on(serve_fake, tmp_path, capsys):
    fake = PacedFake(pattern=["ok", "429", "ok", "500", "stream"])
    url = serve_fake(fake)
    result_json = tmp_path / "r.json"
    code = bench(
        "--base-url",
        url,
        "--num-prompts",
        "20",
        "--concurrency",
        "4",
        "--output-len",
        "6",
        "--input-len",
        "8",
        "--result-json",
        str(result_json),
        "--no-progress",
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    level = json.loads(result_json.read_text())["levels"][0]
    assert (level["completed"], level["failed"]) == (8, 12)
    assert level["errors"] == {
        "HTTP 429: Too many requests, slow down.": 4,
        "HTTP 500: The server had an error while processing your request.": 4,
        "stream error: The engine failed the request: boom": 4,
    }
    assert level["total_output_tokens"] == 8 * 6
    assert "c=4: 4 failed: HTTP 429: Too many requests, slow down." in out


def test_every_request_failing_exits_1(serve_fake, capsys):
    url = serve_fake(PacedFake(pattern=["429"]))
    code = bench("--base-url", url, "--num-prompts", "3", "--output-len", "4", "--input-len", "4", "--no-progress")
    out, err = capsys.readouterr()
    assert code == 1
    assert "c=1: 3 failed: HTTP 429" in out and "every request failed" in err


def test_unreachable_server_exits_1(capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    assert bench("--base-url", url, "--num-prompts", "2", "--no-progress") == 1
    assert "cannot reach" in capsys.readouterr().err
    # with the model named, the requests themselves fail and are counted
    assert bench("--base-url", url, "--model", "m", "--num-prompts", "2", "--output-len", "2", "--no-progress") == 1
    out = capsys.readouterr().out
    assert "c=1: 2 failed: connection error: ClientConnectorError: Cannot connect to host 127.0.0.1" in out


def test_prompt_file_chat_at_a_request_rate_with_a_cap(serve_fake, tmp_path, capsys):
    fake = PacedFake()
    url = serve_fake(fake)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a planet."}\n{"prompt": "What is 2+2?"}\nWrite a haiku.\n')
    code = bench(
        "--base-url",
        url,
        "--endpoint",
        "chat",
        "--prompt-file",
        str(prompts),
        "--num-prompts",
        "6",
        "--request-rate",
        "200",
        "--concurrency",
        "2",
        "--output-len",
        "5",
        "--no-progress",
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert any(line.startswith("r=200,c=2 ") for line in out.splitlines())
    sent = [call["messages"] for call in fake.template_calls]
    for text in ("Name a planet.", "What is 2+2?", "Write a haiku."):
        # the file's prompts in turn, wrapping around, each as the one user message
        assert sent.count([{"role": "user", "content": text}]) == 2


def test_api_key_from_the_environment(serve_fake, monkeypatch, capsys):
    url = serve_fake(PacedFake(), api_keys=["sk-bench"])
    args = (
        "--base-url",
        url,
        "--model",
        "fake-chat",
        "--num-prompts",
        "2",
        "--output-len",
        "3",
        "--input-len",
        "4",
        "--no-progress",
    )
    assert bench(*args) == 1  # no key: every request is refused
    assert "HTTP 401" in capsys.readouterr().out
    monkeypatch.setenv("OPENAI_API_KEY", "sk-bench")
    assert bench(*args) == 0
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    monkeypatch.setenv("SERVELM_API_KEYS", "sk-bench,other")  # SERVELM_API_KEYS comes first
    assert bench(*args) == 0


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--base-url",
        "--endpoint",
        "--concurrency",
        "--request-rate",
        "--goodput",
        "--result-json",
        "--plot",
        "--warmup",
    ):
        assert flag in out
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert "bench" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--goodput", "itl:5"], "--goodput"),
        (["--output-len-range", "9:4"], "--output-len-range"),
        (["--output-len", "4", "--output-len-range", "1:2"], "not allowed with"),
        (["--concurrency", "0"], "--concurrency"),
        (["--request-rate", "fast"], "--request-rate"),
        (["--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file"),
        (["--prompt-file", __file__, "--input-len", "8"], "--input-len"),
        (["--base-url", "127.0.0.1:8000"], "--base-url"),
        (["--extra-body", "{oops"], "--extra-body"),
        (["--extra-body", "[1]"], "--extra-body"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_arguments_exit_2(args, message, capsys):
    argv = ["bench", "serve", *args] if args else ["bench"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr("servelm.benchmark.report.plot_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench("--plot", "x.png")
    assert exc.value.code == 2
    assert "pip install 'servelm[bench]'" in capsys.readouterr().err


def test_bench_imports_no_torch_or_matplotlib():
    port = closed_port()
    code = (
        "import sys\n"
        "from servelm.cli import main\n"
        f"rc = main(['bench', 'serve', '--base-url', 'http://127.0.0.1:{port}', '--model', 'm', '--num-prompts', '2', '--no-progress'])\n"
        "assert rc == 1, rc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_an_unwritable_result_file_is_reported(serve_fake, tmp_path, capsys):
    url = serve_fake(PacedFake())
    code = bench(
        "--base-url",
        url,
        "--num-prompts",
        "2",
        "--output-len",
        "3",
        "--input-len",
        "4",
        "--no-progress",
        "--result-json",
        str(tmp_path / "missing-dir" / "r.json"),
    )
    out, err = capsys.readouterr()
    assert code == 1
    assert "c=1 " in out  # the table is printed all the same
    assert "could not write the results" in err
