"""Speculation's policy on the state machine alone (#17): slow nodes judged against the
others, first copies kept off them, LATE at the tail, categories that mix lengths.

``Cluster`` below simulates one-CPU nodes as Ray would run the instructions: a
duplicate only on its node, a soft placement there if it is free (else anywhere free,
Ray spilling), other work on any free CPU; a node ``factor`` times slower takes that
much longer (``inf``: it hangs); a Tick every 0.25 s.
"""

from __future__ import annotations

import heapq
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raydag.core.events import Cancel, Submit, TaskFinished, TaskStarted, Tick
from raydag.core.fusion import Fusion
from raydag.core.speculation import Speculation
from raydag.core.state import State

# the state machine alone: the same on every dask version, run by the tests session only
pytestmark = pytest.mark.core_only

DEFAULTS = Speculation(enabled=True)  # raydag.yaml's, as nobody tuned them


class Cluster:
    """One-CPU nodes ``n0..``; ``slow`` runs ``factor`` times slower."""

    def __init__(self, nodes: int, slow: str | None, factor: float) -> None:
        self.ids = [f"n{i}" for i in range(nodes)]
        self.slow, self.factor = slow, factor
        self.busy: dict[str, int] = {}  # node -> copy running there
        self.queue: list[Submit] = []  # sent, not started
        self.ends: list[tuple[float, int]] = []  # (time, copy)
        self.running: dict[int, tuple[Submit, str, float, float]] = {}
        self.now = 0.0
        self.placed: list[tuple[str, Submit, float]] = []  # (node, first copy, start)
        self.judged: set[str] = set()  # nodes ever judged slow

    def free(self) -> list[str]:
        return [n for n in self.ids if n not in self.busy]

    def speed(self, node: str) -> float:
        return self.factor if node == self.slow else 1.0

    def apply(self, out: list, length: dict) -> None:
        for ins in out:
            if isinstance(ins, Submit):
                self.queue.append(ins)
            elif isinstance(ins, Cancel):
                self.queue = [s for s in self.queue if s.copy != ins.copy]
                got = self.running.pop(ins.copy, None)
                if got is not None:
                    del self.busy[got[1]]

    def starts(self, length: dict) -> list[TaskStarted]:
        """Start what Ray would start now, in order sent."""
        events, waiting = [], []
        for sub in self.queue:
            free = self.free()
            if sub.node is not None and (not sub.soft or sub.node in free):
                node = sub.node if sub.node in free else None
            else:
                node = free[0] if free else None
            if node is None:
                waiting.append(sub)
                continue
            run = sum(length[k] for k in sub.keys) * self.speed(node)
            self.busy[node] = sub.copy
            self.running[sub.copy] = (sub, node, self.now, run)
            if not sub.duplicate:
                self.placed.append((node, sub, self.now))
            if run != math.inf:
                heapq.heappush(self.ends, (self.now + run, sub.copy))
            events.append(TaskStarted(sub.copy, node, self.now))
        self.queue = waiting
        return events


def simulate(
    state: State, cluster: Cluster, length: dict, horizon: float = 600.0
) -> tuple[float, State]:
    """Run the compute to its end (or ``horizon``); its makespan."""
    out = state.start()
    cluster.apply(out, length)
    next_tick = 0.0
    while not state.done and cluster.now < horizon:
        for ev in cluster.starts(length):
            cluster.apply(state.handle(ev), length)
            state.validate_state()
        while cluster.ends and cluster.ends[0][1] not in cluster.running:
            heapq.heappop(cluster.ends)  # cancelled
        t_end = cluster.ends[0][0] if cluster.ends else math.inf
        if t_end <= next_tick:
            cluster.now, cid = heapq.heappop(cluster.ends)
            sub, node, t0, run = cluster.running.pop(cid)
            del cluster.busy[node]
            durations = {k: run / len(sub.keys) for k in sub.keys}
            ev = TaskFinished(cid, durations, 8, node, t0)
        else:
            cluster.now = next_tick
            next_tick += 0.25
            ev = Tick(cluster.now, {n: 1.0 for n in cluster.free()})
        cluster.apply(state.handle(ev), length)
        state.validate_state()
        cluster.judged |= {n.id for n in state.nodes.values() if n.slow_since is not None}
    return cluster.now, state


def bag(lengths: list[float]) -> tuple[dict, dict, list]:
    """Independent ``work-i`` tasks (one category) and ``total`` reading them all."""
    deps: dict = {f"work-{i}": set() for i in range(len(lengths))}
    length = {f"work-{i}": x for i, x in enumerate(lengths)}
    deps["total"] = set(deps)
    length["total"] = 0.1
    return deps, length, ["total"]


