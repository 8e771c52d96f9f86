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


def test_work_bound_counts_evicted_cpus():
    c = Cluster(nodes=2, cpus=1, replace_after=10.0)
    assert cpu_seconds_bound(100.0, c, []) == 50.0
    # one of two CPUs gone from t=20 to t=30: 40 done by 20, 10 more by 30, 50 left
    assert cpu_seconds_bound(100.0, c, [(20.0, 0)]) == pytest.approx(55.0)
