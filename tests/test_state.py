"""The scheduling state machine on its own: random graphs, a simulated driver, no Ray.

``raydag.core.state`` makes every decision (order, release, fusion, retries), so its
properties are checked here against an independent model of what has run, what is
held and what is ready, on every event of many random runs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable

import pytest
from dask._task_spec import convert_legacy_graph
from dask.order import order
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from raydag.core.events import (
    Aborted,
    Cancel,
    CpusChanged,
    Fail,
    Ordered,
    Recover,
    Release,
    ResultsLost,
    StoresSampled,
    Submit,
    TaskErred,
    TaskFinished,
    TaskStarted,
    Tick,
    Won,
    WorkerDiedError,
)
from raydag.core.fusion import CONSUMERS_SHARE, PROBES, Fusion
from raydag.core.placement import Placement
from raydag.core.records import PROCESSING
from raydag.core.speculation import Speculation
from raydag.core.state import State

# The cheap threshold these tests are built around (``Fusion()``'s default comes from
# raydag.yaml and may differ): CHEAP is below it, SLOW above it.
MAX_TASK_DURATION = 0.005
# Below MAX_TASK_DURATION; a power of two, so that the state machine's means and sums
# of it are exact and the model below can compare costs without rounding.
CHEAP = 2**-10
SLOW = 0.02  # above it: never fused


def fusion_config(**kwargs) -> Fusion:
    """``Fusion`` with the settings these tests assume, whatever raydag.yaml says."""
    base = dict(
        enabled=True,
        max_task_duration=MAX_TASK_DURATION,
        max_group_duration=0.25,
        max_group_size=256,
    )
    return Fusion(**(base | kwargs))


# Fusion off, as ``State`` had it by default: still, a task below MAX_TASK_DURATION is
# cheap (a fraction of a slot, no start report).
NO_FUSION = fusion_config(enabled=False)


SETTINGS = settings(
    max_examples=100,
    deadline=None,
    # no explain phase: on Python < 3.12 it traces every line while it shrinks, and a
    # failure found in CI ran past pytest's timeout instead of showing its example
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _task(*args):
    return None


def dask_priorities(dependencies: dict) -> dict:
    """``dask.order`` over legacy tasks that read exactly ``dependencies``."""
    dsk = {k: (_task, *sorted(deps)) for k, deps in dependencies.items()}
    return order(convert_legacy_graph(dsk), dependencies=dependencies)


def dependents_of(dependencies: dict) -> dict:
    out: dict = {k: set() for k in dependencies}
    for k, deps in dependencies.items():
        for d in deps:
            out[d].add(k)
    return out


# ---- random scenarios -----------------------------------------------------------


def _same_notify(ins: object, sub: Submit) -> object:
    """``ins`` with ``sub``'s ``notify`` and ``notify_after``: whether and when a
    resubmitted group reports its start follows what is known of its category by then,
    not what was known before."""
    if not isinstance(ins, Submit):
        return ins
    return dataclasses.replace(ins, notify=sub.notify, notify_after=sub.notify_after)


@dataclasses.dataclass
class Scenario:
    dependencies: dict
    priorities: dict
    outputs: set
    available: set
    resources: dict
    retries: dict
    capacity: int
    fusion: Fusion
    categories: dict  # key -> category
    durations: dict  # category -> reported seconds per task
    default_retries: int = 3
    cheap_cost: float = 1.0  # slots taken by a task measured cheap (exact in binary)
    fixed: set = dataclasses.field(default_factory=set)  # given, with no lineage here
    speculation: Speculation = Speculation(enabled=False)
    placement: Placement = Placement(enabled=False)
    bundles: dict = dataclasses.field(default_factory=dict)  # shuffle map -> its pieces

    def state(self) -> State:
        return State(
            self.dependencies,
            self.priorities,
            self.outputs,
            capacity=self.capacity,
            available=self.available,
            resources=self.resources,
            retries=self.retries,
            default_retries=self.default_retries,
            fusion=self.fusion,
            category=self.categories.__getitem__,
            cheap_cost=self.cheap_cost,
            fixed=self.fixed,
            speculation=self.speculation,
            placement=self.placement,
            bundles=self.bundles,
        )


@st.composite
def scenarios(draw, fusion: bool | None = None, annotations: bool = True) -> Scenario:
    """A culled DAG (every sink is an output) with edges from lower to higher index.

    Most edges are local (chains and small trees, which is what fuses), a few reach
    far back (shared inputs, which must not fuse); some graphs are mostly long chains
    (long fused groups). Some sources are given (held from the start), with no lineage
    (``fixed``) or with it; sometimes a later key is given too, its ancestors in the
    graph being its lineage, run only if needed.
    """
    n = draw(st.integers(1, 60))
    keys = [f"k{i}" for i in range(n)]
    shape = draw(st.sampled_from(["dag", "trees", "chains"]))
    dependencies: dict = {}
    for i, k in enumerate(keys):
        if i == 0:
            dependencies[k] = set()
            continue
        if shape == "chains":  # mostly the previous key; now and then a new chain
            offsets = draw(st.sampled_from([[1]] * 7 + [[]]))
        else:
            offsets = draw(st.lists(st.integers(1, min(i, 6)), max_size=3 if shape == "dag" else 1))
        dependencies[k] = {keys[i - o] for o in offsets}
    far = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=n // 4))
    for a, b in far:
        if a < b:
            dependencies[keys[b]].add(keys[a])
    dependents = dependents_of(dependencies)

    sinks = {k for k in keys if not dependents[k]}
    outputs = sinks | draw(st.sets(st.sampled_from(keys), max_size=3))
    sources = sorted(k for k in keys if not dependencies[k])
    available = draw(st.sets(st.sampled_from(sources), max_size=len(sources) // 2))
    if draw(st.booleans()):
        available |= draw(st.sets(st.sampled_from(keys), max_size=3))
    fixed = {k for k in sorted(available) if not dependencies[k] and draw(st.booleans())}

    if draw(st.booleans()):
        priorities = dask_priorities(dependencies)
    else:
        priorities = dict(zip(keys, draw(st.permutations(range(n))), strict=True))

    resources: dict = {}
    retries: dict = {}
    if annotations:
        kinds = st.sampled_from([{"CPU": 2}, {"CPU": 0.5}, {"GPU": 1}, {"CPU": 1}])
        resources = draw(st.dictionaries(st.sampled_from(keys), kinds, max_size=4))
        if draw(st.booleans()):  # a few keys, or every key alike (which still fuses)
            retries = draw(st.dictionaries(st.sampled_from(keys), st.integers(0, 3), max_size=4))
        else:
            retries = dict.fromkeys(keys, draw(st.integers(0, 3)))

    ncat = 1 if shape == "chains" else draw(st.integers(1, 3))
    categories = {k: f"c{draw(st.integers(0, ncat - 1))}" if ncat > 1 else "c0" for k in keys}
    durations = {
        f"c{j}": CHEAP if j == 0 else draw(st.sampled_from([CHEAP, SLOW])) for j in range(ncat)
    }
    enabled = draw(st.booleans()) if fusion is None else fusion
    cfg = fusion_config(
        enabled=enabled,
        max_group_duration=draw(st.sampled_from([0.0025, 0.01, 0.25])),
        max_group_size=draw(st.sampled_from([2, 3, 5, 256])),
    )
    return Scenario(
        dependencies=dependencies,
        priorities=priorities,
        outputs=outputs,
        available=available,
        resources=resources,
        retries=retries,
        capacity=draw(st.integers(1, 4)),
        fusion=cfg,
        categories=categories,
        durations=durations,
        default_retries=draw(st.integers(0, 3)),
        cheap_cost=draw(st.sampled_from([1.0, 0.5, 0.25])),
        fixed=fixed,
    )


# ---- the simulated Ray layer ----------------------------------------------------


def assert_fails(ins, key, error, retryable: bool) -> None:
    """``Fail`` with the task's error; a killed worker's, wrapped to say so."""
    assert isinstance(ins, Fail) and ins.key == key, ins
    if retryable:
        assert isinstance(ins.error, WorkerDiedError) and ins.error.__cause__ is error, ins
    else:
        assert ins.error is error, ins


class Driver:
    """Carries out instructions against its own model and checks each one.

    The model (what finished, what is held, what is in flight, what is being
    recovered) is built only from instructions and events, never read from the
    ``State``, so it can disagree. What is in flight is keyed by copy id (``_key``):
    a retried or restarted group is a new copy, and its entry moves to the new id.
    """

    def __init__(self, sc: Scenario):
        self.sc = sc
        self.deps = {k: frozenset(v) for k, v in sc.dependencies.items()}
        self.dependents = dependents_of(sc.dependencies)
        self.state = sc.state()
        self.capacity = sc.capacity
        self.inflight: dict[int, Submit] = {}  # copy -> its Submit
        self.costs: dict[int, float] = {}  # copy -> slots its group took when submitted
        self.groups_seen: set[int] = set()
        self.copies_seen: set[int] = set()  # copy ids are never reused
        self.submitted: set = set()
        # What the outputs need, up to given values; the rest is lineage of given values
        needed: set = set()
        stack = list(sc.outputs)
        while stack:
            k = stack.pop()
            if k not in needed:
                needed.add(k)
                if k not in sc.available:
                    stack.extend(self.deps[k])
        self.given: set = set(sc.available)  # given, never lost: held by their owner
        self.skipped: set = set(sc.available) | (set(self.deps) - needed)  # done, not run
        self.finished: set = set(self.skipped)  # members of finished groups, and skipped
        self.memory: set = set(sc.available)  # values held outside any Ray task
        self.released: set = set()
        self.roots: set = set()
        self.recovering: set = set()  # to be recomputed, not finished again yet
        self.cancelled: list[int] = []  # copies cancelled by a recovery
        self.superseded: list[int] = []  # copies that died, their group retried as a new one
        self.known: dict[str, float] = {}  # category -> duration reported so far
        self.submits: list[Submit] = []
        self.stopped = False
        self.errors = 0
        self.outcome = "running"  # or completed, failed, aborted
        self.retried = 0
        self.waves = 0
        self.restored: set = set()
        self.lineage_run: set = set()
        self.piece_of = {p: m for m, ps in sc.bundles.items() for p in ps}
        # copy -> the consumers that run in its task after the key they read
        self.consumers_of: dict[int, tuple] = {}
        self.absorbed: list[int] = []  # how many consumers each such group took
        self.runs: collections.Counter = collections.Counter()  # category -> runs reported

    def _key(self, sub: Submit) -> int:
        """What the model keys a group in flight by: its copy."""
        return sub.copy

    def _fresh_copy(self, sub: Submit) -> None:
        assert sub.copy not in self.copies_seen, ("copy id reused", sub)
        self.copies_seen.add(sub.copy)

    def _moved(self, old: int, again: Submit) -> None:
        """The group of copy ``old`` runs again as ``again``, a new copy."""
        assert again.copy != old, (old, again)
        self._fresh_copy(again)
        self.superseded.append(old)
        del self.inflight[old]
        self.inflight[again.copy] = again
        self.costs[again.copy] = self.costs.pop(old)
        if old in self.consumers_of:
            self.consumers_of[again.copy] = self.consumers_of.pop(old)

    # -- events ---------------------------------------------------------------

    def start(self) -> list:
        out = self.state.start()
        self._apply(out)
        for s in out:  # nothing is measured yet: only consumers come along, as probes
            if isinstance(s, Submit) and not s.returns:
                consumers = self.consumers_of[self._key(s)]
                assert len(s.keys) == 1 + len(consumers), ("fused early", s)
        return out

    def finish(self, gid: int) -> list:
        """Copy ``gid`` finishes."""
        sub = self.inflight.pop(gid)
        self.consumers_of.pop(gid, None)
        self.finished.update(sub.keys)
        self.memory.update(sub.kept)
        self.roots.update(sub.kept)
        self.recovering.difference_update(sub.keys)
        # given values recomputed: the Ray layer heals the owner of each one kept (all
        # are: a given value is never fused away), root or not
        self.given.update(k for k in sub.kept if k in self.sc.available)
        for k in sub.keys:
            self.known[self.sc.categories[k]] = self.sc.durations[self.sc.categories[k]]
            self.runs[self.sc.categories[k]] += 1
        durations = {k: self.sc.durations[self.sc.categories[k]] for k in sub.keys}
        node = f"node{gid % 3}"
        sizes = (8,) * len(sub.kept) if len(sub.kept) > 1 else ()  # each kept value: 8 bytes
        out = self.state.handle(
            TaskFinished(gid, durations, nbytes=8 * len(sub.kept), node=node, sizes=sizes)
        )
        assert all(self.state.tasks[k].node == node for k in sub.kept)
        self._apply(out)
        return out

    def change_capacity(self, slots: int) -> list:
        self.capacity = slots
        out = self.state.handle(CpusChanged(slots))
        self._apply(out)
        return out

    def reorder(self, priorities: dict) -> list:
        """dask.order's priorities come mid-run: the model ranks by them from now on."""
        self.sc = dataclasses.replace(self.sc, priorities=priorities)
        out = self.state.handle(Ordered(priorities))
        self._apply(out)
        return out

    def err(self, gid: int, key, retryable: bool) -> list:
        sub = self.inflight[gid]
        error = RuntimeError(f"boom {self.errors}")
        self.errors += 1
        annotated = max(self.sc.retries.get(k, 0) for k in sub.keys)
        limit = max(annotated, self.sc.default_retries) if retryable else annotated
        out = self.state.handle(TaskErred(gid, key, error, worker_died=retryable))
        self.state.validate_state()
        if sub.attempt < limit:
            out = [_same_notify(i, sub) for i in out]
            assert len(out) == 1 and isinstance(out[0], Submit), (sub, out)
            again = dataclasses.replace(sub, copy=out[0].copy, attempt=sub.attempt + 1)
            assert out == [again], (sub, out)
            self._moved(gid, again)
            self.retried += 1
            return out
        del self.inflight[gid]
        self._check_stop(out)
        assert_fails(out[-1], key, error, retryable)
        assert sum(isinstance(i, Fail) for i in out) == 1, out
        self.outcome = "failed"
        return out

    def node_lost(self, gid: int, key, retryable: bool) -> list:
        """The node running copy ``gid`` died: the same group again, as a new copy,
        retries untouched."""
        sub = self.inflight[gid]
        error = ConnectionError(f"node died {self.errors}")
        self.errors += 1
        out = self.state.handle(TaskErred(gid, key, error, worker_died=retryable, node_died=True))
        self.state.validate_state()
        out = [_same_notify(i, sub) for i in out]
        assert len(out) == 1 and isinstance(out[0], Submit), (sub, out)
        again = dataclasses.replace(sub, copy=out[0].copy)
        assert out == [again], (sub, out)
        self._moved(gid, again)
        self.retried += 1
        return out

    def lose(self, keys: tuple, reason: str = "node died") -> list:
        """``keys`` are gone; those held are recomputed with what they need, in one wave."""
        lost = tuple(k for k in keys if k in self.memory)
        lost_set = set(lost)
        if lost_set & self.sc.fixed:  # a given value with no lineage: the compute fails
            out = self.state.handle(ResultsLost(keys, reason))
            self.state.validate_state()
            assert not any(isinstance(i, Recover) for i in out), out
            fail = out[-1]
            self._check_stop(out)
            assert isinstance(fail, Fail) and fail.key in lost_set & self.sc.fixed, out
            assert sum(isinstance(i, Fail) for i in out) == 1, out
            self.outcome = "failed"
            return out

        # What must run again, from the model alone: the lost values, and the
        # released inputs of anything run again, transitively, up to given values
        # (released here, still held by their owner, so held again).
        gone = self.finished - self.memory
        expected: set = set()
        restored: set = set()
        stack = list(lost)
        while stack:
            k = stack.pop()
            if k in expected:
                continue
            expected.add(k)
            for d in self.deps[k]:
                if d in self.given:
                    if d not in self.memory:
                        restored.add(d)
                elif d in gone:
                    stack.append(d)
        # and a group making, but not keeping, a value read by one of these runs again
        # (a shuffle's map running for other pieces, a producer with other consumers)
        read = {d for k in expected for d in self.deps[k]}
        doomed = {
            c
            for c, sub in self.inflight.items()
            if lost_set & set(sub.inputs) or read & (set(sub.keys) - set(sub.kept))
        }

        out = self.state.handle(ResultsLost(keys, reason))
        if not lost:
            self.state.validate_state()
            assert out == [], out
            return out
        recovers = [i for i in out if isinstance(i, Recover)]
        assert len(recovers) == 1, out
        (rec,) = recovers
        self.waves += 1
        assert rec.wave == self.waves, (rec, self.waves)
        assert rec.lost == lost and rec.reason == reason, (rec, lost)
        recompute = set(rec.recompute)
        assert len(recompute) == len(rec.recompute), rec
        assert recompute == expected, (
            "recompute",
            sorted(recompute - expected),
            sorted(expected - recompute),
        )
        assert not recompute & (self.memory - lost_set), ("recomputes a held value", rec)
        for k in recompute - lost_set:  # never a finished key nobody needs
            assert k not in self.memory and self.dependents[k] & recompute, (k, rec)
        cancels = [i.copy for i in out if isinstance(i, Cancel)]
        assert len(cancels) == len(set(cancels)) and set(cancels) == doomed, (cancels, doomed)
        assert not any(isinstance(i, Fail) for i in out), out

        for c in cancels:  # the cancelled run again, as new groups
            sub = self.inflight.pop(c)
            self.consumers_of.pop(c, None)
            self.submitted -= set(sub.keys)
            self.cancelled.append(c)
        for keyset in (self.finished, self.memory, self.released, self.roots, self.submitted):
            keyset -= recompute
        self.given -= recompute  # lost: its owner holds nothing until it is recomputed
        self.lineage_run |= recompute & self.skipped
        self.skipped -= recompute
        self.memory |= restored
        self.restored |= restored
        self.released -= restored
        self.recovering |= recompute
        self._apply([i for i in out if not isinstance(i, Cancel | Recover)])
        return out

    def late(self, gid: int) -> None:
        """A result (or error) of a cancelled copy arrives anyway: nothing changes."""
        st_ = self.state

        def snapshot():
            return (
                {
                    k: (ts.state, ts.missing, ts.waiters, ts.node, ts.nbytes, ts.recovering)
                    for k, ts in st_.tasks.items()
                },
                {c: (cat.count, cat.total) for c, cat in st_.categories.items()},
                set(st_.groups),
                set(st_.copies),
                sorted(map(str, st_.ready)),
                st_.used,
                st_.wave,
            )

        before = snapshot()
        durations = dict.fromkeys(st_.tasks, 1.0)
        assert st_.handle(TaskFinished(gid, durations, 8, node="late")) == []
        err = TaskErred(gid, "x", RuntimeError(), worker_died=True, node_died=True)
        assert st_.handle(err) == []
        assert st_.handle(TaskErred(gid, "x", RuntimeError())) == []
        assert snapshot() == before
        st_.validate_state()

    def abort(self) -> list:
        out = self.state.handle(Aborted())
        self.state.validate_state()
        self._check_stop(out)
        assert not any(isinstance(i, Fail) for i in out), out
        self.outcome = "aborted"
        return out

    def _check_stop(self, out: list) -> None:
        """Failure and abort: cancel all in flight, release all held, submit nothing."""
        assert not any(isinstance(i, Submit) for i in out), out
        cancels = [i.copy for i in out if isinstance(i, Cancel)]
        releases = [i.key for i in out if isinstance(i, Release)]
        assert sorted(cancels) == sorted(self.inflight), (cancels, self.inflight)
        assert sorted(releases) == sorted(self.memory), (releases, self.memory)
        assert self.state.done
        cancelled, self.inflight = self.inflight, {}
        self.memory.clear()
        self.stopped = True
        # results of cancelled copies may still arrive: they must change nothing
        for gid in cancelled:
            assert self.state.handle(TaskFinished(gid, {}, 0)) == []
            assert self.state.handle(TaskErred(gid, "x", RuntimeError(), worker_died=True)) == []
            self.state.validate_state()
        assert self.state.handle(CpusChanged(100)) == []
        assert self.state.handle(ResultsLost(tuple(self.deps))) == []
        assert self.state.done

    # -- instructions ---------------------------------------------------------

    def _cost(self, keys: tuple) -> float:
        """Slots a group of ``keys`` takes: its CPUs, a fraction when measured cheap."""
        r = self.sc.resources.get(keys[0])
        cpus = float(r.get("CPU", 1)) if r else 1.0
        seen = [self.known.get(self.sc.categories[k]) for k in keys]
        # a group with a task not measured yet takes whole CPUs
        estimate = seen[0] if len(keys) == 1 else None if None in seen else sum(seen)
        if estimate is not None and estimate < self.sc.fusion.max_task_duration:
            return cpus * self.sc.cheap_cost
        return cpus

    def _used(self) -> float:
        return sum(self.costs[g] for g in self.inflight)

    def _first_used(self) -> float:
        """Slots taken by first copies: what ready work may have to wait for."""
        return self._used()

    _deferred = False  # duplicates of the same transition are checked after the rest

    def _rank(self, key) -> tuple:
        """Recovery first, then priority."""
        return (key not in self.recovering, self.sc.priorities[key])

    def _boosted(self, key) -> bool:
        """May this task go before its priority says (speculation: see ``SpecDriver``)?"""
        return False

    def _head(self, ready: set):
        """The ready task the state takes next: by rank (speculation: see ``SpecDriver``)."""
        return min(ready, key=self._rank)

    def _ready(self) -> set:
        return {
            k
            for k, deps in self.deps.items()
            if k not in self.submitted and k not in self.finished and deps <= self.finished
        }

    def _apply(self, out: list) -> None:
        assert not self.stopped
        new = []
        for ins in out:
            if isinstance(ins, Submit):
                assert ins.attempt == 0, ins
                self._check_submit(ins)
                new.append(ins)
            elif isinstance(ins, Release):
                self._check_release(ins.key)
            else:
                raise AssertionError(f"unexpected {ins!r} without a failure")
        self.state.validate_state()
        if not self._deferred:
            assert abs(self._used() - self.state.used) < 1e-9, (self._used(), self.state.used)

        ready = self._ready()
        if ready:
            head = self._head(ready)
            for sub in new:  # recovery, then higher priority, first: nothing better waits
                k = sub.keys[0]
                if not self._boosted(k):
                    assert self._rank(k) < self._rank(head), (sub, head)
                else:  # known long, short-handed: before all but recovery
                    assert self._rank(k)[0] <= self._rank(head)[0], (sub, head)
            # and no slot is left idle while work is ready
            assert self.inflight, ("idle with ready work", ready)
            used = self._first_used()
            assert used, ("only duplicates run while work is ready", ready)
            cost = self._cost((head,))
            # (a slow node's CPUs are withheld from first copies)
            limit = self.capacity - self.state.speculator.withheld()
            assert used + cost > limit, ("room left for", head, used, limit)
        elif not self.inflight:  # no deadlock: nothing running, nothing ready means done
            assert self.state.done, ("stuck", self.submitted, self.finished)

    def _check_submit(self, sub: Submit) -> None:
        sc = self.sc
        keys, members = sub.keys, set(sub.keys)
        assert not sub.duplicate, sub
        assert sub.group not in self.groups_seen, sub
        self.groups_seen.add(sub.group)
        self._fresh_copy(sub)
        assert len(members) == len(keys), sub
        assert not members & self.submitted, ("submitted twice", members & self.submitted)
        assert not members & self.finished, ("finished key run again", members & self.finished)
        assert not members & self.given, ("given keys are never run", sub)
        assert not members & self.skipped, ("lineage run though not needed", sub)
        self.submitted |= members

        # capacity: its head fits, or it runs alone; a fused group beside other work
        # takes at most the capacity left
        used = self._used()
        head = self._cost(keys[:1])
        assert used == 0 or used + head <= self.capacity, (sub, used, head, self.capacity)
        bundle = sc.bundles.get(keys[0])
        cost = self._cost(keys[:1] if bundle else keys)
        if used and len(keys) > 1 and not bundle:
            cost = min(cost, self.capacity - used)
        assert used == 0 or used + cost <= self.capacity, (sub, used, cost, self.capacity)
        self.inflight[self._key(sub)] = sub
        self.costs[self._key(sub)] = cost

        assert sub.priority == sc.priorities[sub.root]
        assert sub.resources == sc.resources.get(sub.root)

        # a shuffle's bundle: its map and every piece not made yet, each piece kept
        chain, consumers = keys[:1], ()  # a bundle: its map
        if bundle:
            waiting = [p for p in bundle if p not in self.finished]
            assert keys == (keys[0], *waiting), ("bundle", sub, waiting)
            assert sub.kept == tuple(waiting), sub
            assert self.dependents[keys[0]] - members <= self.finished, sub
        else:
            assert not any(k in self.piece_of for k in keys), ("piece outside its bundle", sub)
            # kept: the outputs and what a task outside the group reads
            kept = tuple(  # and a given value recomputed: handed back to its owner
                k
                for k in keys
                if k in sc.outputs
                or k in sc.available
                or self.dependents[k] - members - self.finished
            )
            assert sub.kept == kept, (sub, kept)
        # shape of a group: topological, inputs held
        for i, k in enumerate(keys):
            inside = self.deps[k] & members
            assert all(keys.index(d) < i for d in inside), ("not topological", sub)
        outside = {d for k in keys for d in self.deps[k]} - members
        assert len(sub.inputs) == len(set(sub.inputs)), sub
        assert set(sub.inputs) == outside, (sub, outside)
        assert outside <= self.memory, ("input not held", outside - self.memory)

        f = sc.fusion
        if len(keys) > 1 and not bundle:  # fusion only as configured, of like tasks
            assert f.enabled, sub
            assert len(keys) <= f.max_group_size, (len(keys), f.max_group_size, sub)
            for k in keys:
                assert sc.resources.get(k) == sc.resources.get(keys[0]), sub
                # the same retries (an annotation of 0 retries is none: the same limit)
                assert sc.retries.get(k, 0) == sc.retries.get(keys[0], 0), sub
        if not bundle:  # a chain of cheap tasks, then what comes along with its last
            why = []
            for chain, consumers in self._splits(keys):
                why.append(self._illegal(sub, chain, consumers))
                if why[-1] is None:
                    break
            assert why[-1] is None, ("no legal split", sub, why)
        self.consumers_of[self._key(sub)] = consumers
        if consumers:
            self.absorbed.append(len(consumers))
        self.submits.append(sub)

    def _splits(self, keys: tuple):
        """A group's possible splits into a chain (up to the key its consumers read)
        and its consumers: the whole group a chain first, then the latest lead first."""
        yield keys, ()
        for i in range(len(keys) - 1, 0, -1):
            yield keys[:i], keys[i:]

    def _illegal(self, sub, chain: tuple, consumers: tuple):
        """Why the group is not ``chain`` then ``consumers``, or None if it is."""
        sc, f = self.sc, self.sc.fusion
        members = set(sub.keys)
        for k in chain[:-1]:  # each member's value used inside alone
            if k in sc.outputs:
                return ("output fused away", k)
            if k in sc.available:
                return ("given value fused away: owner not healed", k)
            if len(self.dependents[k]) != 1:
                return ("shared value fused away", k)
            if not self.dependents[k] <= set(chain):
                return ("chain member read outside the chain", k)
        if len(chain) > 1:  # a chain of known-cheap tasks
            for k in chain:
                seen = self.known.get(sc.categories[k])
                if seen is None or seen >= f.max_task_duration:
                    return ("chain member not known cheap", k)
            total = sum(sc.durations[sc.categories[k]] for k in chain)
            if total > f.max_group_duration + 1e-9:
                return ("chain too long", total)
        if not consumers:
            return None
        # every consumer still to run of the chain's last, and cheap tasks reading
        # nothing but the group's values and values in memory, within budget
        lead = chain[-1]
        if lead in sc.outputs or lead in sc.available:
            return ("lead kept anyway", lead)
        if not self.dependents[lead] - self.finished <= set(consumers):
            return ("not all consumers", lead)
        inside = {lead, *consumers}
        for c in consumers:
            if self.deps[c] & members - inside:
                return ("consumer reads a chain member other than the lead", c)
            if lead not in self.deps[c] and self.runs[sc.categories[c]] >= PROBES:
                seen = self.known.get(sc.categories[c])
                if seen is None or seen >= f.max_task_duration:
                    return ("a consumer of consumers not cheap", c)
        known = [
            self.known.get(sc.categories[c]) if self.runs[sc.categories[c]] >= PROBES else None
            for c in consumers
        ]
        total = sum(k for k in known if k is not None)
        led = self.known.get(sc.categories[lead])
        whole = total + sum(self.known.get(sc.categories[k]) or 0.0 for k in chain)
        if not (
            (total < f.max_task_duration and whole <= f.max_group_duration + 1e-9)
            or (led is not None and total <= led * CONSUMERS_SHARE)
        ):
            return ("consumers too slow to follow", total, led)
        probes = {sc.categories[c] for c, k in zip(consumers, known, strict=True) if k is None}
        others = [g for gid, g in self.inflight.items() if gid != self._key(sub)]
        running = collections.Counter(sc.categories[k] for g in others for k in g.keys)
        if probes & {sc.categories[k] for k in chain}:  # a probe apart from its category
            return ("probe beside its category in its chain", probes)
        crowded = {c for c in probes if running[c] >= PROBES}  # fewer than PROBES in flight
        if crowded:
            return ("probes of a category past PROBES in flight", crowded)
        return None

    def _check_release(self, key) -> None:
        assert key in self.memory, ("released a value not held", key)
        assert key not in self.sc.outputs, ("released an output", key)
        assert self.dependents[key] <= self.finished, (
            "released while needed",
            key,
            self.dependents[key] - self.finished,
        )
        self.memory.remove(key)
        self.released.add(key)

    # -- end of a successful run ---------------------------------------------

    def check_complete(self) -> None:
        sc, st_ = self.sc, self.state
        assert not self.inflight
        assert st_.done
        assert self.submitted == set(self.deps) - self.skipped
        assert self.finished == set(self.deps)
        assert not self.recovering
        assert self.memory == sc.outputs
        assert self.released == (self.roots | sc.available) - sc.outputs
        for k in self.deps:
            assert st_.tasks[k].state == ("memory" if k in sc.outputs else "released"), k
        assert not recovering(st_)
        self.outcome = "completed"

    def label(self) -> None:
        """What a run exercised, for ``--hypothesis-show-statistics``."""
        largest = max((len(s.keys) for s in self.submits), default=0)
        event("fused" if largest > 1 else "not fused")
        if largest * CHEAP >= self.sc.fusion.max_task_duration:
            event("fused a group too long to be cheap")
        if self.absorbed:
            event(
                "consumers ran in their producer's task"
                + (", several" if max(self.absorbed) > 1 else "")
            )
        event(self.outcome + (", retried" if self.retried else ""))
        if self.waves:
            event(f"recovered {min(self.waves, 3)}{'+' if self.waves > 3 else ''} waves")
        if self.cancelled:
            event("recovery cancelled groups")
        if self.restored:
            event("given values held again for a recovery")
        if self.lineage_run:
            event("given values or their lineage recomputed")


