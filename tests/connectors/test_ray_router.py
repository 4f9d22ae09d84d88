"""The request router's choices, without Serve: prefix affinity, its load guard, and plain two choices.

``PrefixAwareRouter.choose_replicas`` returns ranked groups of replicas;
Serve tries the first group first. Replicas and Serve's cache of their
ongoing requests are stand-ins here; the router's own state is real.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

from servelm.connectors.ray_router import PrefixAwareRouter

BLOCK = 16
IDS = itertools.count()


class Loads(dict):
    """Serve's ``replica_queue_len_cache``: ongoing requests per replica id."""


def router(**state) -> tuple[PrefixAwareRouter, Loads]:
    r = PrefixAwareRouter.__new__(PrefixAwareRouter)  # no Serve controller: only the choice logic runs
    loads = Loads()
    r._replica_queue_len_cache = loads
    r.initialize_state(block_size=BLOCK, **state)
    return r, loads


REPLICAS = [SimpleNamespace(replica_id=name) for name in ("a", "b", "c")]


def pending(prompt: list[int], **request) -> SimpleNamespace:
    body = {"model": "m", "request_id": "r", "prompt": prompt, "params": None, **request}
    return SimpleNamespace(args=[body], kwargs={}, metadata=SimpleNamespace(internal_request_id=str(next(IDS))))


def prompt(system: int, user: int, blocks: int = 6) -> list[int]:
    """``blocks`` full blocks shared by every user of ``system``, then the user's own tokens."""
    return [1000 * system + i for i in range(blocks * BLOCK)] + [user, user + 1, user + 2]


async def route(r: PrefixAwareRouter, req: SimpleNamespace) -> list[list[str]]:
    """The ranked groups the router returns, as replica ids; the first replica gets the request."""
    groups = await r.choose_replicas(REPLICAS, req)
    r.on_request_routed(req, groups[0][0].replica_id, None)
    return [[x.replica_id for x in g] for g in groups]


async def test_requests_sharing_a_long_prefix_go_to_the_replica_that_served_it():
    r, _ = router()
    first = await route(r, pending(prompt(1, 1)))
    owner = first[0][0]
    assert len(first[0]) == 1  # a long prefix seen for the first time is placed on one replica
    for user in range(2, 6):
        groups = await route(r, pending(prompt(1, user)))
        assert groups[0] == [owner]  # then the two choices, as a fallback
        assert len(groups) == 2 and len(groups[1]) == 2


async def test_new_prefixes_spread_over_the_replicas_caches():
    r, _ = router()
    owners = [(await route(r, pending(prompt(system, 0))))[0][0] for system in range(6)]
    assert sorted(owners) == ["a", "a", "b", "b", "c", "c"]


async def test_an_overloaded_owner_loses_the_affinity():
    r, loads = router(imbalance=8)
    owner = (await route(r, pending(prompt(1, 1))))[0][0]
    others = {"a", "b", "c"} - {owner}
    loads.update({owner: 7, **{o: 0 for o in others}})
    assert (await route(r, pending(prompt(1, 2))))[0] == [owner]  # 7 more: still within the guard
    loads[owner] = 8
    groups = await route(r, pending(prompt(1, 3)))
    assert len(groups) == 1 and len(groups[0]) == 2  # 8 more: the plain two choices


async def test_short_prefixes_and_load_only_requests_get_the_two_choices():
    r, _ = router(min_prefix_blocks=4)
    groups = await route(r, pending(prompt(1, 1, blocks=3)))  # shorter than 4 blocks: no affinity
    assert len(groups) == 1 and len(groups[0]) == 2
    assert len(r.table.owner) == 3  # its blocks are remembered: they are in that replica's cache
    groups = await route(r, pending(prompt(2, 1), prefix_routing=False))  # the front end turned it off
    assert len(groups) == 1 and len(groups[0]) == 2
    assert len(r.table.owner) == 3  # a request routed on load alone teaches the table nothing


async def test_calls_other_than_generate_get_the_two_choices():
    r, _ = router()
    req = SimpleNamespace(args=["models"], kwargs={}, metadata=SimpleNamespace(internal_request_id="x"))
    groups = await r.choose_replicas(REPLICAS, req)
    assert len(groups) == 1 and len(groups[0]) == 2


@dataclass(frozen=True)
class ReplicaID:
    """Serve's replica id, as far as the router reads it."""

    unique_id: str


async def test_a_channel_call_goes_to_the_replica_it_pins_and_to_no_other():
    r, loads = router()
    replicas = [SimpleNamespace(replica_id=ReplicaID(name)) for name in ("a", "b")]
    loads.update({replicas[0].replica_id: 0, replicas[1].replica_id: 50})  # "b" is busy: load does not matter

    def channel(pin: str) -> SimpleNamespace:
        meta = SimpleNamespace(internal_request_id=str(next(IDS)))
        return SimpleNamespace(args=[{"channel": "front-end", "pin": pin}], kwargs={}, metadata=meta)

    groups = await r.choose_replicas(replicas, channel("b"))
    assert [[x.replica_id.unique_id for x in g] for g in groups] == [["b"]]
    # A replica that is gone (or not yet up): no candidate, so Serve waits rather than sending it elsewhere.
    assert await r.choose_replicas(replicas, channel("c")) == [[]]
