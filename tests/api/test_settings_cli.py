"""Settings precedence and validation, the CLI's parsing, `servelm chat`."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from servelm import chat_client, cli, server
from servelm.engine.config import EngineConfig
from servelm.settings import Settings, parse_memory

REPO = Path(__file__).resolve().parents[2]


def load(argv: list[str]) -> Settings:
    parser = cli.build_parser()
    args = parser.parse_args(cli._normalise_argv(argv))
    return cli.settings_from_args(args, args.command_parser)


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        load(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "servelm.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def test_defaults():
    s = load([])
    assert (s.model, s.embedding_model, s.host, s.port) == (
        "smollm2-135m-instruct",
        "all-minilm-l6-v2",
        "127.0.0.1",
        8000,
    )
    assert s.api_keys == [] and s.cors_origins == [] and s.metrics_require_auth is False
    assert s.engine_config() == EngineConfig()


def test_defaults_match_the_model_registry():
    from servelm.models.registry import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL

    assert Settings().model == DEFAULT_MODEL
    assert Settings().embedding_model == DEFAULT_EMBEDDING_MODEL


def test_precedence_file_env_flags(tmp_path, monkeypatch):
    config = write(tmp_path, {"port": 1000, "max_num_seqs": 3, "model": "from-file", "host": "0.0.0.0"})
    monkeypatch.setenv("SERVELM_PORT", "2000")
    monkeypatch.setenv("SERVELM_MODEL", "from-env")
    s = load(["serve", "--config", config, "--port", "3000"])
    assert s.port == 3000  # flag beats env and file
    assert s.model == "from-env"  # env beats file
    assert s.max_num_seqs == 3 and s.host == "0.0.0.0"  # file beats defaults


def test_config_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELM_CONFIG", write(tmp_path, {"port": 1234}))
    assert load([]).port == 1234


def test_lists_from_every_source(tmp_path, monkeypatch):
    assert load(["--api-key", "a", "--api-key", "b"]).api_keys == ["a", "b"]
    assert load(
        ["--config", write(tmp_path, {"api_keys": ["f"], "cors_origins": "http://a, http://b"})]
    ).cors_origins == [
        "http://a",
        "http://b",
    ]
    monkeypatch.setenv("SERVELM_API_KEYS", "k1, k2")
    assert load([]).api_keys == ["k1", "k2"]


def test_engine_flags_build_the_engine_config(tmp_path):
    s = load(
        [
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "0.25",
            "--block-size",
            "32",
            "--no-prefix-caching",
            "--seed",
            "7",
            "--no-cuda-graphs",
        ]
    )
    assert s.engine_config() == EngineConfig(
        dtype="float32",
        device="cpu",
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        kv_cache_memory=0.25,
        enable_prefix_caching=False,
        seed=7,
        cuda_graphs=False,
    )


def test_speculative_flags_build_the_engine_config():
    s = load(
        [
            "--speculative-method",
            "draft",
            "--speculative-model",
            "smollm2-135m-instruct",
            "--num-speculative-tokens",
            "6",
            "--speculative-ngram-min",
            "2",
            "--speculative-ngram-max",
            "3",
            "--speculative-max-batch-size",
            "8",
        ]
    )
    config = s.engine_config()
    assert (config.speculative_method, config.speculative_model, config.num_speculative_tokens) == (
        "draft",
        "smollm2-135m-instruct",
        6,
    )
    assert (config.speculative_ngram_min, config.speculative_ngram_max, config.speculative_max_batch_size) == (2, 3, 8)
    assert load(["--speculative-method", "ngram", "--speculative-model", "none"]).engine_config().speculative


def test_embedding_model_none():
    assert load(["--embedding-model", "none"]).embedding_model is None


def test_chat_template_must_exist(tmp_path, capsys):
    err = fails(["--chat-template", str(tmp_path / "missing.jinja")], capsys)
    assert "chat_template" in err
    template = tmp_path / "t.jinja"
    template.write_text("{{ x }}")
    assert load(["--chat-template", str(template)]).read_chat_template() == "{{ x }}"


@pytest.mark.parametrize(
    "value,expected",
    [
        ("0.5", 0.5),
        ("1073741824", 1073741824),
        ("4GiB", 4 << 30),
        ("512MB", 512 * 10**6),
        ("2k", 2000),
        (0.5, 0.5),
        (1, 1),
    ],
)
def test_parse_memory(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--port", "abc"], "port"),
        (["--port", "70000"], "port"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--block-size", "3"], "block_size"),
        (["--kv-cache-memory", "1.5"], "kv_cache_memory"),
        (["--kv-cache-memory", "lots"], "kv_cache_memory"),
        (["--device", "tpu"], "device"),
        (["--max-body-bytes", "-1"], "max_body_bytes"),
        (["--dtype", "int4"], "dtype"),
        (["--speculative-method", "medusa"], "--speculative-method"),
        (["--speculative-method", "draft"], "speculative_model"),
        (["--speculative-method", "ngram", "--speculative-model", "x"], "speculative_model"),
        (["--num-speculative-tokens", "0"], "num_speculative_tokens"),
        (["--speculative-ngram-min", "3", "--speculative-ngram-max", "2"], "speculative_ngram_min"),
        (["--speculative-max-batch-size", "0"], "speculative_max_batch_size"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flag_exits_2_naming_it(argv, name, capsys):
    assert name in fails(argv, capsys)


def test_bad_env_value_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("SERVELM_MAX_NUM_SEQS", "many")
    err = fails([], capsys)
    assert "max_num_seqs" in err and "SERVELM_MAX_NUM_SEQS" in err


def test_unknown_env_var_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("SERVELM_MAX_NUM_SEQ", "4")
    assert "SERVELM_MAX_NUM_SEQ" in fails([], capsys)


def test_unknown_file_key_exits_2(tmp_path, capsys):
    assert "max_seqs" in fails(["--config", write(tmp_path, {"max_seqs": 4})], capsys)


def test_bad_file_value_exits_2(tmp_path, capsys):
    assert "port" in fails(["--config", write(tmp_path, {"port": "high"})], capsys)


@pytest.mark.parametrize("content", ["- a\n- b\n", "port: [1,\n", 42])
def test_malformed_file_exits_2(tmp_path, content, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(str(content))
    assert "c.yaml" in fails(["--config", str(path)], capsys)


def test_missing_file_exits_2(tmp_path, capsys):
    assert "nope.yaml" in fails(["--config", str(tmp_path / "nope.yaml")], capsys)


def test_example_config_documents_every_setting():
    path = REPO / "servelm.yaml"
    text = path.read_text()
    for name in Settings.model_fields:
        if name != "config":
            assert f"\n{name}:" in text or f"\n# {name}:" in text, f"servelm.yaml does not document {name}"
    example = Settings(config=path)
    defaults = Settings()
    for name in Settings.model_fields:
        if name != "config":
            assert getattr(example, name) == getattr(defaults, name), name


def test_help_lists_every_setting():
    parser = cli.build_parser()
    serve_help = parser.parse_args(["serve"]).command_parser.format_help()
    for name, field in Settings.model_fields.items():
        flag = cli.flag_of(name)
        if flag is None:  # set through other flags (rate_limits) or the config file
            continue
        assert flag.replace("[no-]", "") in serve_help, f"--help lacks {flag}"
        # The help shows the setting's one description.
        assert " ".join(field.description.split()[:4]) in " ".join(serve_help.split()), name


def test_serve_rejects_a_missing_model_before_loading(tmp_path):
    out = io.StringIO()
    rc = server.serve(Settings(model=str(tmp_path / "missing.gguf"), embedding_model=None), out=out)
    assert rc == 2
    assert "--model" in out.getvalue()


def test_serve_rejects_a_port_in_use_before_starting_anything(tmp_path, monkeypatch):
    import servelm.connectors.local as local

    started = []
    monkeypatch.setattr(local, "LocalConnector", lambda *a, **k: started.append(a))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = io.StringIO()
        rc = server.serve(Settings(model=str(model), embedding_model=None, port=port), out=out)
    assert rc == 2
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in out.getvalue()
    assert started == []  # no engine (and no Ray cluster) was started for a server that cannot listen


def test_python_dash_m_entry_point():
    run = [sys.executable, "-m", "servelm"]
    help_ = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert help_.returncode == 0 and "--kv-cache-memory" in help_.stdout
    bad = subprocess.run([*run, "--port", "abc"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "port" in bad.stderr


def test_chat_cli(fake, live_server):
    inputs = iter(["hello", "", "again", "/reset", "fresh", "/quit"])
    out = io.StringIO()
    rc = chat_client.run_chat(live_server + "/v1", system="be nice", input_fn=lambda prompt: next(inputs), out=out)
    assert rc == 0
    assert out.getvalue().count("Hello world") == 3
    calls = [c["messages"] for c in fake.template_calls]
    assert calls[0] == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]
    assert calls[1] == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hello world"},
        {"role": "user", "content": "again"},
    ]
    assert calls[2] == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "fresh"}]


def test_chat_cli_eof_and_errors(fake, live_server):
    def eof(prompt: str) -> str:
        raise EOFError

    out = io.StringIO()
    assert chat_client.run_chat(live_server, model="nope", input_fn=eof, out=out) == 0
    inputs = iter(["hi"])

    def once(prompt: str) -> str:
        try:
            return next(inputs)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    assert chat_client.run_chat(live_server, model="nope", input_fn=once, out=out) == 0
    assert "error: The model `nope` does not exist." in out.getvalue()


def test_chat_cli_unreachable():
    out = io.StringIO()
    assert chat_client.run_chat("http://127.0.0.1:9", input_fn=lambda p: "/quit", out=out) == 1
    assert "cannot reach" in out.getvalue()


def test_chat_cli_with_auth(fake):
    from .conftest import ThreadedServer, make_app

    with ThreadedServer(make_app(fake, api_keys=["sekrit"])) as url:
        out = io.StringIO()
        assert chat_client.run_chat(url, input_fn=lambda p: "/quit", out=out) == 1
        assert "API key" in out.getvalue()
        out = io.StringIO()
        inputs = iter(["hi", "/quit"])
        assert chat_client.run_chat(url, api_key="sekrit", input_fn=lambda p: next(inputs), out=out) == 0
        assert "Hello world" in out.getvalue()


def test_serve_listens_while_loading_then_drains_on_sigterm(tmp_path, monkeypatch):
    """The whole `serve` path with the engine replaced by the fake: 503 while loading, ready line, drain, exit 0."""
    import signal
    import threading

    import httpx

    import servelm.connectors.local as local

    from .fake_connector import FakeConnector

    events: list[str] = []
    loaded = threading.Event()

    class FakeLocal(FakeConnector):
        def __init__(self, model, embedding_model, engine_config, served_model_name=None):
            super().__init__(healthy=False)
            events.append(f"init {engine_config.max_num_seqs}")

        def load(self, progress=None):
            progress("loading fake weights")
            assert loaded.wait(timeout=120)  # safety nets: these waits end on events
            self.healthy = True

        def shutdown(self):
            events.append("shutdown")

    class SigtermServer(server.ServelmServer):
        def __init__(self, app, settings, on_ready=None, sock=None):
            self.listening = threading.Event()

            def ready(url: str) -> None:
                on_ready(url)
                self.listening.set()

            super().__init__(app, settings, on_ready=ready, sock=sock)

        def run(self):
            # uvicorn blocks: serve it in a thread, probe it while the fake
            # loads and once it has, then send it SIGTERM's handler.
            codes: list[int] = []
            thread = threading.Thread(target=lambda: codes.append(super(SigtermServer, self).run()))
            thread.start()
            assert self.listening.wait(timeout=120)
            for probe in ("/health", "/ready"):
                events.append(f"{probe} {httpx.get(self.url + probe).status_code}")
            loaded.set()
            deadline = time.monotonic() + 120
            while httpx.get(self.url + "/ready").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            events.append("ready 200")
            self.server.handle_exit(signal.SIGTERM, None)
            thread.join(timeout=120)
            return codes[0]

    monkeypatch.setattr(local, "LocalConnector", FakeLocal)
    monkeypatch.setattr(server, "ServelmServer", SigtermServer)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    out = io.StringIO()
    rc = server.serve(
        Settings(model=str(model), embedding_model=None, port=0, max_num_seqs=5, log_level="warning"), out=out
    )
    assert rc == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("servelm: loading ")
    assert lines[1] == "servelm: loading fake weights"
    assert lines[2].startswith("servelm: ready: http://127.0.0.1:") and lines[2].endswith("/v1)")
    assert events == ["init 5", "/health 503", "/ready 503", "ready 200", "shutdown"]


def test_serve_exits_1_when_the_load_fails(tmp_path, monkeypatch):
    import servelm.connectors.local as local

    from .fake_connector import FakeConnector

    events: list[str] = []

    class Broken(FakeConnector):
        def __init__(self, *args, **kwargs):
            super().__init__(healthy=False)

        def load(self, progress=None):
            self.fatal = "could not load the models: weights are corrupt"
            raise RuntimeError("weights are corrupt")

        def shutdown(self):
            events.append("shutdown")

    monkeypatch.setattr(local, "LocalConnector", Broken)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    out = io.StringIO()
    settings = Settings(model=str(model), embedding_model=None, port=0, log_level="critical")
    assert server.serve(settings, out=out) == 1
    assert "could not load the models: weights are corrupt" in out.getvalue()
    assert "ready:" not in out.getvalue()
    assert events == ["shutdown"]


def test_config_file_and_deploy_table_are_made_from_the_settings():
    """servelm.yaml and docs/DEPLOY.md's settings table are what the settings model's descriptions make."""
    from servelm import settings_doc

    assert settings_doc.YAML_PATH.read_text() == settings_doc.render_yaml(), (
        "run python -m servelm.settings_doc --write"
    )
    doc = settings_doc.DEPLOY_PATH.read_text()
    assert doc == settings_doc.deploy_doc_with_table(doc), "run python -m servelm.settings_doc --write"
    table = settings_doc.render_table()
    for name in Settings.model_fields:
        if name != "config":
            assert f"| `{name}` (`SERVELM_{name.upper()}`)" in table
    assert settings_doc.main([]) == 0


def test_settings_doc_check_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    from servelm import settings_doc

    stale = tmp_path / "servelm.yaml"
    stale.write_text(settings_doc.render_yaml().replace("max_num_seqs: 64", "max_num_seqs: 65"))
    monkeypatch.setattr(settings_doc, "YAML_PATH", stale)
    monkeypatch.setattr(settings_doc, "REPO", tmp_path.parent)
    deploy = tmp_path / "DEPLOY.md"
    deploy.write_text(settings_doc.deploy_doc_with_table(settings_doc.DEPLOY_PATH.read_text()))
    monkeypatch.setattr(settings_doc, "DEPLOY_PATH", deploy)
    assert settings_doc.main([]) == 1
    assert "servelm.yaml is out of date" in capsys.readouterr().err
    assert settings_doc.main(["--write"]) == 0
    assert stale.read_text() == settings_doc.render_yaml()