def run_to_end(d: Driver, pick: Callable[[list], int]) -> None:
    d.start()
    while d.inflight:
        d.finish(pick(sorted(d.inflight)))
    d.check_complete()


# ---- properties -----------------------------------------------------------------


@pytest.mark.core_only
@SETTINGS
@given(sc=scenarios(fusion=False), data=st.data())
def test_random_runs_without_fusion(sc, data):
    """Each key once, nothing freed early, everything else freed, priority order kept."""
    d = Driver(sc)
    run_to_end(d, lambda gids: data.draw(st.sampled_from(gids)))
    assert all(len(s.keys) == 1 for s in d.submits)
    d.label()


@pytest.mark.core_only
@SETTINGS
@given(sc=scenarios(fusion=True), data=st.data())
def test_random_runs_with_fusion(sc, data):
    """The same guarantees hold when cheap tasks are fused into groups."""
    d = Driver(sc)
    run_to_end(d, lambda gids: data.draw(st.sampled_from(gids)))
    d.label()


@pytest.mark.core_only
@SETTINGS
@given(sc=scenarios(), data=st.data())
def test_random_capacity_changes(sc, data):
    """Capacity moving while running: new submits respect the new capacity."""
    d = Driver(sc)
    d.start()
    while d.inflight:
        if data.draw(st.integers(0, 5)) == 5:  # mostly finish; 0 shrinks to finishing
            d.change_capacity(data.draw(st.integers(1, 4)))
        else:
            d.finish(data.draw(st.sampled_from(sorted(d.inflight))))
    d.check_complete()
    d.label()


