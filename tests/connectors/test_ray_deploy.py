"""Deploying replicas, without a cluster: the documented Serve configs build, and replicas that
cannot be placed are refused before Serve is asked."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from servelm.connectors import ray_deploy
from servelm.connectors.ray_cluster import RayClusterError
from servelm.connectors.ray_deploy import ReplicaPlan, build_app_from_args, check_fits
from servelm.engine.config import EngineConfig

DEPLOY_MD = Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md"


def _yaml_blocks() -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DEPLOY_MD.read_text(), flags=re.S)]


def _documented_serve_apps() -> list[tuple[str, dict]]:
    """(where, application) of each Serve application docs/DEPLOY.md shows: the Serve config, the RayService."""
    apps = []
    for block in _yaml_blocks():
        if not isinstance(block, dict):
            continue
        if "applications" in block:
            apps += [("serve config", a) for a in block["applications"]]
        if block.get("kind") == "RayService":
            apps += [("RayService", a) for a in yaml.safe_load(block["spec"]["serveConfigV2"])["applications"]]
    return apps


def test_deploy_md_shows_a_serve_config_and_a_rayservice():
    assert {where for where, _ in _documented_serve_apps()} == {"serve config", "RayService"}


@pytest.mark.parametrize("where, app", _documented_serve_apps(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_documented_serve_application_builds_what_it_says(where, app, monkeypatch):
    for name in [n for n in os.environ if n.startswith("SERVELM_")]:
        monkeypatch.delenv(name)
    module, _, func = app["import_path"].partition(":")
    assert (module, func) == ("servelm.connectors.ray_deploy", "build_app_from_args")
    args = app["args"]
    deployment = build_app_from_args(args)._bound_deployment
    assert deployment.ray_actor_options["num_cpus"] == args["replica_cpus"]
    auto = deployment._deployment_config.autoscaling_config
    if "min_replicas" in args:
        assert (auto.min_replicas, auto.max_replicas) == (args["min_replicas"], args["max_replicas"])
        assert auto.initial_replicas == args["replicas"]
    else:
        assert auto is None and deployment.num_replicas == args["replicas"]
    spec = deployment.init_args[0]
    assert spec["model"] == args["model"]
    if "embedding_model" in args:
        assert spec["embedding_model"] == args["embedding_model"]


def _plan(**kw) -> ReplicaPlan:
    return ReplicaPlan(
        app_name="t", model="m", embedding_model=None, served_model_name=None, engine=EngineConfig(), **kw
    )


@pytest.mark.parametrize(
    "nodes, plan, message",
    [
        (
            [1.0, 1.0],
            _plan(replicas=1, replica_cpus=4),
            "a replica needs 4 CPU but the largest node of the cluster has 1",
        ),
        (
            [4.0, 2.0],
            _plan(replicas=4, replica_cpus=2),
            "4 replicas of 2 CPU each do not fit on the cluster's nodes (4, 2 CPU): at most 3 fit",
        ),
        (
            [8.0],
            _plan(replicas=1, min_replicas=3, max_replicas=6, replica_cpus=4),
            "3 replicas of 4 CPU each do not fit",
        ),  # autoscaling starts at min_replicas
    ],
)
def test_replicas_the_nodes_cannot_hold_are_refused_naming_the_sizes(monkeypatch, nodes, plan, message):
    monkeypatch.setattr(ray_deploy, "node_resources", lambda resource: nodes if resource == "CPU" else [0.0])
    with pytest.raises(RayClusterError) as info:
        check_fits(plan)
    assert message in str(info.value)


def test_replicas_that_fit_exactly_are_deployed(monkeypatch):
    # Two on the 4-CPU node, one on the 2-CPU node.
    monkeypatch.setattr(ray_deploy, "node_resources", lambda resource: [4.0, 2.0] if resource == "CPU" else [0.0])
    check_fits(_plan(replicas=3, replica_cpus=2))


def test_a_gpu_replica_needs_a_node_with_a_gpu(monkeypatch):
    monkeypatch.setattr(ray_deploy, "node_resources", lambda resource: [16.0] if resource == "CPU" else [0.0])
    with pytest.raises(RayClusterError, match="a replica needs 1 GPU but the largest node of the cluster has 0"):
        check_fits(_plan(replicas=1, replica_gpus=1))