def make(deps: dict, outputs: list, nodes: int, sp: Speculation = DEFAULTS) -> State:
    prio = {k: i for i, k in enumerate(deps)}
    return State(
        deps,
        prio,
        outputs,
        capacity=nodes,
        speculation=sp,
        fusion=Fusion(enabled=False),
        nodes={f"n{i}": 1.0 for i in range(nodes)},
    )


def mixed(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.1, 0.4) if i % 2 else rng.uniform(1.0, 2.0) for i in range(n)]


def bound(length: dict, nodes: int, factor: float) -> float:
    work = sum(v for k, v in length.items() if k != "total")
    speeds = nodes - 1 + (0.0 if factor == math.inf else 1 / factor)
    return max(max(length.values()), work / speeds) + length["total"]


# ---- examples ---------------------------------------------------------------------


def test_the_docstrings_worked_example():
    """Others ran f in [0.2, 0.2, 0.3, 2.0, 2.1]; n3 (5x) ran 1.0 and 10.0 and is 9 s
    into a third; n2 ran 2.0, 2.1, 0.2 (long by chance: a ratio of medians says slow)."""
    deps = {"f-0": set(), "g-0": set()}
    s = make(deps, list(deps), nodes=4)
    sp = s.speculator
    cat = s.category("f")
    for x in (0.2, 0.2, 0.3):
        sp.learn(cat, x, "n0")
    for x in (2.0, 2.1):
        sp.learn(cat, x, "n1")
    for x in (1.0, 10.0):
        sp.learn(cat, x, "n3")
    (sub, _) = [i for i in s.start() if isinstance(i, Submit)]
    s.handle(TaskStarted(sub.copy, "n3", 100.0))
    s.handle(Tick(109.0, {}))
    assert sp.slow("n3")
    assert sp.pace("n3") == pytest.approx(5.0)  # 1.0 / 5 ties the two 0.2 s runs
    for x in (2.0, 2.1, 0.2):  # against n0's and n1's runs (n3 is slow: left out)
        sp.learn(cat, x, "n2")
    assert not sp.slow("n2") and sp.slow("n3")


def test_slow_node_gets_no_first_copies_and_is_looked_at_again():
    """5x node, one mixed category, 3 nodes: once judged, first copies go elsewhere and
    its CPU is withheld; after block-slow-node (8 s here) it gets first copies again."""
    deps, length, outputs = bag(mixed(100))
    sp = Speculation(enabled=True, block_slow_node=8.0)
    c = Cluster(3, "n2", 5.0)
    s = make(deps, outputs, 3, sp)
    took, s = simulate(s, c, length)
    assert s.done
    # when was it judged, and did it get first copies between that and 20 s later
    on_slow = [t for node, _, t in c.placed if node == "n2"]
    assert on_slow, "it runs work till judged"
    gaps = [b - a for a, b in zip(on_slow, on_slow[1:], strict=False)]
    assert max(gaps) >= 8.0 and on_slow[-1] > on_slow[2] + 8.0, on_slow  # blocked, then back
    assert any("away from slow node n2" in sub.placed for _, sub, _ in c.placed)
    assert took <= 1.3 * bound(length, 3, 5.0), (took, bound(length, 3, 5.0))


def test_hung_node_never_hangs_the_compute():
    deps, length, outputs = bag(mixed(24))
    c = Cluster(3, "n1", math.inf)
    took, s = simulate(make(deps, outputs, 3), c, length)
    assert s.done and took <= 1.3 * bound(length, 3, math.inf), took


SIX = [(0.2, "n0"), (2.1, "n0"), (2.0, "n1"), (0.3, "n1"), (1.9, "n2"), (0.2, "n2")]


def _running_on_n0(runs: list, deps: dict) -> tuple[State, Submit]:
    """Three nodes; category f learned ``runs`` (seconds, node); f-0 started on n0 at 10 s."""
    s = make(deps, [k for k in deps if not any(k in d for d in deps.values())], nodes=3)
    for x, n in runs:
        s.speculator.learn(s.category("f"), x, n)
    (sub,) = [i for i in s.start() if isinstance(i, Submit)]
    s.handle(TaskStarted(sub.copy, "n0", 10.0))
    return s, sub


def test_a_long_task_on_a_node_not_slow_is_not_duplicated_before_overdue():
    """Mixed category: a task 1.5 s in on a normal node is one of the ~2-s ones, with
    about 0.5 s left, less than a fresh copy would take: no duplicate, though CPUs idle
    at the tail. Once it has run min-gain (0.25 s) longer than every one of the
    category's six finished runs (2.1 s) it is overdue: duplicated, no min-runtime."""
    s, sub = _running_on_n0(SIX, {"f-0": set()})
    assert s.handle(Tick(11.5, {"n1": 1.0, "n2": 1.0})) == []
    assert s.handle(Tick(12.3, {"n1": 1.0, "n2": 1.0})) == []
    (dup,) = s.handle(Tick(12.4, {"n1": 1.0, "n2": 1.0}))
    assert dup.duplicate and dup.keys == sub.keys and dup.node in {"n1", "n2"}