@pytest.mark.core_only
@SETTINGS
@given(sc=scenarios(), data=st.data())
def test_random_runs_reordered_midway(sc, data):
    """The whole graph's order arriving while the compute runs on a provisional one
    (``Ordered``, at any point, maybe twice): the same guarantees, and every choice
    after it by the new priorities."""
    d = Driver(sc)
    d.start()
    keys = list(sc.dependencies)
    while d.inflight:
        if data.draw(st.integers(0, 4)) == 4:
            ranks = data.draw(st.permutations(range(len(keys))))
            d.reorder(dict(zip(keys, ranks, strict=True)))
        else:
            d.finish(data.draw(st.sampled_from(sorted(d.inflight))))
    d.check_complete()


@pytest.mark.core_only
@pytest.mark.parametrize("fusion", [False, True])
@SETTINGS
@given(data=st.data())
def test_random_failures_and_aborts(fusion, data):
    """Errors retry as annotated then fail; failure and abort stop and free everything."""
    fail_at_random(Driver(data.draw(scenarios(fusion=fusion))), data)


def fail_at_random(d: Driver, data: st.DataObject) -> None:
    """Run ``d`` to its end or its failure, with errors and aborts at random points."""
    d.start()
    while d.inflight:
        gid = data.draw(st.sampled_from(sorted(d.inflight)))
        action = data.draw(st.sampled_from(["finish"] * 6 + ["err", "retryable", "abort"]))
        if action == "finish":
            d.finish(gid)
        elif action == "abort":
            d.abort()
        else:
            key = data.draw(st.sampled_from(d.inflight[gid].keys))
            d.err(gid, key, retryable=action == "retryable")
    if d.stopped:
        assert d.state.done and not d.memory
    else:
        d.check_complete()
    d.label()


@pytest.mark.core_only
@pytest.mark.parametrize("fusion", [False, True])
@SETTINGS
@given(data=st.data())
def test_random_lost_results(fusion, data):
    """Values lost at random points, nodes dying under running tasks: every run recovers.

    Each loss of held values is one wave recomputing exactly them and the released
    inputs they need, ahead of other work; readers in flight are cancelled and rerun;
    losing a given value fails the compute if it has no lineage here (``fixed``), else
    reruns it; a dead node never uses up retries.
    """
    lose_at_random(Driver(data.draw(scenarios(fusion=fusion))), data)


def lose_at_random(d: Driver, data: st.DataObject) -> None:
    """Run ``d`` to its end, losing values and nodes at random points."""
    keys = sorted(d.deps)
    d.start()
    losses = node_deaths = lates = 0
    while not d.stopped:
        actions = ["finish"] * 5 if d.inflight else []
        if losses < 4 and d.memory:
            actions += ["lose"] * (3 if d.inflight else 1)
        if d.inflight and node_deaths < 4:
            actions += ["node lost", "input lost"]
        if (d.cancelled or d.superseded) and lates < 4:
            actions.append("late")
        if not d.inflight:
            actions.append("end")
        action = data.draw(st.sampled_from(actions))
        if action == "end":
            break
        if action == "finish":
            d.finish(data.draw(st.sampled_from(sorted(d.inflight))))
        elif action == "late":
            lates += 1
            d.late(data.draw(st.sampled_from(d.cancelled + d.superseded)))
        elif action == "lose":
            losses += 1
            fixed_too = data.draw(st.integers(0, 9)) == 0  # which fails the compute
            held = sorted(d.memory if fixed_too else d.memory - d.sc.fixed)
            lost = data.draw(st.lists(st.sampled_from(held), unique=True)) if held else []
            other = data.draw(st.lists(st.sampled_from(keys), max_size=2, unique=True))
            lost += [k for k in other if k not in lost]
            d.lose(tuple(data.draw(st.permutations(lost))))
        else:
            node_deaths += 1
            gid = data.draw(st.sampled_from(sorted(d.inflight)))
            sub = d.inflight[gid]
            if action == "input lost":  # as the Ray layer reports it: inputs, then the error
                held = sorted(set(sub.inputs) - d.sc.fixed)
                lost = data.draw(st.lists(st.sampled_from(held), unique=True)) if held else []
                if lost:
                    d.lose(tuple(lost), f"input of {sub.root!r} lost")
            if gid in d.inflight:
                d.node_lost(gid, data.draw(st.sampled_from(sub.keys)), data.draw(st.booleans()))
            else:  # cancelled by the loss of its input: the error changes nothing
                d.late(gid)
    if d.stopped:
        assert d.outcome == "failed" and d.state.done and not d.memory
    else:
        d.check_complete()
    d.label()


class SpecDriver(Driver):
    """``Driver`` with speculative duplicates: copies start, tick, win, lose and die.

    ``inflight`` keeps each group's first Submit while the group runs, keyed by the
    group's id (``_key``); ``live`` its running copies (the first, duplicates), each
    with an id of its own; ``group_of`` each live copy's group.
    """

    NODES = ("node0", "node1", "node2")

    def __init__(self, sc: Scenario):
        super().__init__(sc)
        self.live: dict[int, set] = {}  # group -> its live copies
        self.group_of: dict[int, int] = {}  # live copy -> its group
        self.dups: dict[int, Submit] = {}  # duplicate copy id -> its Submit
        self.insurable: set[int] = set()  # of them, those that may be insurance
        self.node: dict[int, str] = {}  # copy -> node, once known
        self.started: dict[int, float] = {}
        self.now = 0.0
        self.idle: dict[str, float] = {}
        # copies cancelled or dead: their late results change nothing
        self.copy_cancels: list[int] = []
        self.dup_wins = self.preempted = self.spared = self.n_dups = 0
        self.launched: dict[int, int] = {}  # group -> duplicates started
        self.via_tick = False  # the instructions being checked answer a Tick

    def _key(self, sub: Submit) -> int:
        return sub.group

    def _boosted(self, key) -> bool:
        """Known long while a node straggles (``short_handed``), fed long work, or a
        feeder of long work while none of that is ready: it may go first
        (``long_work_first``)."""
        sp = self.state.speculator
        if sp.short_handed() and sp.known_long(key):
            return True
        if sp.fed_long(key):
            return True
        return sp.feeds_long(key) and not any(sp.fed_long(k) for k in self._ready())

    def _head(self, ready: set):
        """In the state's precedence (``State.next_ready``), each never ahead of a
        recovery wave: fed long work; else, while long tasks hold less than half the
        slots, a feeder of long work; else, short-handed, a task known long; else rank.
        A feeder that needs more slots than are free so goes first all the same, and
        blocks the rest (``_fill``) as any head does."""
        sp, tasks = self.state.speculator, self.state.tasks
        head = super()._head(ready)
        kinds = []
        if not self.state.placer.any_full:
            fed = [k for k in ready if sp.fed_long(k)]
            running = [ts for ts in tasks.values() if ts.state == PROCESSING]
            long = sum(ts.category in sp.lasts_long for ts in running)
            feeders = [k for k in ready if sp.feeds_long(k)]
            kinds.append(fed or (feeders if 2 * long < self.state.capacity else []))
        if sp.short_handed():
            kinds.append([k for k in ready if sp.known_long(k)])
        for kind in kinds:
            first = min(kind, key=self._rank, default=None)
            if first is not None and self._rank(first)[0] <= self._rank(head)[0]:
                return first
        return head

    def copy_group(self, cid: int) -> int:
        return self.group_of[cid]

    def _used(self) -> float:
        return sum(self.costs[g] * len(self.live[g]) for g in self.inflight)

    def _first_used(self) -> float:
        return sum(self.costs[g] for g in self.inflight)

    def _forget_copy(self, cid: int) -> None:
        gid = self.group_of.pop(cid)
        self.live[gid].discard(cid)
        self.dups.pop(cid, None)
        self.insurable.discard(cid)
        self.node.pop(cid, None)
        self.started.pop(cid, None)

    def _apply(self, out: list) -> None:
        rest, dups = [], []
        for ins in out:
            if isinstance(ins, Cancel):  # a spare duplicate, so that ready work runs
                assert ins.copy in self.dups and len(self.live[self.copy_group(ins.copy)]) > 1
                self._forget_copy(ins.copy)
                self.copy_cancels.append(ins.copy)
                self.preempted += 1
            elif isinstance(ins, Submit) and ins.duplicate:
                dups.append(ins)
            else:
                rest.append(ins)
        for ins in rest:
            if isinstance(ins, Submit):
                assert ins.group not in self.live, ("a group submitted twice", ins)
                self.live[ins.group] = {ins.copy}
                self.group_of[ins.copy] = ins.group
                self.started.pop(ins.copy, None)
                self.node.pop(ins.copy, None)
        self._deferred = bool(dups)
        try:
            super()._apply(rest)
        finally:
            self._deferred = False
        for sub in dups:
            self._check_duplicate(sub)
        self.via_tick = False
        self.state.validate_state()
        assert abs(self._used() - self.state.used) < 1e-9, (self._used(), self.state.used)

    def _check_duplicate(self, sub: Submit) -> None:
        sp = self.sc.speculation
        assert sub.duplicate, sub
        gid = sub.group  # the group it duplicates
        first = self.inflight[gid]
        self._fresh_copy(sub)
        assert (sub.keys, sub.inputs, sub.attempt) == (first.keys, first.inputs, first.attempt)
        assert sub.returns == first.returns, sub
        consumers = self.consumers_of[gid]
        assert len(sub.keys) == 1 + len(consumers), ("only lone tasks are duplicated", sub)
        assert set(self.sc.resources.get(sub.root) or ()) <= {"CPU"}, sub
        assert not self._ready(), ("duplicate while work is ready", sub)
        assert all(c in self.node for c in self.live[gid]), ("a copy's node unknown", sub)
        assert sub.node not in {self.node[c] for c in self.live[gid]}, ("same node", sub)
        if not self.via_tick:  # between ticks: only while no copy may be bound for a CPU
            unknown = [c for g in self.inflight for c in self.live[g] if c not in self.node]
            assert not unknown, ("a copy in flight not known started", sub, unknown)
        cpus = self._cpus(sub.root)
        assert self.idle.get(sub.node, 0) >= cpus, (sub, self.idle)
        self.idle[sub.node] -= cpus
        ran = self.now - min(self.started[c] for c in self.live[gid] if c in self.started)
        lead = sub.keys[len(sub.keys) - 1 - len(consumers)]  # what the copy runs for
        mean = self.known.get(self.sc.categories[lead])  # every run of it alike
        known_long = sp.long_task is not None and mean is not None and mean >= sp.long_task
        # at the tail a straggler needs no min-runtime: overdue (past multiplier times
        # its category's runtime, or min-gain past it: every run alike), or on a node
        # judged slow
        on_slow = any(self.state.speculator.slow(self.node[c]) for c in self.live[gid])
        over = None if mean is None else min(sp.multiplier * mean, mean + sp.min_gain)
        straggler = on_slow or (over is not None and ran > over)
        straggler = straggler or mean is None  # past 1.5x the longest run of any category
        # or its node's runs weigh a pace above 1 (``posterior``): the weighed saving
        weighed = any(
            self.state.speculator.posterior(self.node[c]) is not None
            and self.state.speculator.expected_pace(self.node[c]) > 1
            for c in self.live[gid]
        )
        assert known_long or straggler or weighed or ran >= sp.min_runtime, (ran, sub)
        assert len(self.live[gid]) <= sp.max_copies, ("too many copies", sub)
        self.launched[gid] = self.launched.get(gid, 0) + 1
        # a straggler whose duplicates all went (preempted, dead) may get another
        assert self.launched[gid] <= sp.max_copies or straggler, ("too many duplicates", sub)
        # beyond max-in-flight only insurance: a copy of a task that lasts long-task
        # (its category's runs, every one alike; or, none known, its own run so far)
        lasts = sp.long_task is not None and (mean if mean is not None else ran) >= sp.long_task
        capped = [d for d in self.dups if d not in self.insurable]
        assert lasts or len(capped) < sp.max_in_flight, ("too many duplicates", sub)
        if lasts:
            self.insurable.add(sub.copy)
        self.live[gid].add(sub.copy)
        self.group_of[sub.copy] = gid
        self.dups[sub.copy] = sub
        self.node[sub.copy] = sub.node
        self.n_dups += 1
        assert self._used() <= self.capacity + 1e-9, ("duplicate beyond capacity", sub)

    # -- events ---------------------------------------------------------------

    def _cpus(self, root) -> float:
        return float((self.sc.resources.get(root) or {}).get("CPU", 1))

    def tick(self, dt: float, idle: dict) -> list:
        self.now += dt
        self.idle = dict(idle)
        self.via_tick = True
        out = self.state.handle(Tick(self.now, idle))
        self._apply(out)
        return out

    def start_copy(self, cid: int, node: str) -> list:
        """Copy ``cid`` says it started: its node's CPU is taken (a duplicate's was
        taken when it was sent); a duplicate may follow at once onto a free CPU."""
        node = self.node.get(cid, node)
        self.node[cid] = node
        self.started[cid] = self.now
        if cid not in self.dups:
            cpus = self._cpus(self.inflight[self.copy_group(cid)].root)
            self.idle[node] = max(0.0, self.idle.get(node, 0) - cpus)
        out = self.state.handle(TaskStarted(cid, node, self.now))
        # a duplicate, or a first copy: a start on a slow node frees a withheld slot
        assert all(
            isinstance(i, Submit) and (i.duplicate or self.state.speculator.slow(node)) for i in out
        ), out
        self._apply(out)
        return out

    def finish_copy(self, cid: int) -> list:
        gid = self.copy_group(cid)
        sub = self.inflight[gid]
        losers = self.live[gid] - {cid}
        node = self.node.get(cid, "nodeX")
        durations = {k: self.sc.durations[self.sc.categories[k]] for k in sub.keys}
        started = self.started.get(cid, 0.0)
        if started:  # it ended at its start plus its runtime: the clock is past that
            self.now = max(self.now, started + sum(durations.values()))
        # its CPU is free now, as far as the state machine can tell
        self.idle[node] = max(self.idle.get(node, 0), self._cpus(sub.root))
        out = self.state.handle(TaskFinished(cid, durations, 8, node=node, started=started))
        wons = [i for i in out if isinstance(i, Won)]
        cancels = [i.copy for i in out if isinstance(i, Cancel) and i.copy in losers]
        assert sorted(cancels) == sorted(losers), (cancels, losers, out)
        if cid in self.dups:
            assert len(wons) == 1 and wons[0].copy == cid and set(wons[0].losers) == losers
            lead = sub.keys[0] if sub.returns else sub.keys[len(sub.keys) - 1 - len(
                self.consumers_of[gid])]  # fmt: skip
            assert wons[0].group == gid and wons[0].key == lead and wons[0].saved >= 0
            self.dup_wins += 1
        else:
            assert not wons, out
        for c in losers:
            self._forget_copy(c)
            self.copy_cancels.append(c)
        self._forget_copy(cid)
        del self.live[gid]
        assert all(self.state.tasks[k].node == node for k in sub.kept)
        # the model's bookkeeping of a finished group (as Driver.finish)
        self.inflight.pop(gid)
        self.consumers_of.pop(gid, None)
        self.finished.update(sub.keys)
        self.memory.update(sub.kept)
        self.roots.update(sub.kept)
        self.recovering.difference_update(sub.keys)
        for k in sub.keys:
            self.known[self.sc.categories[k]] = self.sc.durations[self.sc.categories[k]]
            self.runs[self.sc.categories[k]] += 1
        rest = [i for i in out if not isinstance(i, Won) and not (
            isinstance(i, Cancel) and i.copy in losers)]  # fmt: skip
        self._apply(rest)
        return out

    def copy_node_lost(self, cid: int) -> list:
        """The node running copy ``cid`` died: another copy carries on, or it runs again."""
        gid = self.copy_group(cid)
        sub = self.inflight[gid]
        others = self.live[gid] - {cid}
        out = self.state.handle(TaskErred(cid, sub.root, ConnectionError(), node_died=True))
        self.state.validate_state()
        self._forget_copy(cid)
        self.copy_cancels.append(cid)  # a late report of it is no one's any more
        if others:
            assert out == [], ("restarted though a copy runs on", out)
            self.spared += 1
            # the copy left stands alone, as a first copy: it may be duplicated again
            self.launched[gid] = max(0, self.launched.get(gid, 0) - 1)
        else:
            # the retry goes where Ray puts it (the first may have been sent to the node
            # where a duplicate had just won), away from a slow node, or at the tail
            # to the free node of least pace: waiting for that node, unless another copy
            # whose node Ray chooses is unstarted (``Speculator.place``; this one, if
            # spilled, is counted in ``unplaced`` too)
            assert all(
                (i.node is None and i.spill)
                or (i.placed.startswith("away from slow") and not i.spill)
                or (i.placed.startswith("the tail:") and (not i.spill or self.state.unplaced > 1))
                for i in out
                if isinstance(i, Submit)
            ), (out, self.state.unplaced)
            out = [
                dataclasses.replace(
                    _same_notify(i, sub), node=sub.node, soft=sub.soft, spill=sub.spill
                )
                for i in out
            ]
            out = [dataclasses.replace(i, placed=sub.placed) for i in out]
            assert len(out) == 1 and isinstance(out[0], Submit), (sub, out)
            again = dataclasses.replace(sub, copy=out[0].copy)  # a new copy of the group
            assert out == [again] and again.copy != cid, (sub, out)
            self._fresh_copy(again)
            self.inflight[gid] = again
            self.live[gid] = {again.copy}
            self.group_of[again.copy] = gid
            self.retried += 1
        assert abs(self._used() - self.state.used) < 1e-9, (self._used(), self.state.used)
        return out


