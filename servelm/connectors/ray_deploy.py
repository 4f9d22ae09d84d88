"""Building and deploying the Serve application of engine replicas from the settings.

One deployment, ``EngineReplica``, with ``num_replicas`` (or Serve's
autoscaling on ongoing requests per replica between min and max replicas),
``num_cpus``/``num_gpus`` per replica, and servelm's request router
(``ray_router.py``). The replicas push their figures to a named
:class:`StatsBoard` actor created here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

from servelm.connectors.ray_cluster import RayClusterError, node_resources
from servelm.engine.config import EngineConfig

DEPLOYMENT_NAME = "EngineReplica"
# Serve health-checks each replica this often; a dead one is restarted.
HEALTH_CHECK_PERIOD_S = 2.0
# How long deploying may take before the server gives up with the status message.
DEPLOY_TIMEOUT_S = 600.0
# Serve's own message when a replica waits for resources this long (its default is 30 s).
PLACEMENT_WAIT_S = 30.0
# Room for the front ends' channels (one per front end and replica) beside the requests.
CHANNEL_CALLS = 64


@dataclass
class ReplicaPlan:
    """What to deploy: the engine of each replica, how many, and where they fit."""

    app_name: str
    model: str | None
    embedding_model: str | None
    served_model_name: str | None
    engine: EngineConfig
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    prefix_routing: bool = True
    max_ongoing_requests: int = 256
    namespace: str = "servelm"
    # No replica count was given: use the application if it already runs.
    attach_if_running: bool = False

    @property
    def stats_board(self) -> str:
        return f"{self.app_name}-stats"

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def spec(self) -> dict[str, Any]:
        """The replica's constructor argument: plain data that pickles anywhere."""
        return {
            "model": self.model,
            "embedding_model": self.embedding_model,
            "served_model_name": self.served_model_name,
            "engine": asdict(self.engine),
            "stats_board": self.stats_board,
            "namespace": self.namespace,
            # Intra-op threads: the whole CPUs reserved (a GPU replica's CPU share is left to torch).
            "threads": int(self.replica_cpus) if self.replica_cpus >= 1 and self.replica_gpus == 0 else None,
        }

    def autoscaling_config(self) -> dict[str, Any] | None:
        if not self.autoscaling:
            return None
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
        return {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": min(max(self.replicas, low), high),
            "target_ongoing_requests": self.target_ongoing_requests,
        }


def max_ongoing_requests(max_num_seqs: int, max_waiting: int | None) -> int:
    """Serve calls one replica takes at once: more than the requests it may ever hold.

    Every request the cluster admits could be on one replica (``max_num_seqs``
    running, ``max_waiting`` queued), and each front end's channel there is a
    call too (``CHANNEL_CALLS``). Below that, Serve would queue a front end's
    channel behind the very requests whose outputs it must carry.
    """
    return max(max_num_seqs * 4, max_num_seqs + (max_waiting or 0)) + CHANNEL_CALLS


def plan_from_settings(settings: Any) -> ReplicaPlan:
    """The :class:`ReplicaPlan` of ``servelm serve``'s settings."""
    return ReplicaPlan(
        app_name=settings.ray_app_name,
        model=settings.model,
        embedding_model=settings.embedding_model,
        served_model_name=settings.served_model_name,
        engine=settings.engine_config(),
        replicas=settings.replicas or 1,
        min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas,
        target_ongoing_requests=settings.target_ongoing_requests,
        replica_cpus=settings.replica_cpus,
        replica_gpus=settings.replica_gpus,
        prefix_routing=settings.prefix_routing,
        max_ongoing_requests=max_ongoing_requests(settings.max_num_seqs, settings.max_waiting),
        attach_if_running=settings.replicas is None and settings.min_replicas is None and settings.max_replicas is None,
    )