def test_with_fewer_runs_than_min_samples_overdue_is_multiplier_times_the_upper_end():
    """Four finished runs (min-samples 5): the longest of them is no upper end to trust,
    so a copy past it (2.1 s) but under 1.5x it (3.15 s) is left to run."""
    s, sub = _running_on_n0(SIX[:4], {"f-0": set()})
    assert s.handle(Tick(12.5, {"n1": 1.0, "n2": 1.0})) == []
    assert s.handle(Tick(13.1, {"n1": 1.0, "n2": 1.0})) == []
    (dup,) = s.handle(Tick(13.2, {"n1": 1.0, "n2": 1.0}))
    assert dup.duplicate and dup.keys == sub.keys


def _overtaken(winner_takes: float) -> State:
    """f-0 runs on n0 from 10 s, is overdue past 12.35 s (min-gain past the longest of
    the category's six runs, 2.1 s) and duplicated; the duplicate wins after
    ``winner_takes`` seconds."""
    others = [(x, "n1" if i % 2 else "n2") for i, (x, _) in enumerate(SIX)]
    s, sub = _running_on_n0(others, {"f-0": set(), "g-0": {"f-0"}})
    (dup,) = s.handle(Tick(13.25, {"n1": 1.0, "n2": 1.0}))
    assert dup.duplicate and dup.node in {"n1", "n2"}
    s.handle(TaskStarted(dup.copy, dup.node, 13.25))
    out = s.handle(TaskFinished(dup.copy, {"f-0": winner_takes}, 8, dup.node, 13.25))
    assert any(isinstance(i, Cancel) and i.copy == sub.copy for i in out)
    s.validate_state()
    return s


def test_a_copy_overtaken_slow_node_times_over_judges_its_node():
    """Its copy ran 3.55 s; the same task took 0.3 s elsewhere: n0 is 11.8x slower on
    the very same inputs, which no longer task could explain. One such pair judges it
    (ranks need two runs: n0 finished none), and its pace is at least that."""
    s = _overtaken(0.3)
    sp = s.speculator
    assert sp.overtaken["n0"] == [pytest.approx(3.55 / 0.3)]
    assert sp.slow("n0") and not sp.slow("n1") and not sp.slow("n2")
    assert sp.pace("n0") >= 3.55 / 0.3 - 1e-6
    assert s.speculator.withheld() == 1.0  # g-0 goes elsewhere


def test_a_copy_overtaken_less_than_slow_node_times_sets_its_pace_only():
    """Overtaken 2.4x (5.5 s against 2.25 s): not blocked (a 2x node keeps its first
    copies), but its time left is estimated at pace 2.4, not 1."""
    s = _overtaken(2.25)
    sp = s.speculator
    assert not sp.slow("n0") and sp.withheld() == 0.0
    assert sp.pace("n0") == pytest.approx(5.5 / 2.25) and sp.pace("n1") == 1.0


# ---- random clusters --------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.sampled_from([3, 6]),
    factor=st.sampled_from([1.0, 2.0, 5.0, 20.0, math.inf]),
    mix=st.booleans(),
    n=st.integers(6, 40),
    seed=st.integers(0, 1000),
)
def test_random_stragglers(nodes, factor, mix, n, seed):
    """Whatever the slowdown (or a hang) and the lengths: the compute ends, every
    invariant holds after each event, within 1.5x the bound plus the tail (the simulation
    has no overheads); with no slow
    node and one length per category, no node is ever judged slow."""
    rng = random.Random(seed)
    lengths = mixed(n, seed) if mix else [rng.uniform(0.5, 1.0) for _ in range(n)]
    deps, length, outputs = bag(lengths)
    c = Cluster(nodes, "n0", factor)
    s = make(deps, outputs, nodes)
    took, s = simulate(s, c, length)
    assert s.done, (took, s.groups)
    # a lone task on a node not known slow is overdue at 1.5x the longest, then runs
    # afresh: 2.5 tasks' length, and a tick
    assert took <= 1.5 * bound(length, nodes, factor) + 2.5 * max(lengths) + 0.25, took
    if factor == 1.0 and not mix:
        assert not c.judged, c.judged
    # a copy at nominal speed is never overtaken: a duplicate started later at the same
    # speed ends later; only the slowed node's copies are
    assert set(s.speculator.overtaken) <= ({"n0"} if factor > 1 else set())
    assert all(r <= factor + 1e-6 for r in s.speculator.overtaken.get("n0", ()))