@st.composite
def speculative(draw) -> Scenario:
    sc = draw(scenarios(fusion=draw(st.booleans())))
    # mostly slow categories: cheap ones are never duplicated
    sc.durations = {c: draw(st.sampled_from([CHEAP, SLOW, SLOW])) for c in sc.durations}
    sc.speculation = Speculation(
        enabled=True,
        quantile=draw(st.sampled_from([None, 0.5, 0.95])),
        min_samples=draw(st.integers(1, 3)),
        long_task=draw(st.sampled_from([None, 0.01, 1.0, 100.0])),
        min_runtime=draw(st.sampled_from([0.0, 0.5, 2.0])),
        max_in_flight=draw(st.integers(1, 3)),
        max_copies=draw(st.integers(1, 2)),
        slow_node=draw(st.sampled_from([None, 3.0])),  # every run of a category alike: none
    )
    return sc


@pytest.mark.core_only
@settings(SETTINGS, max_examples=300)
@given(sc=speculative(), data=st.data())
def test_random_runs_with_duplicates(sc, data):
    """Copies start, finish in any order and die with their nodes: each result is taken
    once (from the first copy to finish, the others cancelled), releases stay right,
    duplicates go only to idle CPUs of other nodes, within their caps, never ahead of
    ready work, and a copy dying while another runs restarts nothing."""
    d = SpecDriver(sc)
    d.start()
    lates = 0
    while d.inflight:
        copies = sorted(c for g in d.inflight for c in d.live[g])
        unstarted = [c for c in copies if c not in d.started]
        actions = ["finish"] * 2 + ["tick"] * 2 + (["start"] * 3 if unstarted else [])
        if any(len(d.live[g]) > 1 for g in d.inflight):
            actions += ["node lost"]
        if d.copy_cancels and lates < 3:
            actions.append("late")
        action = data.draw(st.sampled_from(actions))
        if action == "finish":
            d.finish_copy(data.draw(st.sampled_from(copies)))
        elif action == "start":
            d.start_copy(data.draw(st.sampled_from(unstarted)), data.draw(st.sampled_from(d.NODES)))
        elif action == "tick":
            idle = {n: data.draw(st.sampled_from([0, 1, 1, 2])) for n in d.NODES}
            d.tick(data.draw(st.sampled_from([0.1, 1.0, 3.0])), idle)
        elif action == "late":
            lates += 1
            d.late(data.draw(st.sampled_from(d.copy_cancels)))
        else:
            d.copy_node_lost(data.draw(st.sampled_from(copies)))
    d.check_complete()
    assert not d.state.copies and not d.state.speculator.in_flight
    d.label()
    event("duplicated" if d.n_dups else "no duplicate")
    if d.dup_wins:
        event("a duplicate won")
    if d.preempted:
        event("a duplicate was preempted")
    if d.spared:
        event("a copy died while another ran on")


class PlacementDriver(Driver):
    """The model under store pressure: values live on nodes of known fullness.

    It keeps its own count of each node's store and free CPUs: the latest sample,
    plus what each placement adds (the inputs it fetches, a value like its
    category's, its CPUs). From it, every first copy's node is predicted: none while
    no store is crowded (Ray decides), nor for small values or custom resources;
    else where its inputs are unless that node is crowded, else the roomiest node
    with a free CPU, never a full one; none if every store is full. While a store
    is full, ready work that reads intermediates goes before work that reads none.
    """

    NODES = ("node0", "node1", "node2")  # where Driver.finish puts values
    CAP = 1000
    NBYTES = 8  # Driver.finish's value size

    def __init__(self, sc: Scenario):
        self.full: set = set()
        self.stores: dict = {}  # node -> used bytes, as counted
        self.idle: dict = {}
        self.sizes: dict = {}  # category -> the size of its values (all alike)
        self.where: dict = {}
        self.placed = 0
        super().__init__(sc)

    def finish(self, gid: int) -> list:
        sub = self.inflight[gid]
        for k in sub.kept:
            self.sizes[self.sc.categories[k]] = self.NBYTES
            self.where[k] = f"node{gid % 3}"
        return super().finish(gid)

    def sample(self, used: dict, idle: dict) -> list:
        self.stores, self.idle = dict(used), dict(idle)
        self.full = self._crowding()[0]
        out = self.state.handle(StoresSampled({n: (u, self.CAP) for n, u in used.items()}, idle))
        self._apply(out)
        return out

    def _crowding(self) -> tuple[set, set]:
        p = self.sc.placement
        low = min(self.stores.values(), default=0)
        full = {n for n, u in self.stores.items() if u > p.high_water * self.CAP}
        heavy = {
            n
            for n, u in self.stores.items()
            if u > p.high_water / 2 * self.CAP and u - low > p.balance * self.CAP
        }
        return full, full | heavy

    def _rank(self, key) -> tuple:
        rank = super()._rank(key)
        return (self.deps[key] <= self.sc.available, *rank) if self.full else rank

    def _expected_node(self, sub: Submit) -> str | None:
        full, crowded = self._crowding()
        size = self.sizes.get(self.sc.categories[sub.root])
        r = self.sc.resources.get(sub.root) or {}
        custom = set(r) - {"CPU", "GPU", "memory"}
        if not crowded or size is None or size < self.sc.placement.min_output or custom:
            return None
        held: dict = {}
        for d in sub.inputs:
            if d in self.where and d not in self.sc.available:
                held[self.where[d]] = held.get(self.where[d], 0) + self.NBYTES
        best = max(held, key=lambda n: (held[n], n)) if held else None
        if best is not None and best not in crowded:
            node = best
        else:
            roomy = [n for n in self.NODES if n not in crowded]
            cpus = float(r.get("CPU", 1))
            free = [n for n in roomy if self.idle.get(n, 0) >= cpus]
            some = free or roomy or [n for n in self.NODES if n not in full]
            if not some:
                return None
            node = max(some, key=lambda n: (self.CAP - self.stores[n], n))
        self.idle[node] = self.idle.get(node, 0) - float(r.get("CPU", 1))
        self.stores[node] += sum(b for n, b in held.items() if n != node) + size
        return node

    def _check_submit(self, sub: Submit) -> None:
        super()._check_submit(sub)
        node = self._expected_node(sub) if self.stores else None
        assert sub.node == node, (sub, node, self.stores)
        assert sub.soft == (node is not None) and bool(sub.placed) == sub.soft, sub
        assert sub.spill, sub  # placed for its inputs: elsewhere rather than wait
        self.placed += node is not None


@pytest.mark.core_only
@SETTINGS
@given(sc=scenarios(), data=st.data())
def test_random_runs_under_store_pressure(sc, data):
    """Samples of store fullness arrive at random: placement never picks a full node,
    prefers the node holding the inputs, and puts consumers first while a store is
    full; release, order and capacity stay right."""
    sc.placement = Placement(
        enabled=True,
        high_water=data.draw(st.sampled_from([0.5, 0.8])),
        balance=data.draw(st.sampled_from([0.05, 0.1, 0.5])),
        min_output=data.draw(st.sampled_from([0, 8, 9])),  # values are 8 bytes
    )
    d = PlacementDriver(sc)
    d.start()
    while d.inflight:
        if data.draw(st.integers(0, 3)) == 3:  # mostly finish: the simplest run ends
            level = st.sampled_from([0, 100, 600, 900, 1000])
            used = {n: data.draw(level) for n in d.NODES}
            idle = {n: data.draw(st.sampled_from([0, 1, 2])) for n in d.NODES}
            d.sample(used, idle)
        else:
            d.finish(data.draw(st.sampled_from(sorted(d.inflight))))
    d.check_complete()
    d.label()
    event("placed some" if d.placed else "placed none")
    event("a store full at the end" if d.full else "no store full at the end")


