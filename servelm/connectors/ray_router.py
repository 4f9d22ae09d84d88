"""Serve request router for engine replicas: load-aware, with prefix affinity.

Runs inside the front end's ``DeploymentHandle`` (Serve's request-router
API, ``RequestRouterConfig(request_router_class=...)``).

- Load: power of two choices. Two random replicas are offered and Serve
  sends the request to the one with fewer ongoing requests. A replica's
  ongoing requests are its open streams, that is the requests running or
  waiting in its engine, so this balances on running + waiting.
- Prefix affinity: the prompt's token ids are cut into blocks of the
  engine's block size and hashed cumulatively (block ``i``'s key covers
  blocks ``0..i``, as the engine's prefix cache does). The router remembers
  which replica last got each key; a request goes to the replica owning its
  longest known prefix, whose prefix cache most likely still holds it,
  unless that replica has ``imbalance`` more ongoing requests than the
  least loaded one (the load guard). Then it falls back to the two choices.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

# Blocks of a prompt the router keys on: prefixes longer than this share a key.
MAX_PREFIX_BLOCKS = 128
# Keys remembered (least recently used dropped first).
MAX_KEYS = 200_000


def prefix_keys(token_ids: list[int], block_size: int, max_blocks: int = MAX_PREFIX_BLOCKS) -> list[int]:
    """Cumulative hashes of the prompt's full blocks, shortest prefix first."""
    keys = []
    h = 0
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        h = hash((h, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        keys.append(h)
    return keys


class PrefixTable:
    """Which replica last served each prompt prefix (pure logic, tested without Ray)."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self.owner: OrderedDict[int, Any] = OrderedDict()

    def lookup(self, keys: list[int], alive: set[Any]) -> Any | None:
        """The replica holding the longest of ``keys`` among ``alive``, or None."""
        for key in reversed(keys):
            replica = self.owner.get(key)
            if replica is not None and replica in alive:
                self.owner.move_to_end(key)
                return replica
        return None

    def record(self, keys: list[int], replica: Any) -> None:
        for key in keys:
            self.owner[key] = replica
            self.owner.move_to_end(key)
        while len(self.owner) > self.max_keys:
            self.owner.popitem(last=False)

    def forget(self, replica: Any) -> None:
        for key in [k for k, r in self.owner.items() if r == replica]:
            del self.owner[key]


def request_prompt(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt token ids of a ``EngineReplica.generate`` call, if that is what is routed."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if isinstance(request, dict):
        prompt = request.get("prompt")
        if isinstance(prompt, list):
            return prompt
    return None


class PrefixAwareRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Power of two choices on ongoing requests, with prefix affinity under a load guard."""

    def initialize_state(self, prefix_routing: bool = True, block_size: int = 16, imbalance: int = 8, **kwargs: Any):
        self.prefix_routing = prefix_routing
        self.block_size = block_size
        self.imbalance = imbalance
        self.table = PrefixTable()
        self._keys: dict[str, list[int]] = {}  # internal request id -> its keys, until routed

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two = self._two_choices(candidate_replicas)
        if not self.prefix_routing:
            return [two]
        prompt = request_prompt(pending_request)
        if prompt is None:
            return [two]
        keys = prefix_keys(prompt, self.block_size)
        if pending_request is not None:
            self._keys[pending_request.metadata.internal_request_id] = keys
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner = self.table.lookup(keys, set(by_id))
        if owner is None or self._overloaded(owner, candidate_replicas):
            return [two]
        return [[by_id[owner]], two]

    def _two_choices(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        if len(replicas) <= 2:
            return random.sample(replicas, len(replicas))
        return random.sample(replicas, 2)

    def _load(self, replica_id: ReplicaID) -> int:
        # Serve's cache of each replica's ongoing requests (probed and
        # updated as requests are sent); unknown counts as idle.
        return self.replica_queue_len_cache.get(replica_id) or 0

    def _overloaded(self, owner: ReplicaID, replicas: list[RunningReplica]) -> bool:
        least = min(self._load(r.replica_id) for r in replicas)
        return self._load(owner) - least >= self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys = self._keys.pop(pending_request.metadata.internal_request_id, None)
        if keys:
            self.table.record(keys, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
