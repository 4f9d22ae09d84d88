"""The Ray connector: engine replicas of a Ray Serve deployment behind the Connector protocol.

The API layer talks to it exactly as to the local connector and never
imports Ray; this module imports Ray only when it is used (``servelm serve``
without ``--replicas``/``--ray-address`` never loads it).

- ``generate`` runs the request on a replica chosen by servelm's request
  router (``ray_router.py``), reads its outputs from that replica's channel
  to this front end, one item per engine step (``ray_channel.py``), and
  resumes the request on another replica when its replica dies
  (``ray_resume.py``).
- ``queue_depth``, ``engine_stats``, ``replicas`` and ``health`` read the
  deployment's figures that ``ray_stats.py`` keeps current; they never wait
  on Ray.
- Everything else (models, tokenize, templates, embeddings) is one call on
  any replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from servelm.connectors.base import ConnectorError, ModelCard, QueueDepth, ReplicaStatus
from servelm.connectors.ray_channel import Channels
from servelm.connectors.ray_replica import raise_error_item
from servelm.connectors.ray_resume import MAX_MIGRATIONS, resumable_stream
from servelm.connectors.ray_stats import StatsPoller
from servelm.engine.outputs import EmbeddingOutput, EngineStats, RequestOutput
from servelm.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How many times a non-streaming call is tried on another replica when its replica dies.
CALL_ATTEMPTS = MAX_MIGRATIONS + 1
# The longest the server waits at exit to delete its application from a joined cluster.
UNDEPLOY_TIMEOUT_S = 15.0


def is_replica_failure(exc: BaseException) -> bool:
    """True when ``exc`` means the replica (its actor, its node) is gone, not that the request failed."""
    from ray import exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        return False  # an exception raised by servelm's code in the replica
    return isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError, rex.RaySystemError, rex.ObjectLostError))


class RayConnector:
    """Serve a deployment of :class:`EngineReplica` through a ``DeploymentHandle``.

    Construction is cheap; :meth:`load` connects to (or starts) the
    cluster, deploys the replicas and waits until they run. Tests may pass
    an existing ``handle`` and ``board_reader`` instead and skip :meth:`load`.
    """

    def __init__(
        self,
        plan: Any = None,
        ray_address: str | None = None,
        *,
        handle: Any = None,
        board_reader: Callable[[], Any] | None = None,
        prefix_routing: bool | None = None,
    ):
        self.plan = plan
        # Whether the router may route this front end's requests by prompt prefix.
        self.prefix_routing = prefix_routing if prefix_routing is not None else (plan.prefix_routing if plan else True)
        self.ray_address = ray_address
        self.handle = handle
        self._board_reader = board_reader
        self._poller: StatsPoller | None = None
        self._models: list[ModelCard] | None = None
        self._load_error: str | None = None
        self._deployed = False
        self._cluster: Any = None
        self._streams: dict[str, Any] = {}  # request id -> its current replica stream
        # Attempts sent that have no output yet -> their sequences (see queue_depth).
        self._unstarted: dict[str, int] = {}
        self._channels = Channels(self._open_channel)

    # -- lifecycle -----------------------------------------------------

    def connect(self) -> None:
        """Start or join the Ray cluster (blocking). Raises RayClusterError (exit status 2)."""
        from servelm.connectors import ray_cluster

        self._cluster = ray_cluster.connect(self.ray_address)

    def load(self, progress: Callable[[str], None] | None = None) -> None:
        """Connect if needed, deploy the replicas and wait until they serve (blocking)."""
        say = progress or logger.info
        try:
            if self._cluster is None and self.handle is None:
                self.connect()
            if self.handle is None and self.plan.attach_if_running:
                from servelm.connectors import ray_deploy

                self.handle = ray_deploy.running_handle(self.plan)
                if self.handle is not None:
                    say(f"attaching to the running Serve application {self.plan.app_name!r}")
            if self.handle is None:
                from servelm.connectors import ray_deploy

                plan = self.plan
                cpus = f"{plan.replica_cpus:g} CPU" + (f", {plan.replica_gpus:g} GPU" if plan.replica_gpus else "")
                count = (
                    f"{plan.min_replicas or 1}-{plan.max_replicas or plan.replicas} replicas (autoscaling)"
                    if plan.autoscaling
                    else f"{plan.replicas} replica{'s' if plan.replicas != 1 else ''}"
                )
                where = (
                    "a local Ray cluster"
                    if self._cluster.started_here
                    else f"the Ray cluster at {self._cluster.address}"
                )
                say(f"deploying {count} of {cpus} each on {where}")
                self.handle = ray_deploy.deploy(plan, say=say)
                self._deployed = True
            if self._board_reader is None:
                self._board_reader = _board_reader(self.plan.stats_board, self.plan.namespace)
        except Exception as exc:
            self._load_error = f"could not start the replicas: {exc}"
            raise

    def shutdown(self) -> None:
        """Remove what :meth:`load` deployed and leave the cluster.

        A cluster started here stops with ``ray.shutdown()`` (its replicas
        with it); on a joined cluster the application is deleted first, for
        at most ``UNDEPLOY_TIMEOUT_S``, so a lost cluster cannot hold up the exit.
        """
        from servelm.connectors import ray_cluster

        if self._poller is not None:
            self._poller.cancel()
        self._channels.cancel()
        if self._deployed and not (self._cluster is not None and self._cluster.started_here):
            from servelm.connectors import ray_deploy

            thread = threading.Thread(target=self._undeploy, args=(ray_deploy,), daemon=True)
            thread.start()
            thread.join(UNDEPLOY_TIMEOUT_S)
        if self._cluster is not None:
            ray_cluster.disconnect(self._cluster)

    def _undeploy(self, ray_deploy: Any) -> None:
        try:
            ray_deploy.undeploy(self.plan)
        except Exception:
            logger.debug("undeploying failed", exc_info=True)

    # -- figures ---------------------------------------------------------

    def _stats(self):
        # The poller lives on the event loop of its first caller (the server's).
        if self._board_reader is None:
            return None
        if self._poller is None:
            self._poller = StatsPoller(self._board_reader)
            self._poller.start()
        return self._poller.stats

    async def refresh_stats(self):
        """Read the replicas' figures now (tests wait on state with this)."""
        if self._stats() is None:
            return None
        assert self._poller is not None
        return await self._poller.refresh()

    async def health(self) -> bool:
        stats = self._stats()
        return stats is not None and self.handle is not None and bool(stats.live())

    async def fatal_error(self) -> str | None:
        # Replicas that die are restarted by Serve; only a failed start is fatal.
        return self._load_error

    async def queue_depth(self) -> QueueDepth:
        """The live replicas' last reported figures, plus the requests sent from here since.

        The reports are up to about half a second old (``ray_stats.py``), so
        a request sent from here waits, as far as ``--max-waiting`` goes,
        until it has its first output or a report shows its replica's
        engine holding it; otherwise a burst would pass the limit whole.
        """
        stats = self._stats()
        depth = QueueDepth() if stats is None else stats.queue_depth()
        held = set() if stats is None else stats.request_ids()
        unseen = sum(n for attempt, n in self._unstarted.items() if attempt not in held)
        return QueueDepth(running=depth.running, waiting=depth.waiting + unseen)

    async def engine_stats(self) -> list[EngineStats]:
        stats = self._stats()
        return [] if stats is None else stats.engine_stats()

    async def replicas(self) -> list[ReplicaStatus]:
        stats = self._stats()
        return [] if stats is None else stats.replicas()

    # -- calls on any replica --------------------------------------------

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.handle is None:
            raise self._not_deployed()
        last: BaseException | None = None
        for _ in range(CALL_ATTEMPTS):
            response = self.handle.call.remote(method, *args, **kwargs)
            try:
                result = await response
            except asyncio.CancelledError:
                # The client left: Serve does not cancel the replica's call by itself. Cancelled
                # there, an embeddings request stops after the sub-batch it is running.
                response.cancel()
                raise
            except Exception as exc:
                if not is_replica_failure(exc):
                    raise
                last = exc
                continue
            raise_error_item(result)
            return result["ok"]
        raise ConnectorError(
            f"No engine replica answered: {last}", status=503, type="service_unavailable_error", code="replica_failed"
        )

    async def models(self) -> list[ModelCard]:
        if self._models is None:
            self._models = await self._call("models")
        return self._models

    async def embed(self, model: str, inputs: list[str] | list[list[int]]) -> list[EmbeddingOutput]:
        return await self._call("embed", model, inputs)

    async def tokenize(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._call("tokenize", model, text, add_special_tokens)

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        return await self._call("detokenize", model, token_ids)

    async def apply_chat_template(
        self,
        model: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
        **kwargs: Any,
    ) -> str:
        return await self._call(
            "apply_chat_template",
            model,
            messages,
            add_generation_prompt,
            chat_template,
            tools=tools,
            tool_call_parser=tool_call_parser,
            **kwargs,
        )

    # -- generation --------------------------------------------------------

    async def generate(
        self, model: str, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        # Counted before the first await, so the next request's admission sees it (queue_depth).
        self._unstarted[request_id] = params.best_of or 1
        try:
            # Unknown models fail here, before any replica is asked.
            cards = await self.models()
            if not any(c.id == model and c.kind == "generate" for c in cards):
                from servelm.connectors.base import ModelNotFound

                if any(c.id == model for c in cards):
                    raise ConnectorError(f"The model `{model}` does not support generation.", param="model")
                raise ModelNotFound(model)
            request = {
                "model": model,
                "request_id": request_id,
                "prompt": prompt,
                "params": params,
                "prefix_routing": self.prefix_routing,
            }
            stream = resumable_stream(request, lambda r: self._open(request_id, r), is_replica_failure)
            try:
                async for out in stream:
                    yield out
            finally:
                await stream.aclose()  # type: ignore[attr-defined]  # an async generator
        finally:
            self._unstarted.pop(request_id, None)

    def _not_deployed(self) -> ConnectorError:
        return ConnectorError(
            "The replicas are not deployed yet.",
            status=503,
            type="service_unavailable_error",
            code="model_not_ready",
        )

    def _open_channel(self, target: dict[str, Any]) -> Any:
        if self.handle is None:
            raise self._not_deployed()
        return self.handle.options(stream=True).channel.remote(target)

    async def _open(self, request_id: str, request: dict[str, Any]) -> AsyncIterator[Any]:
        """One attempt of a request: its outputs (as one-output lists) and error items, from its replica's channel."""
        if self.handle is None:
            raise self._not_deployed()
        attempt = request["request_id"]
        mailbox = self._channels.mailbox(attempt)
        response = self.handle.options(stream=True).generate.remote({**request, "channel": self._channels.id})
        self._streams[request_id] = response
        self._unstarted[attempt] = request["params"].best_of or 1  # a resumed attempt starts again
        watcher = asyncio.create_task(self._watch(attempt, response, mailbox))
        ended = False
        try:
            while True:
                item = await mailbox.get()
                self._unstarted.pop(attempt, None)
                if isinstance(item, BaseException):
                    raise item
                ended = isinstance(item, dict) or item.finished
                yield item if isinstance(item, dict) else [item]
                if ended:
                    return
        finally:
            self._unstarted.pop(attempt, None)
            watcher.cancel()
            self._channels.close(attempt)
            if self._streams.get(request_id) is response:
                del self._streams[request_id]
            if not ended:
                # The client left (or the replica failed): the replica's
                # generator is cancelled, and its engine aborts the request.
                response.cancel()

    async def _watch(self, attempt: str, response: Any, mailbox: asyncio.Queue) -> None:
        """Follow a request's own stream: where it runs, and whether its replica dies."""
        try:
            async for item in response:
                self._channels.placed(attempt, item["replica"])
        except Exception as exc:
            mailbox.put_nowait(exc)

    async def abort(self, model: str, request_id: str) -> None:
        response = self._streams.pop(request_id, None)
        if response is not None:
            response.cancel()


def _board_reader(name: str, namespace: str) -> Callable[[], Any]:
    """An async function returning the stats board's entries."""
    import ray

    board: list[Any] = []

    async def read() -> Any:
        if not board:
            board.append(ray.get_actor(name, namespace=namespace))
        try:
            return await board[0].get.remote()
        except Exception:
            board.clear()  # the board's node may have gone: look it up again next time
            raise

    return read