def test_placement_steers_off_a_full_node_and_consumers_go_first():
    deps = {"a": set(), "b": set(), "x": {"a"}, "y": {"b"}, "s": set(), "z": {"x", "y", "s"}}
    prio = {"s": 0, "a": 1, "b": 2, "x": 3, "y": 4, "z": 5}
    one_kind = {
        "category": lambda k: "c",
        "placement": Placement(enabled=True, min_output=0),
        "fusion": NO_FUSION,
    }
    s = State(deps, prio, ["z"], capacity=2, **one_kind)
    first = submits(s.start())
    assert [f.root for f in first] == ["s", "a"] and all(f.node is None for f in first)
    (b,) = submits(s.handle(TaskFinished(first[1].copy, {"a": 1.0}, 500, "n0")))
    assert b == Submit(b.copy, b.group, ("b",), (), 2, None, notify=True)
    assert b.copy not in {f.copy for f in first} and b.group not in {f.group for f in first}
    # n0 (holding a) is full, n1 has the most free store and a free CPU
    stores = {"n0": (900, 1000), "n1": (100, 1000), "n2": (300, 1000)}
    assert s.handle(StoresSampled(stores, {"n0": 1, "n1": 1, "n2": 1})) == []
    (x,) = submits(s.handle(TaskFinished(first[0].copy, {"s": 1.0}, 10, "n2")))
    assert (x.root, x.node, x.soft, x.spill) == ("x", "n1", True, True) and "n0" in x.placed
    s.validate_state()
    # n1 counts x's input it fetches and a value of its category's mean size
    assert node_stores(s)["n1"] == (100 + 500 + 255, 1000) and full_nodes(s) == {"n0", "n1"}
    (y,) = submits(s.handle(TaskFinished(b.copy, {"b": 1.0}, 100, "n2")))
    assert (y.root, y.node) == ("y", "n2")  # b's node, not full: locality
    s.validate_state()
    # store pressure: a ready consumer goes before a ready source of better priority
    deps = {"src1": set(), "src2": set(), "use": {"src1"}, "end": {"use", "src2"}}
    prio = {"src1": 0, "src2": 1, "use": 2, "end": 3}
    s = State(deps, prio, ["end"], capacity=1, **one_kind)
    (a,) = submits(s.start())
    s.handle(StoresSampled({"n0": (950, 1000), "n1": (0, 1000)}, {"n1": 1}))
    (b,) = submits(s.handle(TaskFinished(a.copy, {"src1": 1.0}, 10, "n0")))
    assert b.root == "use"  # not src2, though src2 ranks first
    s.validate_state()


def test_placement_off_ignores_samples():
    s = State({"a": set(), "b": {"a"}}, {"a": 0, "b": 1}, ["b"], capacity=1, fusion=NO_FUSION)
    (a,) = submits(s.start())
    s.handle(StoresSampled({"n0": (999, 1000), "n1": (0, 1000)}, {"n1": 1}))
    (b,) = submits(s.handle(TaskFinished(a.copy, {"a": 1.0}, 10, "n0")))
    assert b.node is None and not full_nodes(s)


# ---- examples -------------------------------------------------------------------


def spec_state(dependencies: dict, outputs, **kwargs) -> State:
    sp = Speculation(enabled=True, quantile=None, long_task=1.0, min_runtime=0.5, slow_node=None)
    return make(dependencies, outputs, speculation=kwargs.pop("speculation", sp), **kwargs)


def test_duplicate_goes_to_another_idle_node_and_first_result_wins():
    s = spec_state({"a": set(), "b": {"a"}}, ["b"], capacity=3)
    (first,) = submits(s.start())
    assert first.notify and first.node is None
    assert s.handle(TaskStarted(first.copy, "n0", 100.0)) == []
    # not yet long (0.3 s < min-runtime), then no idle node but its own
    assert s.handle(Tick(100.3, {"n0": 1, "n1": 1})) == []
    assert s.handle(Tick(102.0, {"n0": 1})) == []
    (dup,) = submits(s.handle(Tick(102.5, {"n0": 1, "n1": 1, "n2": 2})))
    assert (dup.duplicate, dup.group, dup.node, dup.keys) == (True, first.group, "n2", first.keys)
    assert dup.copy != first.copy
    assert (dup.notify, dup.notify_after) == (True, 0.0)  # its start matters at once
    assert s.used == 2
    s.validate_state()
    assert s.handle(Tick(103.0, {"n1": 1})) == []  # max-copies: one duplicate per task
    out = s.handle(TaskFinished(dup.copy, {"a": 2.0}, 8, "n2", 102.6))
    won = [i for i in out if isinstance(i, Won)]
    assert won == [Won("a", first.group, dup.copy, (first.copy,), won[0].saved, won[0].reason)]
    assert won[0].saved == pytest.approx(2.6)  # the original's head start
    assert Cancel(first.copy) in out and s.tasks["a"].node == "n2"
    # where the loser runs: its worker may go down with it (a spare one is started)
    assert [i.node for i in out if isinstance(i, Cancel)] == ["n0"]
    (b,) = submits(out)
    assert b.keys == ("b",)
    # to the winner's node, where a CPU and a worker are free (the loser's is stopped)
    # and waits for its CPU there, not spilled at once to the one Ray sees free: n0's
    assert (b.node, b.soft, b.spill) == ("n2", True, False) and "race ended there" in b.placed
    # the original's late result is not taken
    assert s.handle(TaskFinished(first.copy, {"a": 9.0}, 8, "n0")) == []
    s.validate_state()


def test_no_duplicate_while_work_waits_and_ready_work_preempts_duplicates():
    s = spec_state({"a": set(), "b": set(), "x": set(), "d": {"b"}}, ["a", "d", "x"], capacity=3)
    subs = {sub.root: sub for sub in submits(s.start())}
    for k, t in (("a", 0.0), ("b", 4.8), ("x", 0.0)):
        s.handle(TaskStarted(subs[k].copy, f"n-{k}", t))
    assert s.handle(Tick(5.0, {"n-d": 1})) == []  # no CPU idle: capacity is full
    # a slot is free and Ray last saw a CPU free on n-d: at once, no Tick needed
    # (``b`` has run only 0.2 s: not long)
    (dup,) = submits(finish(s, subs["x"], 0.1))
    assert dup.duplicate and dup.group == subs["a"].group and dup.node == "n-d"
    s.handle(CpusChanged(2))
    out = finish(s, subs["b"], 0.1)  # ``d`` is ready: the duplicate makes room for it
    assert out[0] == Cancel(dup.copy) and [sub.root for sub in submits(out)] == ["d"]
    assert out[0].node == "n-d"
    assert s.used == 2
    finish(s, subs["a"], 6.0)
    assert s.handle(TaskFinished(dup.copy, {"a": 1.0}, 8, "n-d")) == []
    s.validate_state()


def test_first_copy_dying_leaves_the_duplicate_running():
    s = spec_state({"a": set()}, ["a"], capacity=2)
    (first,) = submits(s.start())
    s.handle(TaskStarted(first.copy, "n0", 0.0))
    (dup,) = submits(s.handle(Tick(5.0, {"n0": 1, "n1": 1})))
    s.handle(TaskStarted(dup.copy, "n1", 5.0))
    assert s.handle(Tick(7.0)) == []
    out = s.handle(TaskErred(first.copy, "a", ConnectionError(), node_died=True))
    assert out == []  # no restart from scratch: the duplicate carries on
    s.validate_state()
    assert s.used == 1
    out = s.handle(TaskFinished(dup.copy, {"a": 8.0}, 8, "n1", 5.0))
    (won,) = [i for i in out if isinstance(i, Won)]
    assert won.losers == () and won.saved == pytest.approx(2.0)  # the restart it spared
    assert s.done and s.tasks["a"].state == "memory"


def test_duplicate_dying_last_restarts_the_first_copy():
    s = spec_state({"a": set()}, ["a"], capacity=2)
    (first,) = submits(s.start())
    s.handle(TaskStarted(first.copy, "n0", 0.0))
    (dup,) = submits(s.handle(Tick(5.0, {"n1": 1})))
    assert s.handle(TaskErred(first.copy, "a", ConnectionError(), node_died=True)) == []
    out = s.handle(TaskErred(dup.copy, "a", ConnectionError(), node_died=True))
    # the group runs again, as a new copy of it, anywhere
    assert len(out) == 1 and out[0].copy not in {first.copy, dup.copy}
    assert out == [dataclasses.replace(first, copy=out[0].copy)]
    s.validate_state()


def test_quantile_policy_uses_seeded_runtimes():
    sp = Speculation(
        enabled=True, quantile=0.9, min_samples=5, long_task=None, min_runtime=1.0, slow_node=None
    )
    seed = {"a": [2.0] * 10}
    s = make({"a-1": set()}, ["a-1"], capacity=2, speculation=sp, seed_runtimes=seed)
    (first,) = submits(s.start())
    s.handle(TaskStarted(first.copy, "n0", 0.0))
    assert s.handle(Tick(1.9, {"n1": 1})) == []  # within the 90 % quantile (2 s)
    (dup,) = submits(s.handle(Tick(2.1, {"n1": 1})))
    assert dup.node == "n1"
    # without a seed the category has no samples: no quantile; nothing is known at
    # all, so at the tail it is overdue once it has run min-runtime (a hung node)
    s = make({"a-1": set()}, ["a-1"], capacity=2, speculation=sp)
    (first,) = submits(s.start())
    s.handle(TaskStarted(first.copy, "n0", 0.0))
    assert s.handle(Tick(0.9, {"n1": 1})) == []
    (dup,) = submits(s.handle(Tick(50.0, {"n1": 1})))
    assert dup.duplicate and dup.node == "n1"


def test_known_long_category_is_duplicated_as_soon_as_a_cpu_frees():
    """A category whose mean is past ``long-task`` needs no ``min-runtime``; the CPU a
    finished copy frees is taken at once, without waiting for a Tick (Ray's view of
    the free CPUs lags); the CPU a first copy starts on is not free any more."""
    sp = Speculation(enabled=True, quantile=None, long_task=3.0, min_runtime=10.0, slow_node=None)
    deps = {"long-0": set(), "short-0": set(), "short-1": set()}
    deps["total"] = set(deps)
    seed = {"long": [9.0, 9.5]}
    s = make(deps, ["total"], capacity=3, speculation=sp, seed_runtimes=seed)
    subs = {sub.root: sub for sub in submits(s.start())}
    assert set(subs) == {"long-0", "short-0", "short-1"}
    assert s.handle(Tick(100.0, {"n0": 1, "n1": 1, "n2": 1})) == []  # none started yet
    assert s.handle(TaskStarted(subs["short-0"].copy, "n0", 100.0)) == []
    assert s.handle(TaskStarted(subs["short-1"].copy, "n1", 100.0)) == []
    # the long one starts on n2: n0 and n1 took theirs (Ray's view was older)
    assert s.handle(TaskStarted(subs["long-0"].copy, "n2", 100.1)) == []
    assert free_cpus(s) == {"n0": 0, "n1": 0, "n2": 0}
    out = s.handle(TaskFinished(subs["short-0"].copy, {"short-0": 0.3}, 8, "n0", 100.0))
    (dup,) = submits(out)  # 0.2 s into the long task: min-runtime does not apply
    assert (dup.duplicate, dup.group, dup.node) == (True, subs["long-0"].group, "n0")
    assert free_cpus(s)["n0"] == 0
    s.validate_state()
    assert s.handle(TaskFinished(subs["short-1"].copy, {"short-1": 0.3}, 8, "n1", 100.1)) == []
    s.validate_state()


def test_insurance_of_a_known_long_task_needs_no_gain():
    """A known-long task's duplicate is insurance against losing its node, made from
    its start: not held back by the tail's test that a duplicate would finish first
    (here its node's measured pace, 1.2, leaves a fresh copy no ``min_gain`` ahead).
    #4's scenario (b) lost its insurance to that test: 1.09x its bound -> 1.36x."""
    sp = Speculation(
        enabled=True, quantile=None, long_task=3.0, min_runtime=10.0, slow_node=3.0, min_gain=5.0
    )
    deps = {"long-0": set(), "short-0": set()}
    deps["total"] = set(deps)
    s = make(deps, ["total"], capacity=2, speculation=sp, seed_runtimes={"long": [9.0, 9.5]})
    subs = {sub.root: sub for sub in submits(s.start())}
    s.speculator.overtaken["n1"] = [1.2]  # n1 ran an overtaken copy 1.2x slower
    assert s.handle(TaskStarted(subs["short-0"].copy, "n0", 100.0)) == []
    assert s.handle(TaskStarted(subs["long-0"].copy, "n1", 100.0)) == []
    out = s.handle(TaskFinished(subs["short-0"].copy, {"short-0": 0.3}, 8, "n0", 100.0))
    (dup,) = submits(out)
    assert (dup.duplicate, dup.group, dup.node) == (True, subs["long-0"].group, "n0")
    s.validate_state()


def test_no_duplicate_between_ticks_while_a_copy_has_not_said_where_it_runs():
    """A first copy sent but not started may be bound for the CPU just freed: only a
    Tick (Ray's own view of the free CPUs) may then place a duplicate."""
    sp = Speculation(enabled=True, quantile=None, long_task=3.0, min_runtime=0.5, slow_node=None)
    deps = {"z-0": set(), "s-0": set(), "s-1": set(), "s-2": set()}
    s = make(deps, list(deps), capacity=3, speculation=sp, seed_runtimes={"z": [9.0]})
    subs = {sub.root: sub for sub in submits(s.start())}
    assert set(subs) == {"z-0", "s-2", "s-1"}
    s.handle(TaskStarted(subs["z-0"].copy, "n2", 0.0))
    s.handle(TaskStarted(subs["s-2"].copy, "n0", 0.0))
    s.handle(TaskStarted(subs["s-1"].copy, "n1", 0.0))
    out = s.handle(TaskFinished(subs["s-2"].copy, {"s-2": 0.3}, 8, "n0", 0.0))
    (nxt,) = submits(out)  # the last short one, not yet started: no duplicate
    assert nxt.root == "s-0" and not nxt.duplicate
    assert s.handle(TaskFinished(subs["s-1"].copy, {"s-1": 0.3}, 8, "n1", 0.0)) == []
    (dup,) = submits(s.handle(Tick(0.5, {"n1": 1})))  # Ray says n1 is free
    assert (dup.duplicate, dup.group, dup.node) == (True, subs["z-0"].group, "n1")
    s.validate_state()


