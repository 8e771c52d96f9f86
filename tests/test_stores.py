"""raydag.stores reads the real raylets: objects appear in and leave the store it reports."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from raydag.runtime import stores

pytestmark = pytest.mark.usefixtures("ray_cluster")

MiB = 2**20


def _total(stats: dict[str, stores.StoreStats]) -> tuple[int, int]:
    return sum(s.num_objects for s in stats.values()), sum(s.used_bytes for s in stats.values())


def _wait_until(predicate, timeout: float = 5.0) -> dict[str, stores.StoreStats]:
    deadline = time.monotonic() + timeout
    while True:
        stats = stores.store_stats()
        if predicate(stats):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"store did not get there within {timeout} s: {stats}")
        time.sleep(0.02)


def _settled_baseline() -> tuple[int, int]:
    """The store once earlier tests' objects are gone (they should be)."""
    stats = _wait_until(lambda s: _total(s)[0] == 0, timeout=10.0)
    return _total(stats)


def test_every_alive_node_is_read():
    stats = stores.store_stats()
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(stats) == alive
    for s in stats.values():
        assert s.capacity_bytes > 0
        assert 0 <= s.used_bytes <= s.capacity_bytes
        assert s.free_bytes == s.capacity_bytes - s.used_bytes


def test_a_put_shows_up_and_leaves():
    objects0, used0 = _settled_baseline()
    node = ray.get_runtime_context().get_node_id()

    ref = ray.put(np.ones(10 * MiB // 8))
    stats = stores.store_stats()
    assert stats[node].num_objects == objects0 + 1
    assert stats[node].used_bytes >= used0 + 10 * MiB
    assert stats[node].primary_bytes >= 10 * MiB

    del ref
    stats = _wait_until(lambda s: _total(s) == (objects0, used0))
    assert stats[node].used_bytes == used0


def test_sampler_records_the_peak():
    objects0, used0 = _settled_baseline()
    node = ray.get_runtime_context().get_node_id()
    with stores.StoreSampler(interval=0.02) as sampler:
        ref = ray.put(np.ones(10 * MiB // 8))
        time.sleep(0.2)
        del ref
        _wait_until(lambda s: _total(s) == (objects0, used0))
        time.sleep(0.1)

    assert sampler.rounds >= 5
    assert sampler.peak_total_used >= used0 + 10 * MiB
    assert sampler.peak_used[node] >= used0 + 10 * MiB
    assert sampler.peak_total_time is not None

    ours = [s for s in sampler.samples if s.node == node]
    assert ours[0].used_bytes == used0  # sampled on entry, before the put
    assert ours[-1].used_bytes == used0  # and on exit, after it was freed
    assert max(s.num_objects for s in ours) == objects0 + 1
    assert all(s.capacity_bytes > 0 for s in ours)

    totals = sampler.totals()
    assert [t for t, _ in totals] == sorted(t for t, _ in totals)
    assert max(b for _, b in totals) == sampler.peak_total_used


def test_sampler_calls_back_each_round_and_cannot_start_twice():
    seen = []
    sampler = stores.StoreSampler(interval=0.05, on_round=lambda t, s: seen.append((t, s)))
    with sampler:
        time.sleep(0.3)
        with pytest.raises(RuntimeError):
            sampler.start()
    sampler.stop()  # a second stop does nothing
    assert len(seen) == sampler.rounds >= 3
    assert all(isinstance(s, dict) and s for _, s in seen)


def test_one_channel_per_node_is_kept():
    with stores.StoreReader() as reader:
        reader.read()
        first = {node: stub for node, (_, _, stub) in reader._stubs.items()}
        reader.read()
        assert {node: stub for node, (_, _, stub) in reader._stubs.items()} == first
    assert reader._stubs == {}


def test_reads_pass_token_authentication():
    """Ray 2.59+ turns token auth on for local clusters: an unauthenticated call fails."""
    import grpc
    from ray._private.authentication import authentication_utils
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    if not authentication_utils.is_token_auth_enabled():
        pytest.skip("token authentication is off for this cluster")
    n = next(n for n in ray.nodes() if n["Alive"])
    with grpc.insecure_channel(f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}") as channel:
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stores.store_stats()  # ours carry the token
