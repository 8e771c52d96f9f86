"""The simulated cluster (``tests/simcluster.py``) on a small scale: 20 nodes x 4 CPUs,
the founding user's graph shape at 2k tasks, one node evicted mid-run. No Ray."""

from __future__ import annotations

import pytest
from simcluster import Cluster, Sim, cpu_seconds_bound, seed_graph

from raydag.core.records import MEMORY

# the state machine alone: the same on every dask version, run by the tests session only
pytestmark = pytest.mark.core_only


@pytest.fixture(scope="module")
def graph():
    return seed_graph(2_000, subgraphs=4, combines=10, heavy=5, seed=3)


def test_graph_shape(graph):
    assert 1_950 <= len(graph) <= 2_050
    finals = [k for k in graph.dependencies if isinstance(k, str) and k.startswith("final")]
    assert sorted(finals) == sorted(graph.outputs) and len(finals) == 4
    assert all(len(graph.dependencies[k]) == 10 for k in finals)
    heavy = [k for k in graph.dependencies if isinstance(k, tuple) and k[0].startswith("heavy")]
    assert len(heavy) == 5
    assert all(graph.durations[k] > 1_800 for k in heavy)
    assert graph.critical_path() > max(graph.durations[k] for k in heavy)


@pytest.mark.parametrize("policies", [True, False], ids=["policies-on", "policies-off"])
def test_one_eviction_one_wave(graph, policies):
    cluster = Cluster(nodes=20, cpus=4, replace_after=300.0)
    evict_at = graph.work / (20 * 4) / 2  # about half-way through
    sim = Sim(graph, cluster, policies=policies, evictions=[(evict_at, 3)], poll=2.0)
    sim.validate_every = 25
    result = sim.run()
    sim.state.validate_state()
    assert result.complete, result.failed
    assert all(sim.state.tasks[k].state == MEMORY for k in graph.outputs)
    assert result.evictions == 1
    assert result.waves == 1  # everything the node held, recomputed in one wave
    assert result.reexecuted > 0  # the lost values ran again
    assert result.executions >= len(graph)
    # every key ran at least once; a key ran twice only if lost (or duplicated)
    assert set(sim.runs) == set(graph.dependencies)
    bound = max(result.critical_path, result.work_bound)
    assert bound <= result.makespan < 3 * bound
    assert 0 < result.driver_cpu < result.sim_wall + 1.0
    assert sim.state.tasks and not sim.running


def test_checkpoints_read_back_what_evictions_lost_and_stay_within_their_cap(graph):
    """Four evictions, with checkpoints (min-cost 1 minute) under a cap of a dozen
    loads: what the nodes held is partly read back, not recomputed (5-12 read back and
    66-189 tasks rerun, against 191-331 without, over eight hash seeds); the store never
    holds much more than the cap (superseded checkpoints go), yet writes go on."""
    from raydag.core.checkpoints import Checkpoints

    cap = 2_000 * 2**20  # a dozen of the graph's 150-MB loads
    ckpt = Checkpoints(enabled=True, store="sim://", max_size=cap, keep=False)
    cluster = Cluster(nodes=20, cpus=4, replace_after=300.0)
    T = graph.work / (20 * 4)
    evictions = [(T * 0.3, 3), (T * 0.5, 7), (T * 0.7, 11), (T * 0.9, 15)]
    runs = {}
    for name, checkpoints in (("without", None), ("with", ckpt)):
        sim = Sim(graph, cluster, checkpoints=checkpoints, evictions=evictions, poll=2.0)
        sim.validate_every = 200
        most = 0

        def watch(event, out, sim=sim):
            nonlocal most
            most = max(most, sim.state.checkpointer.written_bytes)

        sim.observers.append(watch)
        runs[name] = (sim.run(), sim, most)
        sim.state.validate_state()
    (without, _, _), (got, sim, most) = runs["without"], runs["with"]
    assert got.complete and without.complete
    assert 0 < most <= cap + 150 * 2**20  # a write may begin as the one it supersedes ends
    assert got.checkpoints > cap // (150 * 2**20)  # room was freed and used again
    assert got.restored > 0 and got.reexecuted < without.reexecuted
    assert set(sim.runs) == set(graph.dependencies)


def test_work_bound_counts_evicted_cpus():
    c = Cluster(nodes=2, cpus=1, replace_after=10.0)
    assert cpu_seconds_bound(100.0, c, []) == 50.0
    # one of two CPUs gone from t=20 to t=30: 40 done by 20, 10 more by 30, 50 left
    assert cpu_seconds_bound(100.0, c, [(20.0, 0)]) == pytest.approx(55.0)
