"""The Ray connector's pure logic, without a cluster: prefix keys and table, resuming a
stream after a replica failure, the deployment's summed figures, and the settings."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

from servelm.connectors.base import ConnectorError
from servelm.connectors.ray_replica import error_item
from servelm.connectors.ray_resume import MAX_MIGRATIONS, resumable_stream
from servelm.connectors.ray_router import PrefixTable, prefix_keys
from servelm.connectors.ray_stats import STALE_AFTER_S, DeploymentStats, StatsBoard, StatsPoller
from servelm.engine.outputs import CompletionOutput, RequestOutput
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.structured_outputs import StructuredOutputsParams
from servelm.settings import Settings

# --- prefix keys and the table -------------------------------------------------


def test_prefix_keys_are_cumulative_over_full_blocks():
    a = prefix_keys(list(range(40)), 16)
    b = prefix_keys(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2  # the 8-token tail is not a full block
    assert a == b  # same first 32 tokens: same keys
    c = prefix_keys([7, *list(range(1, 40))], 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key


def test_prefix_table_finds_the_longest_prefix_of_a_live_replica():
    table = PrefixTable()
    short, long_ = prefix_keys(list(range(16)), 16), prefix_keys(list(range(48)), 16)
    table.record(short, "A")
    table.record(long_, "B")  # B now owns the first block too
    assert table.lookup(long_, {"A", "B"}) == "B"
    table.record(short, "A")
    assert table.lookup(long_, {"A", "B"}) == "B"  # the longest prefix wins
    assert table.lookup(long_, {"A"}) == "A"  # B gone: the shorter prefix's owner
    assert table.lookup(long_, {"A"}, min_blocks=2) is None  # too short a prefix to be worth it
    table.forget("A")
    assert table.lookup(long_, {"A"}) is None


def test_prefix_table_counts_the_blocks_each_replica_owns():
    table = PrefixTable()
    a, b = prefix_keys(list(range(64)), 16), prefix_keys(list(range(100, 132)), 16)
    table.record(a, "A")
    table.record(b, "B")
    assert (table.blocks["A"], table.blocks["B"]) == (4, 2)
    table.record(a[:2], "B")  # B took over the first two blocks of a
    assert (table.blocks["A"], table.blocks["B"]) == (2, 4)


def test_prefix_table_is_bounded():
    table = PrefixTable(max_keys=10)
    for i in range(30):
        table.record([i], "A")
    assert len(table.owner) == 10
    assert table.lookup([29], {"A"}) == "A" and table.lookup([0], {"A"}) is None


# --- resuming streams ---------------------------------------------------------------


class ReplicaDied(Exception):
    pass


def _out(tokens: list[int], text: str, finished: bool, prompt: list[int], generated: int) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=prompt,
        outputs=[
            CompletionOutput(
                index=0,
                text=text,
                token_ids=tokens,
                cumulative_logprob=-0.5 * generated,
                finish_reason="length" if finished else None,
            )
        ],
        finished=finished,
        delta=True,
        num_generated_tokens=generated,
    )


class FakeReplicas:
    """Replicas that generate token ``100 + position`` greedily and die after ``die_after`` tokens."""

    def __init__(self, die_after: list[int]):
        self.die_after = list(die_after)
        self.requests: list[dict] = []

    async def open(self, request):
        self.requests.append(request)
        prompt = request["prompt"]
        base = len(prompt) - 3  # the original prompt has 3 tokens
        limit = self.die_after.pop(0) if self.die_after else None
        total = request["params"].max_tokens
        for i in range(total):
            if limit is not None and i >= limit:
                raise ReplicaDied("SIGKILL")
            tok = 100 + base + i
            yield [_out([tok], f" t{tok}", i == total - 1, prompt if i == 0 else [], i + 1)]


async def _collect(replicas: FakeReplicas, max_tokens: int = 6, **params):
    request = {
        "request_id": "r",
        "prompt": [1, 2, 3],
        "params": SamplingParams(max_tokens=max_tokens, temperature=0, **params),
    }
    outs = []
    async for out in resumable_stream(request, replicas.open, lambda e: isinstance(e, ReplicaDied)):
        outs.append(out)
    return outs


async def test_a_dead_replica_is_resumed_from_the_tokens_sent():
    replicas = FakeReplicas(die_after=[2, 3])
    outs = await _collect(replicas)
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert tokens == [100, 101, 102, 103, 104, 105]  # one continuous stream: nothing lost, nothing twice
    assert "".join(c.text for o in outs for c in o.outputs) == "".join(f" t{t}" for t in tokens)
    assert outs[-1].finished and outs[-1].num_generated_tokens == 6
    assert all(o.prompt_token_ids == [1, 2, 3] for o in outs)  # read as the original request
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(-3.0)
    second, third = replicas.requests[1], replicas.requests[2]
    assert second["prompt"] == [1, 2, 3, 100, 101] and second["params"].max_tokens == 4
    assert third["prompt"] == [1, 2, 3, 100, 101, 102, 103, 104] and third["params"].max_tokens == 1
    # The tokens before each cut stay output for the frequency and presence penalties.
    assert second["params"].prior_output_token_ids == [100, 101]
    assert third["params"].prior_output_token_ids == [100, 101, 102, 103, 104]
    assert len({r["request_id"] for r in replicas.requests}) == 3
    assert second["params"].temperature == 0


async def test_a_request_with_tools_is_resumed_only_before_its_first_token():
    # The tool-call parser's state died with the replica: the rest of a call cannot be read without it.
    for die_after, resumed in ((0, True), (2, False)):
        replicas = FakeReplicas(die_after=[die_after])
        request = {
            "request_id": "r",
            "prompt": [1, 2, 3],
            "params": SamplingParams(max_tokens=4, temperature=0, tool_call_parser="hermes"),
        }
        stream = resumable_stream(request, replicas.open, lambda e: isinstance(e, ReplicaDied))
        if resumed:
            outs = [out async for out in stream]
            assert [t for o in outs for c in o.outputs for t in c.token_ids] == [100, 101, 102, 103]
            continue
        with pytest.raises(ConnectorError) as info:
            async for _ in stream:
                pass
        assert info.value.code == "replica_failed" and "tools" in info.value.message


async def test_more_than_three_migrations_fail_with_replica_failed():
    replicas = FakeReplicas(die_after=[1] * (MAX_MIGRATIONS + 1))
    with pytest.raises(ConnectorError) as info:
        await _collect(replicas, max_tokens=10)
    assert info.value.status == 503 and info.value.code == "replica_failed"
    assert len(replicas.requests) == MAX_MIGRATIONS + 1


async def test_a_structured_output_is_resumed_only_before_its_first_token():
    # Its grammar would start over at the resumed prompt's end, so the output could no longer follow it.
    spec = StructuredOutputsParams(regex="[0-9]+")
    replicas = FakeReplicas(die_after=[0])
    outs = await _collect(replicas, structured_outputs=spec)
    assert [t for o in outs for c in o.outputs for t in c.token_ids] == [100, 101, 102, 103, 104, 105]
    assert replicas.requests[1]["prompt"] == [1, 2, 3]
    assert replicas.requests[1]["params"].structured_outputs == spec
    replicas = FakeReplicas(die_after=[2])
    with pytest.raises(ConnectorError) as info:
        await _collect(replicas, structured_outputs=spec)
    assert info.value.code == "replica_failed" and "structured output" in info.value.message
    assert len(replicas.requests) == 1


async def test_request_errors_are_not_retried():
    calls = []

    async def open_stream(request):
        calls.append(request)
        yield error_item(ConnectorError("too long", param="prompt", code="context_length_exceeded"))

    request = {"request_id": "r", "prompt": [1], "params": SamplingParams()}
    with pytest.raises(ConnectorError) as info:
        async for _ in resumable_stream(request, open_stream, lambda e: True):
            pass
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert len(calls) == 1


async def test_other_exceptions_are_not_retried():
    async def open_stream(request):
        raise ValueError("a bug")
        yield

    request = {"request_id": "r", "prompt": [1], "params": SamplingParams()}
    with pytest.raises(ValueError):
        async for _ in resumable_stream(request, open_stream, lambda e: False):
            pass


# --- the deployment's figures --------------------------------------------------------


def _snapshot(replica: str, running: int, waiting: int, kv: float, hits: int, age: float = 0.0, state="RUNNING"):
    return {
        "replica": replica,
        "node_id": "n",
        "node_ip": "127.0.0.1",
        "pid": 1,
        "state": state,
        "running": running,
        "waiting": waiting,
        "kv_cache_usage": kv,
        "age": age,  # as the board gives it
        "engines": [
            {
                "model": "m",
                "num_running": running,
                "num_waiting": waiting,
                "kv_cache_usage": kv,
                "prefix_cache_queries": 100,
                "prefix_cache_hits": hits,
                "num_preemptions": 0,
                "spec_decode_drafts": 3,
                "spec_decode_draft_tokens": 12,
                "spec_decode_accepted_tokens": hits,
            }
        ],
    }


def test_stats_sum_live_replicas_and_show_the_stale_ones():
    stats = DeploymentStats(
        [
            _snapshot("a", 2, 1, 0.5, 10),
            _snapshot("b", 1, 3, 0.25, 30),
            _snapshot("c", 9, 9, 0.9, 90, age=STALE_AFTER_S + 1),  # killed: no longer reporting
        ]
    )
    depth = stats.queue_depth()
    assert (depth.running, depth.waiting) == (3, 4)  # the whole cluster's queue, live replicas only
    engine = stats.engine_stats()
    total = next(e for e in engine if e.replica is None)
    assert (total.num_running, total.prefix_cache_hits, total.prefix_cache_queries) == (3, 40, 200)
    assert total.kv_cache_usage == pytest.approx(0.375)
    assert (total.spec_decode_drafts, total.spec_decode_draft_tokens, total.spec_decode_accepted_tokens) == (6, 24, 40)
    assert sorted(e.replica for e in engine if e.replica) == ["a", "b"]
    states = {r.replica: r.state for r in stats.replicas()}
    assert states == {"a": "RUNNING", "b": "RUNNING", "c": "UNRESPONSIVE"}


def test_liveness_does_not_depend_on_the_machines_clocks_agreeing(monkeypatch):
    # The board and the front end may run on machines whose clocks are minutes apart: ages are
    # taken on the board's clock and then on the front end's, never across the two.
    board = StatsBoard()
    fresh = _snapshot("a", 1, 0, 0.1, 0)
    del fresh["age"]
    board.put(fresh)
    entries = board.get()
    assert 0 <= entries[0]["age"] < STALE_AFTER_S
    monkeypatch.setattr(time, "time", lambda: 1e10)  # this machine's wall clock, centuries off
    assert [s["replica"] for s in DeploymentStats(entries).live()] == ["a"]
    assert [r.state for r in DeploymentStats(entries).replicas()] == ["RUNNING"]


async def test_the_stats_poller_stops_when_cancelled_from_another_thread():
    # The server's shutdown runs on its main thread, not on the loop the poller reads from.
    reads = asyncio.Queue()

    async def read():
        reads.put_nowait(None)
        return [_snapshot("a", 1, 0, 0.1, 1)]

    poller = StatsPoller(read, period_s=0)
    poller.start()
    task = poller._task
    await reads.get()  # it is polling
    await asyncio.to_thread(poller.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert poller.stats.queue_depth().running == 1
    poller.cancel()  # twice is harmless


# --- settings -----------------------------------------------------------------------


def test_ray_settings():
    assert not Settings().use_ray
    assert Settings(replicas=2).use_ray and Settings(ray_address="auto").use_ray
    assert Settings(min_replicas=1, max_replicas=3).use_ray
    with pytest.raises(ValueError, match="min_replicas"):
        Settings(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="initial count"):
        Settings(replicas=5, min_replicas=1, max_replicas=3)


def test_the_default_path_never_imports_ray():
    code = (
        "import sys\n"
        "from servelm.cli import build_parser, settings_from_args\n"
        "from servelm.api import create_app\n"
        "from servelm.connectors.local import LocalConnector\n"
        "p = build_parser(); a = p.parse_args(['serve'])\n"
        "s = settings_from_args(a, a.command_parser)\n"
        "app = create_app(LocalConnector(s.model, s.embedding_model, s.engine_config()), s)\n"
        "assert not s.use_ray\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_the_serve_app_follows_the_settings():
    from servelm.connectors.ray_deploy import build_app_from_args

    app = build_app_from_args(
        {"model": "smollm2-135m-instruct", "replicas": 3, "replica_cpus": 2, "kv_cache_memory": "64MiB"}
    )
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 2
    config = deployment._deployment_config.request_router_config
    assert config.request_router_class.endswith("ray_router.PrefixAwareRouter")
    assert config.request_router_kwargs["prefix_routing"] is True
    spec = deployment.init_args[0]
    assert spec["model"] == "smollm2-135m-instruct" and spec["engine"]["kv_cache_memory"] == 64 << 20
    assert spec["threads"] == 2  # a replica's torch threads follow the CPUs Ray reserves for it

    scaled = build_app_from_args(
        {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8, "prefix_routing": False}
    )
    auto = scaled._bound_deployment._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 8)
    assert (
        scaled._bound_deployment._deployment_config.request_router_config.request_router_kwargs["prefix_routing"]
        is False
    )


def test_a_replica_takes_every_request_the_cluster_admits_and_the_channels_besides():
    # Serve queues calls past max_ongoing_requests: a front end's channel must never wait
    # behind the requests whose outputs it carries, even with all of them on one replica.
    from servelm.connectors.ray_deploy import CHANNEL_CALLS, plan_from_settings

    for seqs, waiting in ((2, 256), (256, 256), (8, None), (64, 4096)):
        plan = plan_from_settings(Settings(replicas=2, max_num_seqs=seqs, max_waiting=waiting))
        assert plan.max_ongoing_requests >= seqs + (waiting or 0) + CHANNEL_CALLS


def _serve_joining(address: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``servelm serve --ray-address address`` run to its exit, without this process's SERVELM_* settings."""
    cmd = [sys.executable, "-m", "servelm", "serve", "--embedding-model", "none", "--port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    return subprocess.run(
        [*cmd, "--ray-address", address], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_an_unreachable_ray_address_exits_2_at_once():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    result = _serve_joining(f"127.0.0.1:{port}", timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in result.stderr


def test_an_address_where_no_ray_cluster_answers_exits_2():
    # Something listens (the TCP check passes) but never speaks Ray: Ray's own
    # retries would take minutes; the server gives up after its join timeout.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)  # the kernel completes connections; nobody ever answers them
        port = sock.getsockname()[1]
        result = _serve_joining(f"127.0.0.1:{port}", timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"could not join the Ray cluster at 127.0.0.1:{port}" in result.stderr
