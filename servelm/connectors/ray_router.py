"""Serve request router for engine replicas: load-aware, with prefix affinity.

Runs inside the front end's ``DeploymentHandle`` (Serve's request-router
API, ``RequestRouterConfig(request_router_class=...)``).

- Load: power of two choices. Two random replicas are offered and Serve
  sends the request to the one with fewer ongoing requests. A replica's
  ongoing requests are its open streams, that is the requests running or
  waiting in its engine, so this balances on running + waiting.
- Channels: a front end's channel call (``EngineReplica.channel``) names
  the replica it must reach, and goes there.
- Prefix affinity: the prompt's token ids are cut into blocks of the
  engine's block size and hashed cumulatively (block ``i``'s key covers
  blocks ``0..i``, as the engine's prefix cache does). The router remembers
  which replica last got each key; a request goes to the replica owning its
  longest known prefix, whose prefix cache most likely still holds it,
  unless that replica has ``imbalance`` more ongoing requests than the
  least loaded one (the load guard). Then it falls back to the two choices.
  A shared prefix shorter than ``min_prefix_blocks`` (a chat template's
  default system prompt) earns no affinity: recomputing it costs less than
  piling every request onto one replica. A long prefix seen for the first
  time goes to the replica caching the fewest prefix blocks, load
  permitting, so the shared prompts spread evenly over the caches.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

# Blocks of a prompt the router keys on: prefixes longer than this share a key.
MAX_PREFIX_BLOCKS = 128
# Keys remembered (least recently used dropped first).
MAX_KEYS = 200_000
# Requests chosen for but not yet routed whose keys are kept.
MAX_PENDING = 10_000


def prefix_keys(token_ids: list[int], block_size: int, max_blocks: int = MAX_PREFIX_BLOCKS) -> list[int]:
    """Cumulative hashes of the prompt's full blocks, shortest prefix first."""
    keys = []
    h = 0
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        h = hash((h, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        keys.append(h)
    return keys


class PrefixTable:
    """Which replica last served each prompt prefix (pure logic, tested without Ray).

    ``blocks[replica]`` counts the prefix blocks a replica owns: a measure of
    how much of the shared prompts it caches, to give new prefixes to the
    replica with the least.
    """

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self.owner: OrderedDict[int, Any] = OrderedDict()
        self.blocks: Counter[Any] = Counter()

    def lookup(self, keys: list[int], alive: set[Any], min_blocks: int = 1) -> Any | None:
        """The replica holding the longest of ``keys`` among ``alive``, if that prefix has at least
        ``min_blocks`` blocks; else None."""
        for n in range(len(keys), min_blocks - 1, -1):
            if n == 0:
                break
            replica = self.owner.get(keys[n - 1])
            if replica is not None and replica in alive:
                self.owner.move_to_end(keys[n - 1])
                return replica
        return None

    def record(self, keys: list[int], replica: Any) -> None:
        for key in keys:
            old = self.owner.get(key)
            if old != replica:
                if old is not None:
                    self.blocks[old] -= 1
                self.blocks[replica] += 1
            self.owner[key] = replica
            self.owner.move_to_end(key)
        while len(self.owner) > self.max_keys:
            _, old = self.owner.popitem(last=False)
            self.blocks[old] -= 1

    def forget(self, replica: Any) -> None:
        for key in [k for k, r in self.owner.items() if r == replica]:
            del self.owner[key]
        self.blocks.pop(replica, None)


def _call_argument(pending_request: PendingRequest | None) -> dict[str, Any] | None:
    """The dict a replica call is made with (its first argument), if it has one."""
    if pending_request is None or not pending_request.args:
        return None
    argument = pending_request.args[0]
    return argument if isinstance(argument, dict) else None


def pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica an ``EngineReplica.channel`` call must reach (its ``pin``), if that is what is routed."""
    target = _call_argument(pending_request)
    return None if target is None else target.get("pin")


def routed_request(pending_request: PendingRequest | None) -> dict[str, Any] | None:
    """The request dict of an ``EngineReplica.generate`` call, if that is what is routed."""
    request = _call_argument(pending_request)
    return request if request is not None and isinstance(request.get("prompt"), list) else None


class PrefixAwareRouter(RequestRouter):
    """Power of two choices on ongoing requests, with prefix affinity under a load guard.

    Without Serve's ``FIFOMixin`` on purpose: that mixin hands a replica
    chosen for one request to the oldest waiting request, which would send a
    request to the replica chosen for another's prefix. Each request here
    gets the replica chosen for it.
    """

    def initialize_state(
        self,
        prefix_routing: bool = True,
        block_size: int = 16,
        imbalance: int = 8,
        min_prefix_blocks: int = 4,
        **kwargs: Any,
    ):
        self.prefix_routing = prefix_routing
        self.block_size = block_size
        self.imbalance = imbalance
        self.min_prefix_blocks = min_prefix_blocks
        self.table = PrefixTable()
        self._keys: dict[str, list[int]] = {}  # internal request id -> its keys, until routed

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pin = pinned_replica(pending_request)
        if pin is not None:
            # A front end's channel from one replica: that replica or, while
            # it is not (yet, or any longer) a candidate, none.
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        two = self._two_choices(candidate_replicas)
        request = routed_request(pending_request)
        if request is None:
            return [two]
        assert pending_request is not None
        # The front end may decide per request (a benchmark compares both on
        # one deployment); requests routed on load alone teach the table nothing.
        if not request.get("prefix_routing", self.prefix_routing):
            return [two]
        keys = prefix_keys(request["prompt"], self.block_size)
        self._keys[pending_request.metadata.internal_request_id] = keys
        while len(self._keys) > MAX_PENDING:  # requests cancelled before they were routed
            self._keys.pop(next(iter(self._keys)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner = self.table.lookup(keys, set(by_id), self.min_prefix_blocks)
        if owner is not None:
            if self._overloaded(owner, candidate_replicas):
                return [two]
            return [[by_id[owner]], two]
        if len(keys) < self.min_prefix_blocks:
            return [two]
        # A new long prefix goes to the replica caching the fewest prefix
        # blocks (among those not overloaded), so the shared prompts spread
        # evenly over the replicas' caches. Recorded now, not once routed,
        # so that concurrent first requests of other prefixes spread too.
        least = min(self._load(r.replica_id) for r in candidate_replicas)
        eligible = [r for r in candidate_replicas if self._load(r.replica_id) - least < self.imbalance]
        target = min(
            eligible, key=lambda r: (self.table.blocks[r.replica_id], self._load(r.replica_id), random.random())
        )
        self.table.record(keys, target.replica_id)
        return [[target], two]

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