def test_task_on_a_slow_node_is_duplicated_at_once_elsewhere():
    """Tasks ran five times their category's mean on ``nS``: the final task, started
    there, is a straggler from its start (no min-runtime, no runtimes of its own
    category): its duplicate goes to a free CPU of another node at once. (Two runs judge
    a node here; the default asks three, for categories that mix lengths.)"""
    sp = Speculation(
        enabled=True,
        quantile=None,
        long_task=None,
        min_runtime=10.0,
        slow_node=3.0,
        slow_node_runs=2,
    )
    deps = {f"s-{i}": set() for i in range(4)}
    deps["total"] = set(deps)
    s = make(deps, ["total"], capacity=3, speculation=sp, seed_runtimes={"s": [0.3] * 5})
    a, b, c = submits(s.start())
    for sub, node in ((a, "nS"), (b, "n0"), (c, "n1")):
        assert s.handle(TaskStarted(sub.copy, node, 0.0)) == []
    (d,) = submits(s.handle(TaskFinished(a.copy, {a.root: 1.5}, 8, "nS", 0.0)))
    assert not d.duplicate
    assert s.handle(TaskStarted(d.copy, "nS", 1.5)) == []
    assert not s.speculator.slow("nS")  # one task is not a pace to judge on...
    # ... but at the tail its run, five times the seeded ones, weighs pace 5 (nothing
    # else ran yet to say otherwise): a CPU idles, so its copy gets a duplicate
    (dd,) = submits(s.handle(TaskFinished(b.copy, {b.root: 0.3}, 8, "n0", 0.0)))
    assert dd.duplicate and dd.group == d.group and dd.node == "n0"
    assert s.speculator.expected_pace("nS") > 3
    assert s.handle(TaskFinished(c.copy, {c.root: 0.3}, 8, "n1", 0.0)) == []
    (total,) = submits(s.handle(TaskFinished(d.copy, {d.root: 1.5}, 8, "nS", 1.5)))
    sp_ = s.speculator
    assert sp_.slow("nS") and not sp_.slow("n0") and not sp_.slow("n1")
    # (the CPU dd's cancel freed is Ray's to report: the next Tick)
    started = submits(s.handle(TaskStarted(total.copy, "nS", 3.0)))
    (dup,) = started or submits(s.handle(Tick(3.0, {"n0": 1.0, "n1": 1.0})))
    assert dup.duplicate and dup.group == total.group and dup.node in {"n0", "n1"}
    s.validate_state()
    out = s.handle(TaskFinished(dup.copy, {"total": 0.1}, 8, dup.node, 3.01))
    assert Cancel(total.copy) in out and s.done


def _submission_order(straggle: bool) -> tuple[list[str], State]:
    """Twenty short tasks (0.3 s apart) and a known-long one feeding a total, on 3 one-CPU
    nodes; the long one comes late in dask's order. With ``straggle``, ``nS`` holds its
    first task and the other two take turns; else all three do. Roots in submission
    order, up to the long one."""
    sp = Speculation(enabled=True, quantile=None, long_task=3.0, min_runtime=10.0, slow_node=3.0)
    deps = {f"short-{i:02d}": set() for i in range(20)}
    deps["long-0"] = set()
    deps["total"] = set(deps)
    seed = {"short": [0.28] * 5, "long": [9.0]}  # 0.28 s, and 0.02 s between tasks
    s = make(deps, ["total"], capacity=3, speculation=sp, seed_runtimes=seed)
    nodes = ("nS", "n0", "n1")
    running = dict(zip(nodes, submits(s.start()), strict=True))
    for node, sub in running.items():
        s.handle(TaskStarted(sub.copy, node, 0.0))
    order = [sub.root for sub in running.values()]
    turns = itertools.cycle(nodes[1:] if straggle else nodes)
    now = 0.0
    while "long-0" not in order:
        now += 0.3 / (2 if straggle else 3)  # each node's task takes 0.3 s
        node = next(turns)
        done = running[node]
        (nxt,) = submits(s.handle(TaskFinished(done.copy, {done.root: 0.28}, 8, node, now - 0.3)))
        s.handle(TaskStarted(nxt.copy, node, now))
        running[node] = nxt
        order.append(nxt.root)
        s.validate_state()
    return order, s


def test_known_long_task_goes_next_while_a_node_straggles():
    """dask's order runs the long task late; while a first copy runs ``slow_node`` times
    its category's mean (nS holds its first short task), the cluster does less than it
    seemed and the known-long task goes next. Without a straggler it keeps its place
    (started early, its duplicate would wait for every short one)."""
    plain, s = _submission_order(straggle=False)
    assert len(plain) == 21 and plain[-1] == "long-0" and not s.speculator.short_handed()
    boosted, s = _submission_order(straggle=True)
    # two finishes every 0.3 s: the 6th after the first three, at 0.9 s, is the first
    # past 3 x 0.28 s
    assert boosted[:8] == plain[:8] and boosted[8] == "long-0", boosted
    assert s.speculator.short_handed()


def test_speculation_off_makes_no_duplicates():
    s = make({"a": set()}, ["a"], capacity=2)
    (first,) = submits(s.start())
    assert first.notify  # where it runs still matters when a node dies
    s.handle(TaskStarted(first.copy, "n0", 0.0))
    assert s.handle(Tick(1e6, {"n1": 4})) == []


def test_a_copy_reports_its_start_at_once_if_long_later_if_unmeasured_never_if_cheap():
    """A start note costs the worker an actor call: sent at once where it is known to
    matter (a long category; a duplicate: test_duplicate_goes_to_another_idle_node_...),
    after fusion's max-task-duration where the category is unmeasured (a copy ending
    sooner has shown itself cheap), never for a measured-cheap one."""
    deps = {f"{c}-{i}": set() for c in ("long", "cheap") for i in range(2)}
    deps["end"] = set(deps)
    sp = Speculation(enabled=True, quantile=None, long_task=1.0, min_runtime=0.5, slow_node=None)
    s = make(deps, ["end"], capacity=1, category=lambda k: k.split("-")[0], speculation=sp)
    limit = s.fuser.settings.max_task_duration
    ran = {"long": 5.0, "cheap": limit / 10, "end": limit / 10}
    expect = {"long": (True, 0.0), "cheap": (False, 0.0)}
    (sub,) = submits(s.start())
    measured: set = set()
    while True:
        cat = sub.root.split("-")[0]
        want = expect[cat] if cat in measured else (True, limit)
        assert (sub.notify, sub.notify_after) == want, (sub, measured)
        if sub.root == "end":
            break
        measured.add(cat)
        out = s.handle(TaskFinished(sub.copy, {sub.root: ran[cat]}, 10, "n0"))
        (sub,) = submits(out)
    assert measured == {"long", "cheap"}
    s.validate_state()


def make(dependencies: dict, outputs, **kwargs) -> State:
    kwargs.setdefault("capacity", 4)
    kwargs.setdefault("fusion", NO_FUSION)
    return State(dependencies, dask_priorities(dependencies), outputs, **kwargs)


def submits(out: list) -> list[Submit]:
    return [i for i in out if isinstance(i, Submit)]


def releases(out: list) -> set:
    return {i.key for i in out if isinstance(i, Release)}


def finish(state: State, sub: Submit, seconds: float = CHEAP) -> list:
    out = state.handle(TaskFinished(sub.copy, {k: seconds for k in sub.keys}, 8))
    state.validate_state()
    return out


def recovering(s: State) -> set:
    """The keys recomputed in a recovery wave and not finished since."""
    return {k for k, ts in s.tasks.items() if ts.recovering}


def held(s: State, key) -> bool:
    """Is ``key``'s value in memory on a known node?"""
    ts = s.tasks[key]
    return ts.state == "memory" and ts.node is not None


def free_cpus(s: State) -> dict:
    """Speculation's free CPUs of each node it heard of."""
    return {n: ns.free for n, ns in s.nodes.items()}


def node_stores(s: State) -> dict:
    """Each sampled node's store, ``(used, capacity)``, as counted since."""
    return {n: ns.store for n, ns in s.nodes.items() if ns.store is not None}


def full_nodes(s: State) -> set:
    """The nodes whose store is above the high-water mark."""
    return {n for n, ns in s.nodes.items() if ns.full}


def again(s: State, out: list, sub: Submit, seen: set, attempt: int) -> Submit:
    """``out`` is ``sub``'s group submitted again, at ``attempt``, as a copy not ``seen``
    before (then added to ``seen``): the same Submit but for its copy id."""
    assert len(out) == 1 and isinstance(out[0], Submit), out
    new = out[0]
    assert new.copy not in seen, (new, seen)
    assert out == [dataclasses.replace(sub, copy=new.copy, attempt=attempt)], (sub, out)
    seen.add(new.copy)
    s.validate_state()
    return new


DIAMOND = {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}}


def test_diamond():
    """The shared input lives until its last reader finishes, then the middle ones go."""
    s = make(DIAMOND, {"d"})
    (a,) = submits(s.start())
    assert a.keys == ("a",) and a.inputs == ()
    out = finish(s, a)
    first, second = submits(out)
    assert {first.root, second.root} == {"b", "c"} and not releases(out)
    assert s.tasks[first.root].priority < s.tasks[second.root].priority
    out = finish(s, first)
    assert out == []  # "a" is still read by the other one
    out = finish(s, second)
    (d,) = submits(out)
    assert releases(out) == {"a"} and set(d.inputs) == {"b", "c"}
    out = finish(s, d)
    assert releases(out) == {"b", "c"} and s.done


def test_ordered_rekeys_what_is_ready():
    """Started on a provisional order, the state machine takes dask.order's when it
    comes: what is ready (sources and readers of intermediates alike) goes by it."""
    deps = {f"r{i}": set() for i in range(4)} | {f"m{i}": {f"r{i}"} for i in range(4)}
    provisional = {k: i for i, k in enumerate(sorted(deps))}  # m0..m3, r0..r3
    s = State(deps, provisional, {f"m{i}" for i in range(4)}, capacity=2, fusion=NO_FUSION)
    first = submits(s.start())
    assert [x.root for x in first] == ["r0", "r1"]
    later = {f"r{i}": 2 * (3 - i) for i in range(4)} | {f"m{i}": 2 * (3 - i) + 1 for i in range(4)}
    assert s.handle(Ordered(later)) == []  # no slot free: nothing more runs yet
    s.validate_state()
    assert s.tasks["r3"].priority == 0
    (nxt,) = submits(finish(s, first[0]))  # m0 and r3, r2 are ready: r3 goes first now
    assert nxt.root == "r3" and nxt.priority == 0
    (nxt,) = submits(finish(s, nxt))
    assert nxt.root == "m3"  # its reader next, as the new order says
    assert s.handle(Ordered({"m0": -1})) == []  # a key may be given alone
    (nxt,) = submits(finish(s, first[1]))
    assert nxt.root == "m0"


def chain(n: int) -> dict:
    return {f"k{i}": {f"k{i - 1}"} if i else set() for i in range(n)}


def test_chain_fuses_once_category_is_known():
    """The first task runs alone (unknown cost); once it is cheap, the rest is one task."""
    s = make(chain(10), {"k9"}, fusion=fusion_config(), category=lambda k: "c")
    (first,) = submits(s.start())
    assert first.keys == ("k0",)
    (rest,) = submits(finish(s, first))
    assert rest.keys == tuple(f"k{i}" for i in range(1, 10))
    assert rest.inputs == ("k0",) and rest.root == "k9"
    out = finish(s, rest)
    assert out == [Release("k0")] and s.done


def test_chain_is_not_fused_when_slow_or_disabled():
    """Slow categories and ``enabled=False`` keep one Ray task per key."""
    for fusion, seconds in [(fusion_config(), 0.1), (fusion_config(enabled=False), CHEAP)]:
        s = make(chain(4), {"k3"}, fusion=fusion, category=lambda k: "c")
        sub = submits(s.start())[0]
        count = 1
        while not s.done:
            (sub,) = submits(finish(s, sub, seconds))
            assert len(sub.keys) == 1
            count += 1
            if sub.root == "k3":
                finish(s, sub, seconds)
        assert count == 4


def test_max_group_size_caps_a_chain():
    """A long cheap chain splits into groups of at most ``max_group_size``."""
    s = make(chain(10), {"k9"}, fusion=fusion_config(max_group_size=3), category=lambda k: "c")
    (sub,) = submits(s.start())
    groups = [sub.keys]
    while True:
        out = finish(s, sub)
        if s.done:
            break
        (sub,) = submits(out)
        groups.append(sub.keys)
    assert groups == [("k0",), ("k1", "k2", "k3"), ("k4", "k5", "k6"), ("k7", "k8", "k9")]


def test_max_group_duration_caps_a_chain():
    """Groups stop growing at the time budget, counted from the learned means."""
    s = make(
        chain(7), {"k6"}, fusion=fusion_config(max_group_duration=0.0035), category=lambda k: "c"
    )
    (sub,) = submits(s.start())
    sizes = []
    while True:
        out = finish(s, sub)
        if s.done:
            break
        (sub,) = submits(out)
        sizes.append(len(sub.keys))
    assert sizes == [3, 3]


def reduction_tree() -> dict:
    deps: dict = {f"leaf{i}": set() for i in range(16)}
    deps |= {f"mid{j}": {f"leaf{4 * j + i}" for i in range(4)} for j in range(4)}
    deps["top"] = {f"mid{j}" for j in range(4)}
    return deps


def test_reduction_tree_fuses_into_few_groups():
    """A 4-way tree over fresh leaves becomes a couple of Ray tasks, not 21."""
    deps = reduction_tree()
    sc = Scenario(
        dependencies=deps,
        priorities=dask_priorities(deps),
        outputs={"top"},
        available=set(),
        resources={},
        retries={},
        capacity=1,
        fusion=fusion_config(),
        categories=dict.fromkeys(deps, "c"),
        durations={"c": CHEAP},
    )
    d = Driver(sc)
    run_to_end(d, lambda gids: gids[0])
    first = min(deps, key=sc.priorities.__getitem__)  # a leaf: runs alone, unknown cost
    assert [s.keys for s in d.submits[:1]] == [(first,)]
    assert len(d.submits) == 2
    assert set(d.submits[1].keys) == set(deps) - {first}
    assert d.submits[1].inputs == (first,)

    sc.capacity = 4  # four leaves start unfused, the rest still fuses
    d = Driver(sc)
    run_to_end(d, lambda gids: gids[-1])
    assert len(d.submits) < 10
    assert any(len(s.keys) >= 5 for s in d.submits)


def test_resources_cost_slots_and_priority_is_strict():
    """A CPU=2 task takes two slots; cheaper, lower-priority work does not jump ahead."""
    deps = {"a": set(), "b": set(), "c": set()}
    prio = {"b": 0, "a": 1, "c": 2}
    s = State(deps, prio, set(deps), capacity=2, resources={"a": {"CPU": 2}}, fusion=NO_FUSION)
    (b,) = submits(s.start())  # "a" does not fit beside "b", and "c" must wait for "a"
    assert b.keys == ("b",)
    (a,) = submits(finish(s, b))
    assert a.keys == ("a",) and a.resources == {"CPU": 2}
    (c,) = submits(finish(s, a))
    assert c.keys == ("c",)
    finish(s, c)
    assert s.done