def build_app(plan: ReplicaPlan):
    """The Serve application (a bound deployment) for ``plan``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from servelm.connectors.ray_replica import EngineReplica

    router = "servelm.connectors.ray_router.PrefixAwareRouter"
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {
            "num_cpus": plan.replica_cpus,
            "num_gpus": plan.replica_gpus,
            # A Ray worker has threads before it imports servelm, too late for servelm/platform/arena.py's
            # limit; glibc reads this one at the process's start.
            "runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "1"}},
        },
        "max_ongoing_requests": plan.max_ongoing_requests,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "request_router_config": RequestRouterConfig(
            request_router_class=router,  # type: ignore[arg-type]  # a dotted path is accepted too
            request_router_kwargs={"prefix_routing": plan.prefix_routing, "block_size": plan.engine.block_size},
        ),
    }
    autoscaling = plan.autoscaling_config()
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = plan.replicas
    deployment = serve.deployment(EngineReplica)
    return deployment.options(**options).bind(plan.spec())  # type: ignore[attr-defined]


def check_fits(plan: ReplicaPlan) -> None:
    """Refuse at once replicas the cluster's nodes cannot hold (Serve would wait for them forever)."""
    wanted = plan.replicas if not plan.autoscaling else (plan.autoscaling_config() or {})["initial_replicas"]
    for resource, need in (("CPU", plan.replica_cpus), ("GPU", plan.replica_gpus)):
        if need <= 0:
            continue
        sizes = node_resources(resource)
        if max(sizes, default=0.0) < need:
            raise RayClusterError(
                f"a replica needs {need:g} {resource} but the largest node of the cluster has "
                f"{max(sizes, default=0.0):g}: lower --replica-{resource.lower()}s or add nodes"
            )
        fit = sum(int(size // need + 1e-9) for size in sizes)
        if fit < wanted:
            raise RayClusterError(
                f"{wanted} replicas of {need:g} {resource} each do not fit on the cluster's nodes "
                f"({', '.join(f'{s:g}' for s in sizes)} {resource}): at most {fit} fit; lower --replicas or "
                f"--replica-{resource.lower()}s, or add nodes"
            )


def deploy(plan: ReplicaPlan, say=print, timeout_s: float = DEPLOY_TIMEOUT_S):
    """Deploy ``plan`` and wait until every initial replica runs; returns the deployment's handle.

    Replicas that cannot be placed raise :class:`RayClusterError` with
    Serve's own explanation (resources wanted and available) once Serve
    reports them stuck, rather than waiting forever.
    """
    from ray import serve
    from ray.serve.api import RunTarget

    from servelm.connectors.ray_stats import stats_board

    check_fits(plan)
    stats_board(plan.stats_board, plan.namespace)
    serve.start(proxy_location="Disabled")
    serve.run_many(
        [RunTarget(build_app(plan), name=plan.app_name, route_prefix=None)],
        wait_for_applications_running=False,
    )
    deadline = time.monotonic() + timeout_s
    shown = ""
    while True:
        app = serve.status().applications.get(plan.app_name)
        status = str(app.status.value) if app is not None else "NOT_STARTED"
        if status == "RUNNING":
            break
        message = _status_message(app)
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RayClusterError(f"the replicas could not start: {message or status}")
        if "taken more than" in message and "scheduled" in message:
            raise RayClusterError(f"the replicas cannot be placed on the cluster: {message}")
        if message and message != shown:
            say(f"deploying: {message}")
            shown = message
        if time.monotonic() > deadline:
            raise RayClusterError(f"the replicas were not running after {timeout_s:.0f} s: {message or status}")
        time.sleep(0.5)
    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=plan.app_name)


def running_handle(plan: ReplicaPlan):
    """The handle of ``plan``'s application if it already runs on the cluster (``serve deploy``,
    a KubeRay RayService, another servelm front end), else None."""
    from ray import serve

    try:
        app = serve.status().applications.get(plan.app_name)
    except Exception:
        return None
    if app is None or str(app.status.value) != "RUNNING" or DEPLOYMENT_NAME not in app.deployments:
        return None
    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=plan.app_name)


def build_app_from_args(args: dict[str, Any]):
    """Serve application builder: ``import_path: servelm.connectors.ray_deploy:build_app_from_args``.

    ``args`` are servelm settings (``model``, ``replicas``, ``replica_cpus``,
    ``min_replicas``, ``kv_cache_memory``, ...; the keys of servelm.yaml), so
    a Serve config file or a KubeRay RayService deploys the same replicas
    ``servelm serve --replicas`` would. A front end then attaches with
    ``servelm serve --ray-address HOST:PORT`` (docs/DEPLOY.md).
    """
    from servelm.settings import Settings

    return build_app(plan_from_settings(Settings(**args)))


def _status_message(app) -> str:
    if app is None:
        return ""
    parts = [app.message] if app.message else []
    for d in app.deployments.values():
        if d.message:
            parts.append(d.message)
    return " ".join(parts)


def undeploy(plan: ReplicaPlan) -> None:
    """Delete the application and its stats board (what :func:`deploy` made)."""
    import ray
    from ray import serve

    try:
        serve.delete(plan.app_name)
    finally:
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(plan.stats_board, namespace=plan.namespace))