def test_oversized_task_runs_alone():
    """A task larger than the whole capacity still runs, once nothing else does."""
    deps = {"a": set(), "b": set()}
    s = State(
        deps, {"a": 0, "b": 1}, set(deps), capacity=1, resources={"b": {"CPU": 4}}, fusion=NO_FUSION
    )
    (a,) = submits(s.start())
    (b,) = submits(finish(s, a))
    assert b.root == "b"
    assert submits(s.handle(CpusChanged(8))) == []
    finish(s, b)
    assert s.done


def test_capacity_increase_submits_more():
    """More slots (a node joined) are filled at once."""
    deps = {f"x{i}": set() for i in range(5)}
    s = make(deps, set(deps), capacity=1)
    assert len(submits(s.start())) == 1
    assert len(submits(s.handle(CpusChanged(3)))) == 2
    s.validate_state()


def test_fatal_error_cancels_releases_and_fails():
    """A non-retryable error: cancel the rest, free what is held, report it once."""
    deps = {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}, "e": set()}
    s = make(deps, {"d", "e"}, capacity=3)
    (a, e) = sorted(submits(s.start()), key=lambda x: x.root)
    (b, c) = sorted(submits(finish(s, a)), key=lambda x: x.root)
    err = ValueError("bad")
    out = s.handle(TaskErred(b.copy, "b", err))
    s.validate_state()
    assert set(out[:-1]) == {Cancel(e.copy), Cancel(c.copy), Release("a")}
    assert out[-1] == Fail("b", err)
    assert s.done
    assert s.handle(TaskFinished(c.copy, {"c": CHEAP})) == []


def test_retryable_error_resubmits_then_fails():
    """A lost worker retries the same group ``default_retries`` times, then fails."""
    s = make({"a": set()}, {"a"}, default_retries=2)
    (a,) = submits(s.start())
    cur, seen = a, {a.copy}
    for attempt in (1, 2):  # each retry is a new copy of the same group
        out = s.handle(TaskErred(cur.copy, "a", OSError(), worker_died=True))
        cur = again(s, out, a, seen, attempt)
    err = OSError("gone")
    (fail,) = s.handle(TaskErred(cur.copy, "a", err, worker_died=True))
    assert_fails(fail, "a", err, retryable=True)
    assert s.done


def test_retries_annotation_retries_user_errors():
    """``retries={key: n}`` retries even a user error n times; a success then counts."""
    s = make({"a": set(), "b": {"a"}}, {"b"}, retries={"a": 1})
    (a,) = submits(s.start())
    out = s.handle(TaskErred(a.copy, "a", ValueError()))
    a1 = again(s, out, a, {a.copy}, 1)
    (b,) = submits(finish(s, a1))
    assert b.root == "b"
    err = ValueError("b")
    assert s.handle(TaskErred(b.copy, "b", err)) == [Release("a"), Fail("b", err)]


def test_retries_annotation_raises_the_retryable_limit():
    """A lost worker gets the larger of ``retries`` and ``default_retries``."""
    s = make({"a": set()}, {"a"}, retries={"a": 2}, default_retries=1)
    (a,) = submits(s.start())
    cur, seen = a, {a.copy}
    for attempt in (1, 2):
        out = s.handle(TaskErred(cur.copy, "a", OSError(), worker_died=True))
        cur = again(s, out, a, seen, attempt)
    err = OSError("gone")
    (fail,) = s.handle(TaskErred(cur.copy, "a", err, worker_died=True))
    assert_fails(fail, "a", err, retryable=True)


def test_abort_cancels_and_releases_everything():
    """Ctrl-C: every group cancelled, every held value (outputs too) released."""
    s = make(DIAMOND, {"d"}, capacity=1)
    (a,) = submits(s.start())
    (b,) = submits(finish(s, a))
    out = s.handle(Aborted())
    s.validate_state()
    assert set(out) == {Cancel(b.copy), Release("a")}
    assert s.done
    assert s.handle(TaskFinished(b.copy)) == []


def test_available_keys_are_read_not_run():
    """Given values are never submitted and are freed after their readers, or at once."""
    deps = {"x": set(), "unused": set(), "y": {"x"}, "z": {"y", "x"}}
    s = make(deps, {"z"}, available={"x", "unused"})
    out = s.start()
    assert releases(out) == {"unused"}
    (y,) = submits(out)
    assert y.inputs == ("x",)
    (z,) = submits(finish(s, y))
    assert set(z.inputs) == {"x", "y"}
    assert releases(finish(s, z)) == {"x", "y"} and s.done


@pytest.mark.parametrize("fusion", [fusion_config(), fusion_config(enabled=False)])
def test_everything_available(fusion):
    """Nothing to run: done straight away, nothing submitted."""
    s = make({"a": set()}, {"a"}, available={"a"}, fusion=fusion)
    assert s.start() == [] and s.done


# ---- recovery examples ----------------------------------------------------------


def recovers(out: list) -> list[Recover]:
    return [i for i in out if isinstance(i, Recover)]


def cancels(out: list) -> set:
    return {i.copy for i in out if isinstance(i, Cancel)}


def test_lost_value_recomputes_its_released_inputs_in_one_wave():
    """a -> b -> c -> d with c held, a and b released: losing c reruns a, b, c, then d."""
    deps = {"a": set(), "b": {"a"}, "c": {"b"}, "d": {"c"}}
    s = make(deps, {"d"})
    (a,) = submits(s.start())
    (b,) = submits(finish(s, a))
    out = finish(s, b)
    (c,) = submits(out)
    assert releases(out) == {"a"}
    out = s.handle(TaskFinished(c.copy, {"c": CHEAP}, 8, node="n1"))
    (d,) = submits(out)
    assert releases(out) == {"b"} and s.tasks["c"].node == "n1"

    out = s.handle(ResultsLost(("c",), "n1 died"))
    s.validate_state()
    (rec,) = recovers(out)
    assert rec.wave == 1 and rec.lost == ("c",) and rec.reason == "n1 died"
    assert sorted(rec.recompute) == ["a", "b", "c"]
    assert cancels(out) == {d.copy}  # d was reading c
    assert not held(s, "c") and s.tasks["c"].node is None
    (a2,) = submits(out)
    assert a2.keys == ("a",) and recovering(s) == {"a", "b", "c"}
    (b2,) = submits(finish(s, a2))
    (c2,) = submits(finish(s, b2))
    (d2,) = submits(finish(s, c2))
    assert d2.keys == ("d",) and d2.group != d.group and d2.copy != d.copy and not recovering(s)
    assert finish(s, d) == []  # the cancelled run's result changes nothing
    assert releases(finish(s, d2)) == {"c"} and s.done
    assert s.wave == 1


def test_fan_in_losing_three_inputs_is_one_wave():
    """Six inputs of one reduction, three lost at once: one wave, just those three."""
    deps: dict = {f"x{i}": set() for i in range(6)} | {"y": {f"x{i}" for i in range(6)}}
    s = make(deps, {"y"}, capacity=6)
    subs = {sub.root: sub for sub in submits(s.start())}
    assert len(subs) == 6
    for i in range(4):
        finish(s, subs[f"x{i}"])
    out = s.handle(ResultsLost(("x0", "x1", "x2", "x4", "nope")))  # x4 is not held yet
    s.validate_state()
    (rec,) = recovers(out)
    assert rec.wave == 1 and rec.lost == ("x0", "x1", "x2")
    assert sorted(rec.recompute) == ["x0", "x1", "x2"]
    assert not cancels(out)  # y was not running yet: nothing to cancel
    again = submits(out)
    assert sorted(sub.root for sub in again) == ["x0", "x1", "x2"]
    for sub in again + [subs["x4"], subs["x5"]]:
        assert not submits(finish(s, sub)) or sub is subs["x5"]
    assert s.tasks["y"].state == "processing" and s.done is False


def test_loss_cancels_readers_in_flight_and_recovery_goes_first():
    """The reader of a lost value is cancelled; the lost value runs before other work."""
    deps = {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}, "e": set()}
    prio = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}
    s = State(deps, prio, {"d", "e"}, capacity=1, fusion=NO_FUSION)
    (a,) = submits(s.start())
    (b,) = submits(finish(s, a))  # c and e wait for the slot
    out = s.handle(ResultsLost(("a",)))
    s.validate_state()
    assert cancels(out) == {b.copy}
    assert recovers(out) == [Recover(1, ("a",), ("a",), "")]
    (a2,) = submits(out)
    assert a2.keys == ("a",)
    assert s.handle(TaskFinished(b.copy, {"b": CHEAP})) == []  # late: ignored
    assert s.handle(TaskErred(b.copy, "b", OSError(), node_died=True)) == []
    s.validate_state()
    (b2,) = submits(finish(s, a2))
    assert b2.keys == ("b",) and b2.group != b.group and b2.copy != b.copy


def test_recovery_tier_goes_ahead_of_better_priorities():
    """A recomputed key runs before ready normal work, whatever their priorities."""
    deps = {"e": set(), "a": set(), "b": {"a"}, "f": set()}
    prio = {"e": 0, "a": 1, "f": 2, "b": 3}
    s = State(deps, prio, {"e", "b", "f"}, capacity=1, fusion=NO_FUSION)
    (e,) = submits(s.start())
    (a,) = submits(finish(s, e))
    (f,) = submits(finish(s, a))  # b (priority 3) waits behind f (priority 2)
    assert f.keys == ("f",)
    out = s.handle(ResultsLost(("e",)))  # an output: held, so recomputed
    assert recovers(out)[0].recompute == ("e",) and not submits(out)  # the slot is taken
    (e2,) = submits(finish(s, f))
    assert e2.keys == ("e",)  # ahead of b
    (b,) = submits(finish(s, e2))
    assert b.keys == ("b",)


def test_losing_nothing_held_does_nothing():
    s = make(DIAMOND, {"d"})
    (a,) = submits(s.start())
    assert s.handle(ResultsLost(("a", "b", "d", "unknown"))) == []
    assert s.wave == 0
    s.validate_state()


def test_losing_a_given_value_without_lineage_fails():
    """No lineage here for a fixed given value: the compute fails, all is released."""
    deps = {"x": set(), "y": {"x"}, "z": {"y"}}
    s = make(deps, {"z"}, available={"x"}, fixed={"x"})
    (y,) = submits(s.start())
    out = s.handle(ResultsLost(("x",), "n2 died"))
    s.validate_state()
    assert out[:-1] == [Cancel(y.copy), Release("x")]
    fail = out[-1]
    assert isinstance(fail, Fail) and fail.key == "x" and "n2 died" in str(fail.error)
    assert s.done and s.handle(TaskFinished(y.copy)) == []


def test_losing_a_given_value_with_lineage_recomputes_it_unfused():
    """A given value whose task is here reruns from its lineage, as its own Ray task.

    ``p`` is lineage only (released from the start). Once ``g`` is lost, ``p`` and
    ``g`` run again; ``g`` may end a group but is never fused into its consumer (its
    value must reach the object store for the Ray layer to hand back to its owner).
    """
    deps = {"s": set(), "p": set(), "g": {"p"}, "h": {"g"}}
    prio = {"s": 0, "h": 1, "g": 2, "p": 3}
    s = State(
        deps,
        prio,
        {"s", "h"},
        capacity=1,
        available={"g"},
        fusion=fusion_config(),
        category=lambda k: "c",
    )
    (first,) = submits(s.start())
    assert first.keys == ("s",) and s.tasks["p"].state == "released"
    out = s.handle(ResultsLost(("g",)))
    (rec,) = recovers(out)
    assert sorted(rec.recompute) == ["g", "p"]
    (g,) = submits(finish(s, first))  # all cheap now, yet h is not pulled in
    assert g.keys == ("p", "g") and g.inputs == ()
    (h,) = submits(finish(s, g))
    assert h.keys == ("h",)
    assert releases(finish(s, h)) == {"g"} and s.done


def test_node_lost_does_not_use_up_retries():
    """A dead node restarts the same group (a new copy each time) as often as it happens,
    even with no retries."""
    s = make({"a": set(), "b": {"a"}}, {"b"}, default_retries=0)
    (a,) = submits(s.start())
    cur, seen = a, {a.copy}
    for _ in range(5):
        out = s.handle(TaskErred(cur.copy, "a", OSError(), node_died=True))
        cur = again(s, out, a, seen, attempt=0)
    (b,) = submits(finish(s, cur))
    err = OSError("worker")
    (fail,) = s.handle(TaskErred(b.copy, "b", err, worker_died=True))[-1:]
    assert_fails(fail, "b", err, retryable=True)  # a dead worker still counts


def test_cheap_tasks_take_a_fraction_of_a_slot():
    """Once a category is measured cheap, ``cheap_cost`` slots each: more in flight."""
    deps = {f"x{i}": set() for i in range(10)}
    s = make(deps, set(deps), capacity=1, category=lambda k: "c", cheap_cost=0.25)
    (first,) = submits(s.start())  # not measured yet: a whole slot
    assert s.used == 1.0
    out = finish(s, first)
    assert len(submits(out)) == 4 and s.used == 1.0
    s = make(deps, set(deps), capacity=1, category=lambda k: "c", cheap_cost=0.25)
    (first,) = submits(s.start())
    assert len(submits(finish(s, first, seconds=SLOW))) == 1  # slow: a whole slot each


def test_fused_group_that_does_not_fit_takes_what_is_left():
    """A group measured too long to be cheap costs a whole slot: beside what runs, it
    takes only the capacity left, so fusing neither waits for a free slot nor pushes
    the work in flight past capacity.
    """
    deps = {"s": set(), "t": set()} | chain(6)
    prio = {"s": 0, "t": 1} | {f"k{i}": 2 + i for i in range(6)}
    s = State(
        deps,
        prio,
        {"s", "t", "k5"},
        capacity=1,
        fusion=fusion_config(),
        category=lambda k: "c",
        cheap_cost=0.5,
    )
    (first,) = submits(s.start())
    t, group = submits(finish(s, first))
    assert t.keys == ("t",)
    assert group.keys == tuple(f"k{i}" for i in range(6))  # 6 * CHEAP: a whole slot...
    assert s.used == 1.0  # ...but only the half left beside t
    finish(s, t)
    assert s.used == 0.5
    assert not submits(finish(s, group))
    assert s.used == 0.0 and s.done


# ---- shuffles: bundles of a map and its pieces ----------------------------------


@st.composite
def shuffles(draw) -> Scenario:
    """One shuffle, or two in a row: N maps, each a bundle with M pieces, M reducers
    reading piece j of every map; sometimes an upstream step, a final sum, a piece
    requested as an output, given sources."""
    bundles: dict = {}
    deps: dict = {}

    def shuffle(tag: str, inputs: list, m: int) -> list:
        for i, src in enumerate(inputs):
            deps[f"{tag}map{i}"] = {src}
            pieces = tuple(f"{tag}piece{i}_{j}" for j in range(m))
            deps.update({p: {f"{tag}map{i}"} for p in pieces})
            bundles[f"{tag}map{i}"] = pieces
        for j in range(m):
            deps[f"{tag}red{j}"] = {f"{tag}piece{i}_{j}" for i in range(len(inputs))}
        return [f"{tag}red{j}" for j in range(m)]

    n = draw(st.integers(1, 5))
    inputs = [f"src{i}" for i in range(n)]
    deps.update({k: set() for k in inputs})
    if draw(st.booleans()):
        deps.update({f"up{i}": {src} for i, src in enumerate(inputs)})
        inputs = [f"up{i}" for i in range(n)]
    ends = shuffle("a", inputs, draw(st.integers(1, 5)))
    if draw(st.booleans()):
        ends = shuffle("b", ends, draw(st.integers(1, 4)))
    if draw(st.booleans()):
        deps["total"] = set(ends)
        ends = ["total"]
    keys = list(deps)
    pieces = sorted(p for ps in bundles.values() for p in ps)
    outputs = set(ends) | draw(st.sets(st.sampled_from(pieces), max_size=2))
    sources = [k for k in keys if not deps[k]]
    available = draw(st.sets(st.sampled_from(sources), max_size=len(sources) // 2))
    fixed = {k for k in sorted(available) if draw(st.booleans())}
    if draw(st.booleans()):
        priorities = dask_priorities(deps)
    else:
        priorities = dict(zip(keys, draw(st.permutations(range(len(keys)))), strict=True))

    def category(k: str) -> str:
        return next((c for c in ("map", "piece", "red") if c in k), "c0")

    durations = {
        "c0": CHEAP,
        "piece": CHEAP,
        "map": draw(st.sampled_from([CHEAP, SLOW])),
        "red": draw(st.sampled_from([CHEAP, SLOW])),
    }
    retries = draw(st.dictionaries(st.sampled_from(keys), st.integers(0, 2), max_size=3))
    return Scenario(
        dependencies=deps,
        priorities=priorities,
        outputs=outputs,
        available=available,
        resources={},
        retries=retries,
        capacity=draw(st.integers(1, 4)),
        fusion=fusion_config(enabled=draw(st.booleans())),
        categories={k: category(k) for k in keys},
        durations=durations,
        default_retries=draw(st.integers(0, 2)),
        cheap_cost=draw(st.sampled_from([1.0, 0.5])),
        fixed=fixed,
        bundles=bundles,
    )


@pytest.mark.core_only
@SETTINGS
@given(sc=shuffles(), data=st.data())
def test_random_shuffles(sc, data):
    """Each map runs once with all its pieces, each piece kept as its own value and
    released once its reducer has run; capacity changes on the way."""
    d = Driver(sc)
    d.start()
    while d.inflight:
        if data.draw(st.integers(0, 7)) == 7:
            d.change_capacity(data.draw(st.integers(1, 4)))
        else:
            d.finish(data.draw(st.sampled_from(sorted(d.inflight))))
    d.check_complete()
    maps = [s for s in d.submits if s.keys[0] in sc.bundles]
    assert sorted(s.keys[0] for s in maps) == sorted(sc.bundles.keys() - sc.available)
    assert all(s.kept == sc.bundles[s.keys[0]] for s in maps)
    d.label()


@pytest.mark.core_only
@SETTINGS
@given(sc=shuffles(), data=st.data())
def test_random_shuffles_lost_pieces(sc, data):
    """Pieces lost at random (also while their map runs again for another lost piece),
    nodes dying under maps: each wave reruns the maps of the lost pieces, keeping only
    those pieces; the result is complete and everything else is freed."""
    lose_at_random(Driver(sc), data)


@pytest.mark.core_only
@SETTINGS
@given(sc=shuffles(), data=st.data())
def test_random_shuffles_failures(sc, data):
    """A map's error retries as annotated then fails the compute, freeing every piece."""
    fail_at_random(Driver(sc), data)


def test_bundle_loses_one_piece_and_reruns_its_map_keeping_only_it():
    deps = {"src": set(), "map": {"src"}, "p0": {"map"}, "p1": {"map"}}
    deps |= {"r0": {"p0"}, "r1": {"p1"}}
    st_ = make(deps, ["r0", "r1"], bundles={"map": ("p0", "p1")})
    (sub,) = submits(st_.start())
    (sub,) = submits(finish(st_, sub, SLOW))
    assert sub.keys == ("map", "p0", "p1") and sub.kept == ("p0", "p1")
    out = finish(st_, sub, SLOW)
    assert releases(out) == {"src"} and st_.tasks["map"].state == "released"
    r0, r1 = sorted(submits(out), key=lambda s: s.root)
    assert (r0.inputs, r1.inputs) == (("p0",), ("p1",))  # each reducer reads its piece only
    assert releases(finish(st_, r0, SLOW)) == {"p0"}
    out = st_.handle(ResultsLost(("p1",)))
    (rec,) = recovers(out)
    assert set(rec.recompute) == {"p1", "map", "src"} and cancels(out) == {r1.copy}
    (sub,) = submits(out)
    (sub,) = submits(finish(st_, sub, SLOW))
    assert sub.keys == ("map", "p1") and sub.kept == ("p1",)
    st_.validate_state()


def test_a_map_requested_as_output_is_no_bundle():
    deps = {"map": set(), "p0": {"map"}, "p1": {"map"}, "r": {"p0", "p1"}}
    st_ = make(deps, ["r", "map"], bundles={"map": ("p0", "p1")})
    assert st_.bundler.pieces == {}
    (sub,) = submits(st_.start())
    assert sub.keys == ("map",) and sub.kept == ("map",)


# ---- consumers in their producer's task -------------------------------------------

# A skim: each partition is read (slow), then written and histogrammed (cheap); the
# histograms are summed, the writes finalised. dask.order runs every write last.
SKIM = {f"read{i}": set() for i in range(4)}
SKIM |= {f"hist{i}": {f"read{i}"} for i in range(4)}
SKIM |= {f"write{i}": {f"read{i}"} for i in range(4)}
SKIM |= {"sum": {f"hist{i}" for i in range(4)}, "final": {f"write{i}" for i in range(4)}}


def skim_state(**kwargs) -> State:
    prio = {k: i for i, k in enumerate(sorted(SKIM, key=lambda k: (k[:4] == "writ", k)))}
    cat = lambda k: k.rstrip("0123456789")  # noqa: E731
    return State(SKIM, prio, {"sum", "final"}, category=cat, fusion=fusion_config(), **kwargs)


def test_consumers_run_in_their_producers_task_and_its_value_never_leaves():
    s = skim_state(capacity=2)
    first, second = submits(s.start())
    # nothing measured yet: each read takes its consumers along as probes of their
    # categories, the second beside the first
    assert first.keys == ("read0", "hist0", "write0") and first.kept == ("hist0", "write0")
    assert second.keys == ("read1", "hist1", "write1")
    out = s.handle(TaskFinished(first.copy, {"read0": 0.1, "hist0": 0.001, "write0": 0.004},
                                40, "n0", sizes=(8, 32)))  # fmt: skip
    s.validate_state()
    assert s.tasks["read0"].state == "released" and "read0" not in releases(out)  # never held
    assert (s.tasks["hist0"].nbytes, s.tasks["write0"].nbytes) == (8, 32)
    (third,) = submits(out)  # measured now: cheap beside the read
    assert third.keys == ("read2", "hist2", "write2") and third.kept == ("hist2", "write2")


def test_probes_of_a_category_stop_at_probes_in_flight():
    s = skim_state(capacity=PROBES + 1)
    subs = submits(s.start())
    probes = [(f"read{i}", f"hist{i}", f"write{i}") for i in range(PROBES)]
    assert [sub.keys for sub in subs[:PROBES]] == probes
    (alone,) = subs[PROBES:]  # PROBES of each consumer's runs in flight: no more probes
    assert alone.keys == (f"read{PROBES}",)
    # the read that ran alone keeps its value for its consumers, which run apart
    out = finish(s, alone, 0.1)
    s.validate_state()
    assert s.tasks[f"read{PROBES}"].state == "memory"
    assert [sub.keys for sub in submits(out)] == [(f"hist{PROBES}",)]  # the one free slot


def test_slow_consumers_do_not_follow_and_outputs_stay():
    # a consumer taking more than its share of the producer's time runs apart
    s = make({"a": set(), "b": {"a"}, "c": {"a"}}, {"b", "c"}, fusion=fusion_config(),
             category=lambda k: "a" if k == "a" else "bc")  # fmt: skip
    (a,) = submits(s.start())
    assert a.keys[0] == "a" and set(a.keys[1:]) == {"b", "c"}  # probes
    s.handle(TaskFinished(a.copy, {"a": 0.1, "b": 0.05, "c": 0.05}, 16, sizes=(8, 8)))
    s2 = make({"a": set(), "b": {"a"}, "c": {"a"}}, {"b", "c"}, fusion=fusion_config(),
              category=lambda k: "a" if k == "a" else "bc",
              seed_runtimes=None)  # fmt: skip
    for name in ("a", "bc"):  # 100 ms each: past half of 100 ms
        s2.category(name).count, s2.category(name).total = 3, 0.3
    (a,) = submits(s2.start())
    assert a.keys == ("a",)
    # an output is kept whole: its consumers run apart
    s3 = make({"a": set(), "b": {"a"}}, {"a", "b"}, fusion=fusion_config())
    (a,) = submits(s3.start())
    assert a.keys == ("a",)


def test_a_lost_consumer_value_reruns_its_producer_and_a_running_group_that_drops_it():
    s = skim_state(capacity=1)
    (g0,) = submits(s.start())
    assert g0.keys == ("read0", "hist0", "write0")
    (g1,) = submits(s.handle(TaskFinished(g0.copy, {"read0": 0.1, "hist0": 0.001,
                                                     "write0": 0.004}, 16, "n0", sizes=(8, 8))))  # fmt: skip
    assert g1.keys == ("read1", "hist1", "write1")
    # hist0 is lost while nothing summed it yet: read0 runs again, with hist0 alone
    # (write0 is held)
    out = s.handle(ResultsLost(("hist0",), "node died"))
    s.validate_state()
    (rec,) = recovers(out)
    assert set(rec.recompute) == {"hist0", "read0"} and not cancels(out)
    (g2,) = submits(s.handle(TaskFinished(g1.copy, {"read1": 0.1, "hist1": 0.001,
                                                     "write1": 0.004}, 16, "n0", sizes=(8, 8))))  # fmt: skip
    s.validate_state()
    assert g2.keys == ("read0", "hist0") and g2.kept == ("hist0",)
    # now write0 is lost too, while read0 runs without keeping its value: that run
    # cannot give it, so it is cancelled and read0 runs again for both
    out = s.handle(ResultsLost(("write0",), "node died"))
    s.validate_state()
    assert cancels(out) == {g2.copy}
    (g3,) = submits(out)
    assert g3.keys == ("read0", "hist0", "write0")


def test_a_long_producer_with_its_consumers_is_duplicated():
    sp = Speculation(enabled=True, quantile=None, long_task=1.0, min_runtime=0.5, slow_node=None)
    deps = {"read": set(), "hist": {"read"}, "write": {"read"}}
    s = make(deps, {"hist", "write"}, capacity=2, speculation=sp, fusion=fusion_config())
    for name, seconds in (("read", 5.0), ("hist", 0.001), ("write", 0.004)):
        s.category(name).count, s.category(name).total = 1, seconds
    (first,) = submits(s.start())
    assert first.keys[0] == "read" and len(first.keys) == 3 and len(first.kept) == 2
    s.handle(TaskStarted(first.copy, "n0", 0.0))
    (dup,) = submits(s.handle(Tick(2.0, {"n1": 1})))
    s.validate_state()
    assert (dup.keys, dup.kept, dup.node) == (first.keys, first.kept, "n1")
    out = s.handle(TaskFinished(dup.copy, dict.fromkeys(dup.keys, 1.0), 16, "n1", sizes=(8, 8)))
    s.validate_state()
    (won,) = [i for i in out if isinstance(i, Won)]
    assert won.key == "read" and cancels(out) == {first.copy} and s.done


def nano_state(parts: int = 3, **kwargs) -> State:
    """A coffea skim per partition: ``read`` feeds accessors (``muon``, ``run``), a mask
    made from ``muon``, the selection ``sel`` reading ``read`` and ``mask``, and a
    parquet write and a histogram fill reading ``sel``; reductions read every
    partition's write and fill."""
    deps: dict = {}
    for i in range(parts):
        deps |= {f"read{i}": set(), f"muon{i}": {f"read{i}"}, f"run{i}": {f"read{i}"},
                 f"mask{i}": {f"muon{i}"}, f"sel{i}": {f"read{i}", f"mask{i}"},
                 f"write{i}": {f"sel{i}", f"run{i}"}, f"hist{i}": {f"sel{i}"}}  # fmt: skip
    deps["writes"] = {f"write{i}" for i in range(parts)}
    deps["hists"] = {f"hist{i}" for i in range(parts)}
    prio = {k: i for i, k in enumerate(sorted(deps, key=lambda k: (k[-1].isalpha(), k[-1], k)))}
    cat = lambda k: k.rstrip("0123456789")  # noqa: E731
    return State(deps, prio, {"writes", "hists"}, category=cat, fusion=fusion_config(), **kwargs)


def test_a_partitions_cheap_descendants_run_in_its_readers_task():
    # ``sel`` reads ``mask``, not in memory: under the consumers-only rule ``read`` ran
    # alone and each accessor was a Ray task of its own. Now every task reading nothing
    # but the group's values joins, to a fixpoint, and only what the reductions read
    # leaves the task.
    s = nano_state(capacity=1)
    (first,) = submits(s.start())
    assert first.keys[0] == "read0"
    assert set(first.keys) == {"read0", "muon0", "run0", "mask0", "sel0", "write0", "hist0"}
    order = first.keys  # topological: each runs after what it reads
    assert order.index("mask0") > order.index("muon0") and order.index("sel0") > order.index(
        "mask0"
    )
    assert set(first.kept) == {"write0", "hist0"}
    durations = {k: (1.4 if k.startswith("read") else 0.001) for k in first.keys}
    out = s.handle(TaskFinished(first.copy, durations, 40, "n0",
                                sizes=tuple(8 for _ in first.kept)))  # fmt: skip
    s.validate_state()
    for k in ("read0", "muon0", "run0", "mask0", "sel0"):  # never left the worker
        assert s.tasks[k].state == "released" and k not in releases(out)
    assert s.tasks["write0"].state == s.tasks["hist0"].state == "memory"
    (second,) = submits(out)  # the next partition's whole subgraph, measured cheap now
    assert len(second.keys) == 7 and set(second.kept) == {"write1", "hist1"}
