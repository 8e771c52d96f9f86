"""The scheduling core: a pure state machine over one compute's graph.

Events in, instructions out, no I/O and no Ray, in the manner of
``distributed.worker_state_machine``. The Ray layer (``raydag.runtime``) carries out
the instructions and feeds back what happened. Keeping every decision here (what runs
next, what may be freed, what to fuse, when to give up) lets it be tested on random
graphs without a cluster, and lets each new capability be new events and instructions
rather than a new loop.

A key moves ``waiting -> ready -> processing -> memory -> released``. A key is
released once every dependent has finished and it is not an output; a key fused into
a group as a non-root member goes from ``processing`` straight to ``released``: its
value only ever lived inside the Ray task that made and consumed it. A *bundle* (a
shuffle's map and its pieces, see ``State._init_bundles``) is the one group that keeps
several values: each piece is its own Ray object, held, released and lost on its own.

A group in flight runs as one or more *copies* (Ray tasks): its first, and the
speculative duplicates ``Tick`` may add on other nodes when CPUs are idle. The first
copy to finish wins, the others are cancelled; a copy that dies with its node while
another runs is dropped, not restarted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dask.utils import key_split

Key = Hashable

WAITING = "waiting"
READY = "ready"
PROCESSING = "processing"
MEMORY = "memory"
RELEASED = "released"


# Consumers that are not cheap still run in their producer's task when together they
# take at most this share of its runtime (a writer after an hour of processing).
CONSUMERS_SHARE = 0.5
# A consumer's category is judged on this many runs (the first run in a worker pays
# for imports and warm-up); until then it is probed, one group at a time.
PROBES = 3


class WorkerDiedError(RuntimeError):
    """A task kept killing the worker process running it; retries are exhausted."""


# ---- instructions (state machine -> Ray layer) ----------------------------------


@dataclass(frozen=True)
class Submit:
    """Run ``keys`` (topological order) as one Ray task; keep the last key's value."""

    group: int
    keys: tuple
    inputs: tuple
    priority: int
    resources: Mapping[str, float] | None
    attempt: int = 0
    # Report the start (``TaskStarted``): a duplicate needs the node to avoid.
    notify: bool = False
    # A speculative copy of group ``duplicate_of``, to run on ``node`` and nowhere else.
    duplicate_of: int | None = None
    node: str | None = None
    # ``node`` is a preference (storage-aware placement), not a must: if that node is
    # gone or busy, Ray runs the task elsewhere. ``placed``: why it was chosen.
    soft: bool = False
    placed: str = ""
    # Several values kept (a shuffle's map, ``returns`` its pieces): one Ray object
    # each. Empty: the root's value alone.
    returns: tuple = ()

    @property
    def root(self) -> Key:
        return self.keys[-1]

    @property
    def kept(self) -> tuple:
        """The keys whose values leave the Ray task, in order."""
        return self.returns or (self.keys[-1],)


@dataclass(frozen=True)
class Release:
    """Nothing needs this key's value any more: drop it."""

    key: Key


@dataclass(frozen=True)
class Cancel:
    """Stop this in-flight group; its result, if any arrives, is ignored.

    ``node``: where that copy runs, when known (a speculative copy's loser, a
    preempted duplicate): stopping it may take its worker process down, and the
    Ray layer starts a spare one there (see ``Runner._spare``).
    """

    group: int
    node: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Fail:
    """The compute has failed: raise ``error``, raised by ``key``."""

    key: Key
    error: Any


@dataclass(frozen=True)
class Recover:
    """One recovery wave: ``lost`` results are recomputed, with ``recompute``, at once.

    Nothing for the Ray layer to do (the Submits follow); it is there to be logged
    and recorded.
    """

    wave: int
    lost: tuple
    recompute: tuple
    reason: str = ""


@dataclass(frozen=True)
class Won:
    """A duplicate's result came first; ``losers`` (copies) are cancelled.

    Nothing for the Ray layer to do: it is there to be logged and recorded.
    ``saved`` estimates the seconds the duplicate saved: when a copy died with its
    node, how far the duplicate had got by then (the restart it spared); otherwise
    how much longer the loser had already run than the winner needed.
    """

    key: Key
    group: int
    copy: int
    losers: tuple
    saved: float
    reason: str = ""


Instruction = Submit | Release | Cancel | Fail | Recover | Won


# ---- events (Ray layer -> state machine) ----------------------------------------


@dataclass(frozen=True)
class TaskFinished:
    group: int
    durations: Mapping[Key, float] = field(default_factory=dict)
    nbytes: int = 0
    node: str | None = None  # where the value now lives
    # Facts for the run record, not used for decisions: when the group started on
    # its worker (wall clock, seconds since the epoch) and the worker's process id.
    started: float = 0.0
    worker: int = 0
    # The size of each kept value (``Submit.kept``), when the group keeps several.
    sizes: tuple = ()


@dataclass(frozen=True)
class TaskErred:
    """``key`` of ``group`` raised ``error``.

    ``retryable`` when the worker process died under it (counted against the task's
    retries); ``node_lost`` when its node died, which is no fault of the task's and
    is retried without counting.
    """

    group: int
    key: Key
    error: Any
    retryable: bool = False
    node_lost: bool = False


@dataclass(frozen=True)
class CapacityChanged:
    slots: float


@dataclass(frozen=True)
class Aborted:
    """The driver gives up (Ctrl-C): cancel everything, release everything."""


@dataclass(frozen=True)
class ResultsLost:
    """These keys' values are gone (their node died and no copy survives)."""

    keys: tuple
    reason: str = ""


@dataclass(frozen=True)
class TaskStarted:
    """Copy ``group`` began on ``node`` at ``started`` (wall clock, the worker's)."""

    group: int
    node: str
    started: float


@dataclass(frozen=True)
class Tick:
    """Time passes: ``now`` (wall clock); ``idle``: each alive node's free CPUs now.

    Speculation is decided here, a few times a second, from Ray's view of the free
    CPUs; and between ticks on ``TaskStarted`` and ``TaskFinished``, from that view
    kept up to date by those events (see ``State._speculate``).
    """

    now: float
    idle: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StoresSampled:
    """Every alive node's object store (``(used, capacity)`` bytes) and free CPUs, now.

    ``used`` counts what the store must keep (pinned copies), not cached copies of
    values held elsewhere, which Ray evicts when it needs the room.

    Placement is decided from the latest sample: a few a second, from the raylets.
    """

    stores: Mapping[str, tuple[int, int]]
    idle: Mapping[str, float] = field(default_factory=dict)


Event = (
    TaskFinished
    | TaskErred
    | CapacityChanged
    | Aborted
    | ResultsLost
    | TaskStarted
    | Tick
    | StoresSampled
)


@dataclass
class Copy:
    """One Ray task running a group: where and since when, once it said so."""

    node: str | None = None
    started: float | None = None
    duplicate: bool = False


@dataclass
class Group:
    id: int
    keys: tuple
    members: frozenset
    inputs: tuple
    cost: float
    attempt: int = 0
    # copy id -> Copy, for each Ray task running it; the first copy's id is ``id``
    copies: dict = field(default_factory=dict)
    # when a copy died with its node while a duplicate ran on (for ``Won.saved``)
    spared_at: float | None = None
    duplicated: int = 0  # duplicates started, ever: capped by Speculation.max_copies
    returns: tuple = ()  # the kept values when several (bundle pieces, consumers)
    # Consumers run in the task of the key they read (``State._consumers``), last in
    # ``keys``: the key before them leaves nothing in the object store.
    consumers: tuple = ()

    @property
    def kept(self) -> tuple:
        return self.returns or (self.keys[-1],)

    @property
    def lead(self) -> Key:
        """The key the group runs for: its root, or the key its consumers read."""
        return self.keys[-1 - len(self.consumers)]


@dataclass(frozen=True)
class Fusion:
    """When tasks are cheap enough to run several in one Ray task (see README)."""

    enabled: bool = True
    max_task_duration: float = 0.005
    max_group_duration: float = 0.25
    max_group_size: int = 256


@dataclass(frozen=True)
class Speculation:
    """When a running task gets a duplicate on another node (see README).

    A copy is *long* once its category's mean runtime is at least ``long_task``
    (from its start: such a task is duplicated as soon as a CPU is free), or once
    it has run ``min_runtime`` and either its runtime is past the ``quantile`` of
    its category's finished runtimes (with ``min_samples`` of them) or its own
    runtime so far is at least ``long_task``. Either test is off when ``None``. A
    task gets at most ``max_copies`` duplicates in all (a preempted or dead one
    counts: no churn).

    A node is *slow* once tasks finished there (at least two, of categories with
    ``min_samples`` runtimes) took a median of ``slow_node`` times their category's
    mean: a copy running there is a straggler from its start, and no duplicate is
    sent there. While a node is slow, or a first copy has run ``slow_node`` times its
    category's mean, a ready task of a category known long goes first. ``None``: off.
    """

    enabled: bool = False
    quantile: float | None = 0.95
    min_samples: int = 5
    long_task: float | None = None
    min_runtime: float = 10.0
    max_in_flight: int = 4
    max_copies: int = 1
    slow_node: float | None = None


@dataclass(frozen=True)
class Placement:
    """Where a task should run, given how full each node's object store is (see README).

    A node is *full* above ``high_water`` (a fraction of its store), and *crowded*
    when full or, above half the high-water mark, fuller than the emptiest node by
    more than ``balance``. While no node is crowded, Ray's own locality decides (the
    node holding most of a task's input bytes). Once one is, raydag places every
    task itself: on that preferred node unless it is crowded, else on the node with
    the most free store among those with a free CPU. While a node is full, tasks
    that read intermediates go before tasks that read none, so the stores drain
    before they fill.
    """

    enabled: bool = False
    high_water: float = 0.7
    balance: float = 0.1
    # Only tasks whose category's values are this big on average are placed: moving a
    # task that makes little (a summary, a value Ray inlines) frees nothing where its
    # inputs are and copies them where it goes.
    min_output: int = 100 * 1024


class Runtimes:
    """A category's runtimes: count and total (the mean), the latest samples (quantiles)."""

    KEEP = 1000

    __slots__ = ("count", "total", "samples", "_next")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.samples: list[float] = []
        self._next = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        if len(self.samples) < self.KEEP:
            self.samples.append(seconds)
        else:  # a ring: the latest KEEP, in case the category changes pace
            self.samples[self._next] = seconds
            self._next = (self._next + 1) % self.KEEP

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile of the kept samples."""
        s = sorted(self.samples)
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class State:
    """What is waiting, ready, running, held and released, for one compute."""

    PACE = 8  # a node's latest runtimes kept to judge it slow

    def __init__(
        self,
        dependencies: Mapping[Key, Iterable[Key]],
        priorities: Mapping[Key, int],
        outputs: Iterable[Key],
        *,
        capacity: float,
        available: Iterable[Key] = (),
        resources: Mapping[Key, Mapping[str, float]] | None = None,
        retries: Mapping[Key, int] | None = None,
        default_retries: int = 3,
        fusion: Fusion = Fusion(enabled=False),
        category: Callable[[Key], str] = key_split,
        cheap_cost: float = 1.0,
        fixed: Iterable[Key] = (),
        speculation: Speculation = Speculation(),
        seed_runtimes: Mapping[str, Iterable[float]] | None = None,
        placement: Placement = Placement(),
        bundles: Mapping[Key, Iterable[Key]] | None = None,
    ):
        self.dependencies = {k: frozenset(v) for k, v in dependencies.items()}
        self.dependents: dict[Key, set] = {k: set() for k in self.dependencies}
        for k, deps in self.dependencies.items():
            for d in deps:
                self.dependents[d].add(k)
        self.priorities = priorities
        self.outputs = set(outputs)
        self.capacity = capacity
        self.resources = dict(resources or {})
        self.retries = dict(retries or {})
        self.default_retries = default_retries
        self.fusion = fusion
        self.category = category
        # A task measured to run shorter than fusion's max-task-duration takes this
        # fraction of a slot: more of them in flight hide Ray's round trip.
        self.cheap_cost = cheap_cost
        self.available = set(available)
        # given values that nothing here can recompute (no lineage in the graph)
        self.fixed = set(fixed)

        self.state: dict[Key, str] = {}
        self.missing: dict[Key, int] = {}
        self.waiters = {k: len(v) for k, v in self.dependents.items()}
        # (tier, priority, seq, key): tier 0 is recovery, ahead of everything else
        self.ready: list[tuple[int, int, int, Key]] = []
        # the ready tasks of categories known long, also in the heaps above: they go
        # first while the cluster is short-handed (see ``_short_handed``)
        self.ready_long: list[tuple[int, int, int, Key]] = []
        self.recovering: set = set()
        self.wave = 0
        self.where: dict[Key, str | None] = {}  # node holding each value in memory
        self.groups: dict[int, Group] = {}
        self.group_of: dict[Key, int] = {}
        self.used = 0.0
        self.failed: tuple[Key, Any] | None = None
        self.aborted = False
        # category -> [count, total seconds], learned from finished tasks
        self.stats: dict[str, list] = {}
        self.speculation = speculation
        # category -> Runtimes, for speculation: seeded from an earlier run, then learned
        self.runtimes: dict[str, Runtimes] = {}
        for cat, seconds in (seed_runtimes or {}).items():
            r = self.runtimes[cat] = Runtimes()
            for x in seconds:
                r.add(float(x))
        # categories known long (mean at least long_task): their ready tasks also
        # wait in ``ready_long``; empty unless speculation may reorder
        self.long_cats = {c for c, r in self.runtimes.items() if self._long_mean(r)}
        self._short_handed_now: bool | None = None  # per event: see ``_short_handed``
        self.copy_of: dict[int, int] = {}  # duplicate copy id -> its group's id
        # speculation's view of each node's free CPUs: the latest Tick's, plus what a
        # finished copy freed and less what a started copy or a duplicate took since
        self.free: dict[str, float] = {}
        # node -> its latest tasks' runtimes over their category's mean (slow nodes)
        self.pace: dict[str, list[float]] = {}
        # (node, CPUs): where a duplicate just won; the step's next tasks go there
        self.steer: tuple[str, float] | None = None
        self.placement = placement
        self.nbytes: dict[Key, int] = {}  # size of each value in memory, as measured
        # the latest store sample: node -> (used, capacity) bytes, and free CPUs per
        # node (less what was placed there since)
        self.stores: dict[str, tuple[int, int]] = {}
        self.idle: dict[str, float] = {}
        self.full: set[str] = set()  # nodes whose store is above the high-water mark
        self.crowded: set[str] = set()  # full, or much fuller than the emptiest node
        self.sizes: dict[str, list] = {}  # category -> [count, total bytes] of its values
        # ready keys that read no intermediate (sources): under store pressure they
        # wait behind ready keys that do (consumers), which free what they read
        self.ready_sources: list[tuple[int, int, int, Key]] = []
        self._init_bundles(bundles or {})
        self.now = 0.0  # the latest Tick's wall clock
        self._next_group = 0
        self._seq = 0

    @classmethod
    def from_graph(cls, graph: Any, **kwargs: Any) -> State:
        return cls(
            graph.dependencies,
            graph.priorities,
            graph.outputs,
            available=graph.external,
            fixed=set(graph.external) - graph.lineage,
            resources=graph.annotations.get("resources"),
            retries=graph.annotations.get("retries"),
            **kwargs,
        )

    # ---- public -----------------------------------------------------------------

    @property
    def done(self) -> bool:
        if self.failed or self.aborted:
            return True
        return not self.groups and all(self.state[k] == MEMORY for k in self.outputs)

    def start(self) -> list[Instruction]:
        # What the outputs need, stopping at given values. The rest (the lineage of
        # given values) starts released: it runs only if a given value is lost.
        needed: set = set()
        stack = list(self.outputs)
        while stack:
            k = stack.pop()
            if k not in needed:
                needed.add(k)
                if k not in self.available:
                    stack.extend(self.dependencies[k])
        for k in self.dependencies:
            if k in self.available:
                self.state[k] = MEMORY
            elif k not in needed:
                self.state[k] = RELEASED
        for k, deps in self.dependencies.items():
            if k in self.state:
                continue
            self.missing[k] = sum(self.state.get(d) != MEMORY for d in deps)
            if self.missing[k]:
                self.state[k] = WAITING
            else:
                self._make_ready(k)
        for k, dependents in self.dependents.items():
            self.waiters[k] = sum(self.state[d] not in (MEMORY, RELEASED) for d in dependents)
        out: list[Instruction] = []
        for k in self.available:  # given values that nothing here reads
            if self.waiters[k] == 0 and k not in self.outputs:
                self._release(k, out)
        self._fill(out)
        return out

    def handle(self, event: Event) -> list[Instruction]:
        out: list[Instruction] = []
        self._short_handed_now = None
        if isinstance(event, TaskFinished):
            if self._finished(event, out):
                self._fill(out)
                self.steer = None
                self._speculate(out, tick=False)
            return out
        elif isinstance(event, TaskErred):
            self._erred(event, out)
        elif isinstance(event, CapacityChanged):
            self.capacity = event.slots
        elif isinstance(event, Aborted):
            self.aborted = True
            self._stop(out)
        elif isinstance(event, ResultsLost):
            self._lost(event, out)
        elif isinstance(event, TaskStarted):
            g = self._live(event.group)
            if g is not None:
                c = g.copies[event.group]
                c.node, c.started = event.node, event.started
                self.now = max(self.now, event.started)
                if not c.duplicate:  # a duplicate's CPU was taken when it was sent
                    left = self.free.get(event.node, 0.0) - self._cpus(g)
                    self.free[event.node] = max(0.0, left)
                self._speculate(out, tick=False)
            return out
        elif isinstance(event, StoresSampled):
            self._sampled(event)
        elif isinstance(event, Tick):
            self.now = max(self.now, event.now)
            self.free = {n: c for n, c in event.idle.items() if c > 0}
            self._fill(out)
            self._speculate(out, tick=True)
            return out
        else:
            raise TypeError(f"Unknown event {event!r}")
        self._fill(out)
        return out

    def estimate(self, key: Key) -> float | None:
        """Mean runtime of the key's category so far, ``None`` before the first one."""
        s = self.stats.get(self.category(key))
        return s[1] / s[0] if s else None

    # ---- transitions ------------------------------------------------------------

    def _make_ready(self, key: Key) -> None:
        self.state[key] = READY
        self._seq += 1
        tier = 0 if key in self.recovering else 1
        entry = (tier, self.priorities[key], self._seq, key)
        source = self.dependencies[key] <= self.available  # reads no intermediate
        heapq.heappush(self.ready_sources if source else self.ready, entry)
        if self._known_long(key):
            heapq.heappush(self.ready_long, entry)

    def _release(self, key: Key, out: list[Instruction]) -> None:
        self.state[key] = RELEASED
        self.where.pop(key, None)
        self.nbytes.pop(key, None)
        out.append(Release(key))

    def _live(self, copy: int) -> Group | None:
        """The group that ``copy`` runs, if that copy still counts."""
        g = self.groups.get(self.copy_of.get(copy, copy))
        return g if g is not None and copy in g.copies else None

    def _drop_copy(self, group: Group, copy: int) -> None:
        del group.copies[copy]
        self.copy_of.pop(copy, None)
        self.used -= group.cost

    def _finished(self, ev: TaskFinished, out: list[Instruction]) -> bool:
        """Take a copy's result; ``False`` if it is not ours to take (nothing changed)."""
        group = self._live(ev.group)
        if group is None:  # cancelled or superseded: its result is not ours to keep
            return False
        del self.groups[group.id]
        winner = group.copies[ev.group]
        losers = tuple(c for c in group.copies if c != ev.group)
        if self.speculation.enabled:
            if ev.started:
                self.now = max(self.now, ev.started + sum(ev.durations.values()))
            if ev.node is not None:  # the winner's CPU is free now (the losers' once cancelled)
                self.free[ev.node] = max(self.free.get(ev.node, 0.0), self._cpus(group))
        if winner.duplicate:
            out.append(self._won(group, ev, losers))
        for c in losers:
            out.append(Cancel(c, group.copies[c].node))
        if losers and ev.node is not None:
            # The losers' nodes are losing their worker processes (a forced cancel), and
            # Ray's locality may well send the next task to one of them, to wait seconds
            # for a new process; the winner's node has a CPU and a worker free right now.
            self.steer = (ev.node, self._cpus(group))
        for c in group.copies:
            self.copy_of.pop(c, None)
        self.used -= group.cost * len(group.copies)
        kept = group.kept
        learn = self.speculation.enabled
        # a lone task's pace tells its node's (not a fused group's: cheap by construction)
        pace = None
        alone = len(group.keys) == 1 + len(group.consumers)
        if learn and self.speculation.slow_node is not None and alone:
            pace = self.pace.setdefault(ev.node, []) if ev.node is not None else None
        for m in group.keys:
            del self.group_of[m]
            if m in ev.durations:
                cat = self.category(m)
                s = self.stats.setdefault(cat, [0, 0.0])
                s[0] += 1
                s[1] += ev.durations[m]
                if learn:
                    r = self.runtimes.get(cat)
                    if r is None:
                        r = self.runtimes[cat] = Runtimes()
                    if pace is not None and r.count >= self.speculation.min_samples and r.mean:
                        pace.append(ev.durations[m] / r.mean)
                        del pace[: -self.PACE]
                    r.add(ev.durations[m])
                    if not self._long_mean(r):
                        self.long_cats.discard(cat)
                    elif cat not in self.long_cats:
                        self.long_cats.add(cat)
                        self._index_long(cat)
            for dep in self.dependencies[m]:
                if dep in group.members:
                    continue
                self.waiters[dep] -= 1
                if self.waiters[dep] == 0 and dep not in self.outputs:
                    self._release(dep, out)
            if m not in kept:
                self.waiters[m] = 0
                self.state[m] = RELEASED
            self.recovering.discard(m)
        sizes = ev.sizes
        if len(sizes) != len(kept):  # not told: a bundle's pieces are about alike
            sizes = (ev.nbytes // len(kept),) * len(kept)
        for root, nbytes in zip(kept, sizes, strict=True):
            if self.placement.enabled:  # sizes per category: only placement reads them
                size = self.sizes.setdefault(self.category(root), [0, 0])
                size[0] += 1
                size[1] += nbytes
            self.state[root] = MEMORY
            self.where[root] = ev.node
            self.nbytes[root] = nbytes
            for d in self.dependents[root]:
                if self.state[d] != WAITING:  # given, or released lineage of a given value
                    continue
                self.missing[d] -= 1
                if self.missing[d] == 0:
                    self._make_ready(d)
            if self.waiters[root] == 0 and root not in self.outputs:  # a piece nobody reads
                self._release(root, out)
        return True

    def _won(self, group: Group, ev: TaskFinished, losers: tuple) -> Won:
        win = group.copies[ev.group]
        start = ev.started or win.started or self.now
        if group.spared_at is not None:
            saved = group.spared_at - start
            why = "a copy's node died while the duplicate ran"
        else:
            firsts = [group.copies[c].started for c in losers if group.copies[c].started]
            saved = start - min(firsts) if firsts else 0.0
            why = "the duplicate finished first"
        return Won(group.lead, group.id, ev.group, losers, max(0.0, saved), why)

    def _erred(self, ev: TaskErred, out: list[Instruction]) -> None:
        group = self._live(ev.group)
        if group is None:
            return
        if len(group.copies) > 1:
            if ev.node_lost or ev.retryable:  # another copy carries on: no restart
                if ev.node_lost and not group.copies[ev.group].duplicate:
                    group.spared_at = self.now
                self._drop_copy(group, ev.group)
                return
            # The task's own error, whichever copy raised it: the others stop.
            for c in [c for c in group.copies if c != ev.group]:
                out.append(Cancel(c))
                self._drop_copy(group, c)
        if ev.node_lost:
            out.append(self._submit_instruction(group))
            return
        annotated = max((self.retries.get(k, 0) for k in group.keys), default=0)
        limit = max(annotated, self.default_retries) if ev.retryable else annotated
        if group.attempt < limit:
            group.attempt += 1
            out.append(self._submit_instruction(group))
            return
        error = ev.error
        if ev.retryable:
            error = WorkerDiedError(
                f"Task {ev.key!r} (category {self.category(ev.key)!r}) killed its worker "
                f"process {group.attempt + 1} times (out of memory, or a crash); last: "
                f"{type(ev.error).__name__}: {ev.error}"
            )
            error.__cause__ = ev.error if isinstance(ev.error, BaseException) else None
        self.failed = (ev.key, error)
        del self.groups[group.id]
        self.copy_of.pop(ev.group, None)
        self._stop(out)
        out.append(Fail(ev.key, error))

    def _lost(self, ev: ResultsLost, out: list[Instruction]) -> None:
        """Recompute, in one wave, every lost value still needed and what it needs.

        A value in memory is needed by definition (it is released once nothing
        needs it), so every lost one is recomputed; so are the released inputs of
        those recomputations, transitively, and nothing else. Groups in flight that
        read a lost value cannot finish: they are cancelled and wait again.
        """
        lost = [k for k in ev.keys if self.state.get(k) == MEMORY]
        if not lost:
            return
        given = [k for k in lost if k in self.fixed]
        if given:
            err = RuntimeError(
                f"{given[0]!r} was given to this compute (persisted earlier) and is lost: "
                f"{ev.reason or 'its node died'}; raydag holds no lineage for it"
            )
            self.failed = (given[0], err)
            self._stop(out)
            out.append(Fail(given[0], err))
            return
        lost_set = set(lost)
        reset: list = []
        for gid, g in list(self.groups.items()):
            if lost_set.intersection(g.inputs):
                reset.extend(self._reset_group(gid, out))
        recompute: list = []
        seen: set = set()
        stack = list(lost)
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            recompute.append(k)
            for d in self.dependencies[k]:
                if d in self.available and self.state[d] == RELEASED:
                    self.state[d] = MEMORY  # the given value is still held by its owner
                elif self.state[d] == RELEASED or d in lost_set:
                    stack.append(d)
        for k in recompute:
            self.state[k] = WAITING
            self.where.pop(k, None)
            self.nbytes.pop(k, None)
        reset.extend(self._unkept(recompute, out))
        self.recovering.update(recompute)
        self.wave += 1
        out.append(Recover(self.wave, tuple(lost), tuple(recompute), ev.reason))
        # Recount what changed: who waits on what, and who is ready now.
        touched = set(recompute) | set(reset)
        for k in lost:
            touched.update(self.dependents[k])
        for k in touched:
            if self.state[k] not in (WAITING, READY):
                continue
            self.missing[k] = sum(self.state[d] != MEMORY for d in self.dependencies[k])
            if self.missing[k] == 0 and self.state[k] == WAITING:
                self._make_ready(k)
            elif self.missing[k] and self.state[k] == READY:
                self.state[k] = WAITING
        for k in {d for r in touched for d in self.dependencies[r]} | set(recompute):
            self.waiters[k] = sum(
                self.state[d] not in (MEMORY, RELEASED) for d in self.dependents[k]
            )

    def _unkept(self, recompute: list, out: list[Instruction]) -> list:
        """Groups in flight that make, but do not keep, a value that ``recompute`` reads
        (a shuffle's map running for other pieces, a producer running with other
        consumers): they cannot hand it over, so they are cancelled and run again with
        every reader then waiting."""
        reset: list = []
        for k in recompute:
            for d in self.dependencies[k]:
                gid = self.group_of.get(d)
                if gid is not None and d not in self.groups[gid].kept:
                    reset.extend(self._reset_group(gid, out))
        return reset

    def _reset_group(self, gid: int, out: list[Instruction]) -> tuple:
        """Cancel an in-flight group: its keys wait again. Returns them."""
        g = self.groups.pop(gid)
        for c in g.copies:
            out.append(Cancel(c))
            self.copy_of.pop(c, None)
        self.used -= g.cost * len(g.copies)
        for m in g.keys:
            del self.group_of[m]
            self.state[m] = WAITING
        return g.keys

    def _stop(self, out: list[Instruction]) -> None:
        for g in self.groups.values():
            for c in g.copies:
                out.append(Cancel(c))
        self.groups.clear()
        self.copy_of.clear()
        self.group_of.clear()
        self.used = 0.0
        self.ready.clear()
        self.ready_sources.clear()
        self.ready_long.clear()
        for k, s in self.state.items():
            if s == MEMORY:
                self._release(k, out)

    # ---- choosing work ----------------------------------------------------------

    def _fill(self, out: list[Instruction]) -> None:
        if self.failed or self.aborted:
            return
        while (heap := self._next_ready()) is not None:
            key = heap[0][-1]
            cost = self._cost(key, self.estimate(key))
            if self.used and self.used + cost > self.capacity and not self._preempt(cost, out):
                return
            heapq.heappop(heap)
            keys = self._fuse(key)
            returns = self._bundle_returns(keys)
            bundle = bool(returns)
            consumers = () if bundle else self._consumers(keys)
            if consumers:
                keys += consumers
                returns = consumers if len(consumers) > 1 else ()
            if len(keys) > 1 and not bundle:
                estimates = [self.estimate(k) for k in keys]
                total = None if None in estimates else sum(estimates)
                fused = self._cost(key, total)
                # A group takes at most what is left: fusing must not wait for a
                # whole free slot, nor push the work in flight past capacity.
                cost = min(fused, self.capacity - self.used) if self.used else fused
            members = frozenset(keys)
            inputs = tuple(
                {d: None for m in keys for d in self.dependencies[m] if d not in members}
            )
            group = Group(
                self._next_group, keys, members, inputs, cost, returns=returns, consumers=consumers
            )
            self._next_group += 1
            self.groups[group.id] = group
            self.used += cost
            for m in keys:
                self.state[m] = PROCESSING
                self.group_of[m] = group.id
            out.append(self._submit_instruction(group))

    def _next_ready(self) -> list | None:
        """The heap whose top runs next: by priority, but consumers first while a store
        is full (what they read is freed when they finish; a source only adds)."""
        for h in (self.ready, self.ready_sources):
            while h and self.state[h[0][-1]] != READY:  # fused into a group, or input lost
                heapq.heappop(h)
        long = self.ready_long  # also gone: a category whose mean fell below long-task
        while long and (self.state[long[0][-1]] != READY or not self._known_long(long[0][-1])):
            heapq.heappop(long)
        if long and self._short_handed():
            tops = [h[0] for h in (self.ready, self.ready_sources) if h]
            if long[0][0] <= min(tops)[0]:  # never ahead of a recovery wave
                return long
        if not self.ready_sources:
            return self.ready or None
        if not self.ready:
            return self.ready_sources
        if self.full or self.ready[0] < self.ready_sources[0]:
            return self.ready
        return self.ready_sources

    def _submit_instruction(self, group: Group) -> Submit:
        """The group's first copy (again, after a retry): the only one running it."""
        for c in group.copies:
            self.copy_of.pop(c, None)
        group.copies = {group.id: Copy()}
        root = group.keys[-1]
        node, why = self._place(group)
        if node is None and self.steer is not None:
            steer, free = self.steer
            cpus = self._cpus(group)
            if cpus <= free and set(self.resources.get(root) or ()) <= {"CPU"}:
                node, why = steer, "a duplicate won there (its losers' workers are stopped)"
                self.steer = (steer, free - cpus) if free > cpus else None
        return Submit(
            group.id,
            group.keys,
            group.inputs,
            self.priorities[root],
            self.resources.get(root),
            group.attempt,
            # Where and since when a task runs: for duplicates, and because a running
            # task holds its inputs (a node that made them may die, see the runtime).
            notify=not all(self._cheap(k) for k in group.keys),
            node=node,
            soft=node is not None,
            placed=why,
            returns=group.returns,
        )

    # ---- placement --------------------------------------------------------------

    def _sampled(self, ev: StoresSampled) -> None:
        if not self.placement.enabled:
            return
        self.stores = dict(ev.stores)
        self.idle = dict(ev.idle)
        self._crowding()

    def _crowding(self) -> None:
        p = self.placement
        filled = {n: used / cap for n, (used, cap) in self.stores.items() if cap}
        low = min(filled.values(), default=0.0)
        self.full = {n for n, f in filled.items() if f > p.high_water}
        heavy = {n for n, f in filled.items() if f > p.high_water / 2 and f - low > p.balance}
        self.crowded = self.full | heavy

    def _place(self, group: Group) -> tuple[str | None, str]:
        """The node for a group's first copy, and why; ``None``: Ray's locality decides.

        Only while some store is crowded, and only groups whose category makes big
        values (``min_output``): then the node holding most of the group's
        input bytes, unless it is crowded too, else the node with the most free store
        among those not crowded with a free CPU (or else not crowded, or else not
        full; when every store is full, Ray decides: moving work would only add
        copies).
        What is placed counts against the node until the next sample: its CPUs, the
        inputs it fetches and the output its category usually makes.
        """
        if not self.crowded:
            return None, ""
        root = group.keys[-1]
        count, total = self.sizes.get(self.category(root), (0, 0))
        if not count or total / count < self.placement.min_output:
            return None, ""
        r = self.resources.get(root) or {}
        if set(r) - {"CPU", "GPU", "memory"}:  # custom resources say where it may run
            return None, ""
        cpus = float(r.get("CPU", 1))
        held: dict[str, int] = {}
        for d in group.inputs:
            n = self.where.get(d)
            if n in self.stores:
                held[n] = held.get(n, 0) + self.nbytes.get(d, 0)
        best = max(held, key=lambda n: (held[n], n)) if held else None
        if best is not None and best not in self.crowded:
            node, why = best, "holds most input bytes"
        else:
            roomy = [n for n in self.stores if n not in self.crowded]
            free = [n for n in roomy if self.idle.get(n, 0.0) >= cpus]
            some = free or roomy or [n for n in self.stores if n not in self.full]
            if not some:  # every store is full: moving work would only add copies
                return None, ""
            node = max(some, key=lambda n: (self.stores[n][1] - self.stores[n][0], n))
            why = "most free store" + (f"; {best[:12]} is crowded" if best else "")
        self.idle[node] = self.idle.get(node, 0.0) - cpus
        used, cap = self.stores[node]
        used += sum(b for n, b in held.items() if n != node) + total // count
        self.stores[node] = (used, cap)
        self._crowding()
        return node, why

    # ---- speculation ------------------------------------------------------------

    def _may_duplicate(self, group: Group) -> bool:
        """Only a lone task that needs nothing but CPUs, of a category not known cheap."""
        lead = group.lead
        alone = len(group.keys) == 1 + len(group.consumers)  # consumers may come along
        r = self.resources.get(lead)
        return alone and not self._cheap(lead) and set(r or ()) <= {"CPU"}

    def _preempt(self, cost: float, out: list[Instruction]) -> bool:
        """Cancel duplicates, youngest first, if that lets a first copy of ``cost`` run.

        Duplicates only borrow idle CPUs: ready work never waits for them.
        """
        if not self.copy_of:
            return False
        # a duplicate that is its group's last copy (the first died) is not spare
        dups = [
            (self.groups[g].copies[c], c, self.groups[g])
            for c, g in self.copy_of.items()
            if len(self.groups[g].copies) > 1
        ]
        firsts = self.used - sum(g.cost for _, _, g in dups)
        if not dups or (firsts and firsts + cost > self.capacity + 1e-9):
            return False
        dups.sort(key=lambda d: -(d[0].started or math.inf))
        for _, c, g in dups:
            if self.used and self.used + cost > self.capacity + 1e-9 and len(g.copies) > 1:
                out.append(Cancel(c, g.copies[c].node))
                self._drop_copy(g, c)
        return True

    def _speculate(self, out: list[Instruction], tick: bool) -> None:
        """Duplicate long-running copies onto free CPUs of other nodes.

        On a ``Tick``, the free CPUs are Ray's (``self.free`` is reset from it). On
        ``TaskStarted`` and ``TaskFinished``, they are that view kept up to date by
        raydag's own events, which Ray's lags by a poll or so: the CPU a copy freed
        is taken at once. Only while every copy in flight is known started: a copy
        sent but not started yet may be bound for that CPU, and goes first.
        """
        sp = self.speculation
        if not sp.enabled or self.failed or self.aborted:
            return
        if self._next_ready() is not None:  # first copies go first
            return
        if len(self.copy_of) >= sp.max_in_flight or self.used >= self.capacity:
            return
        idle = {n: c for n, c in self.free.items() if c > 0}
        if not idle:
            return
        if not tick and any(
            c.node is None for g in self.groups.values() for c in g.copies.values()
        ):
            return
        candidates = []
        for g in self.groups.values():
            if g.duplicated >= sp.max_copies or not self._may_duplicate(g):
                continue
            copies = g.copies.values()
            if any(c.node is None for c in copies):  # a copy not placed yet: nothing to avoid
                continue
            starts = [c.started for c in copies if c.started is not None]
            if not starts:
                continue
            ran = self.now - min(starts)
            if self._long(g.lead, ran) or any(self._slow(c.node) for c in copies):
                candidates.append((self.priorities[g.lead], g.id))
        for _, gid in sorted(candidates):
            if len(self.copy_of) >= sp.max_in_flight:
                return
            g = self.groups[gid]
            if self.used + g.cost > self.capacity + 1e-9:
                return
            cpus = self._cpus(g)
            avoid = {c.node for c in g.copies.values()}
            nodes = [
                n for n, c in idle.items() if n not in avoid and c >= cpus and not self._slow(n)
            ]
            if not nodes:
                continue
            node = max(nodes, key=lambda n: (idle[n], n))
            idle[node] -= cpus
            self.free[node] = idle[node]
            cid = self._next_group
            self._next_group += 1
            g.copies[cid] = Copy(node=node, duplicate=True)
            g.duplicated += 1
            self.copy_of[cid] = gid
            self.used += g.cost
            root = g.keys[-1]
            out.append(
                Submit(
                    cid,
                    g.keys,
                    g.inputs,
                    self.priorities[root],
                    self.resources.get(root),
                    g.attempt,
                    notify=True,
                    duplicate_of=gid,
                    node=node,
                    returns=g.returns,
                )
            )

    def _slow(self, node: str | None) -> bool:
        """Have tasks run ``slow_node`` times their category's mean on this node?"""
        factor = self.speculation.slow_node
        pace = self.pace.get(node) if factor is not None and node is not None else None
        if not pace or len(pace) < 2:
            return False
        s = sorted(pace)
        return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2 >= factor

    def _long_mean(self, r: Runtimes) -> bool:
        """Does this category's mean make it known long, for reordering?"""
        sp = self.speculation
        if not sp.enabled or sp.long_task is None or sp.slow_node is None:
            return False
        return r.count > 0 and r.mean >= sp.long_task

    def _known_long(self, key: Key) -> bool:
        return bool(self.long_cats) and self.category(key) in self.long_cats

    def _index_long(self, cat: str) -> None:
        """A category just became known long: its ready tasks join ``ready_long``."""
        for entry in (*self.ready, *self.ready_sources):
            key = entry[-1]
            if self.state[key] == READY and self.category(key) == cat:
                heapq.heappush(self.ready_long, entry)

    def _short_handed(self) -> bool:
        """Is a node slow, or a first copy running ``slow_node`` times its category's mean?

        Then the cluster does less than it seemed, and a task known long started last
        (dask's order puts it anywhere) would start late: it goes next instead. Without
        a straggler it keeps its place: started early, it would hold a CPU that its
        duplicate could only get once the other tasks are done.
        """
        if self._short_handed_now is None:  # once per event: no copy starts meanwhile
            self._short_handed_now = self._straggling()
        return self._short_handed_now

    def _straggling(self) -> bool:
        factor, sp = self.speculation.slow_node, self.speculation
        if factor is None:
            return False
        if any(self._slow(n) for n in self.pace if n in self.free):  # alive, by the Tick
            return True
        for g in self.groups.values():
            r = self.runtimes.get(self.category(g.lead))
            if r is None or len(r.samples) < sp.min_samples or not r.mean:
                continue
            late = self.now - factor * r.mean  # a first copy started by then straggles
            for c in g.copies.values():
                if not c.duplicate and c.started is not None and c.started <= late:
                    return True
        return False

    def _cpus(self, group: Group) -> float:
        return float((self.resources.get(group.lead) or {}).get("CPU", 1))

    def _long(self, key: Key, ran: float) -> bool:
        """Has this task, running for ``ran`` seconds, run long for its category?

        A category known long (its mean at least ``long_task``) is long from its
        start: ``min_runtime`` guards the tests on the task's own runtime only, which
        say nothing until it has run a while.
        """
        sp = self.speculation
        r = self.runtimes.get(self.category(key))
        if sp.long_task is not None and r is not None and r.count and r.mean >= sp.long_task:
            return True
        if ran < sp.min_runtime:
            return False
        if sp.long_task is not None and ran >= sp.long_task:
            return True
        if sp.quantile is not None and r is not None and len(r.samples) >= sp.min_samples:
            return ran > r.quantile(sp.quantile)
        return False

    def _cost(self, key: Key, estimate: float | None) -> float:
        r = self.resources.get(key)
        cpus = float(r.get("CPU", 1)) if r else 1.0
        if estimate is not None and estimate < self.fusion.max_task_duration:
            return cpus * self.cheap_cost
        return cpus

    def _cheap(self, key: Key) -> bool:
        est = self.estimate(key)
        return est is not None and est < self.fusion.max_task_duration

    def _same_kind(self, a: Key, b: Key) -> bool:
        return self.resources.get(a) == self.resources.get(b) and self.retries.get(
            a
        ) == self.retries.get(b)

    def _fuse(self, key: Key) -> tuple:
        """``key`` plus the cheap consumers it completes, and what else feeds only them.

        Walk up from ``key`` while the current task's only dependent needs nothing
        but the current task, values in memory, and cheap subtrees whose leaves are
        ready and whose every value feeds only the next task up (a chain, or a
        reduction tree over fresh inputs). Every member but the last has its one
        consumer inside the group, so its value never leaves the Ray task.
        """
        if key in self.bundles:
            return self._bundle(key)
        f = self.fusion
        if not f.enabled or not self._cheap(key) or key in self.piece_of:
            return (key,)
        keys = [key]
        members = {key}
        total = self.estimate(key) or 0.0
        cur = key
        # a given value recomputed after a loss must reach the object store, like an
        # output, so the Ray layer can hand it back to its owner: never fused away
        while (
            cur not in self.outputs and cur not in self.available and len(self.dependents[cur]) == 1
        ):
            (nxt,) = self.dependents[cur]
            if nxt in self.bundles or nxt in self.piece_of:  # a bundle runs as its own group
                break
            if self.state[nxt] != WAITING or not self._cheap(nxt) or not self._same_kind(key, nxt):
                break
            budget = f.max_group_size - len(keys) - 1
            if budget < 0:  # no room for ``nxt`` itself
                break
            extra: list = []
            for d in sorted(self.dependencies[nxt] - members, key=self.priorities.__getitem__):
                if self.state[d] == MEMORY:
                    continue
                sub = self._exclusive_subtree(d, key, budget - len(extra))
                if sub is None:
                    return tuple(keys)
                extra.extend(sub)
            more = sum(self.estimate(d) or 0.0 for d in extra) + (self.estimate(nxt) or 0.0)
            if total + more > f.max_group_duration:
                break
            keys.extend(extra)
            keys.append(nxt)
            members.update(extra)
            members.add(nxt)
            total += more
            cur = nxt
        return tuple(keys)

    def _consumers(self, keys: tuple) -> tuple:
        """The consumers of the group's root that run in its Ray task, right after it.

        All of the root's pending consumers or none, so that its value never leaves
        the task (a producer read by a writer and a histogram fill: its output is
        never stored, nor held until the last of them runs). Each must read nothing
        else but values in memory, be of the root's kind and not be a bundle's; their
        measured runtimes together must be cheap (and the group within
        ``max_group_duration``), or short beside the root's (``CONSUMERS_SHARE``): a
        chain of like tasks is not merged. A consumer of
        a category measured fewer than ``PROBES`` times may join as its category's
        probe (one group at a time, run nowhere else), so that categories dask.order
        runs last are learned early, and not from one cold start alone.
        """
        root = keys[-1]
        f = self.fusion
        if (
            not f.enabled
            or root in self.outputs
            or root in self.available
            or root in self.bundles
            or root in self.piece_of
        ):
            return ()
        pending = [d for d in self.dependents[root] if self.state[d] not in (MEMORY, RELEASED)]
        if not pending or len(keys) + len(pending) > f.max_group_size:
            return ()
        total = 0.0
        probes: set = set()
        for d in pending:
            if (
                self.state[d] != WAITING
                or d in self.bundles
                or d in self.piece_of
                or not self._same_kind(root, d)
                or any(self.state[x] != MEMORY for x in self.dependencies[d] if x != root)
            ):
                return ()
            cat = self.category(d)
            count, seconds = self.stats.get(cat, (0, 0.0))
            if count < PROBES:
                probes.add(cat)
            else:
                total += seconds / count
        group = sum(self.estimate(k) or 0.0 for k in keys) + total
        cheap = total < f.max_task_duration and group <= f.max_group_duration
        lead = self.estimate(root)
        if not cheap and (lead is None or total > lead * CONSUMERS_SHARE):
            return ()
        if probes:  # a category is measured by one task at a time
            running = [*keys, *(k for g in self.groups.values() for k in g.keys)]
            if any(self.category(k) in probes for k in running):
                return ()
        return tuple(sorted(pending, key=self.priorities.__getitem__))

    def _exclusive_subtree(self, key: Key, like: Key, budget: int) -> list | None:
        """``key`` and its unfinished ancestors, topologically, if all can join a group.

        They can when each is cheap, of the same kind as ``like``, no output, read by
        nothing outside the subtree, and the subtree's leaves are ready.
        """
        if (
            budget <= 0
            or key in self.bundles
            or key in self.piece_of
            or key in self.outputs
            or key in self.available
            or len(self.dependents[key]) != 1
            or not self._cheap(key)
            or not self._same_kind(like, key)
        ):
            return None
        if self.state[key] == READY:
            return [key]
        if self.state[key] != WAITING:
            return None
        keys: list = []
        for d in sorted(self.dependencies[key], key=self.priorities.__getitem__):
            if self.state[d] == MEMORY:
                continue
            sub = self._exclusive_subtree(d, like, budget - len(keys) - 1)
            if sub is None:
                return None
            keys.extend(sub)
        return keys + [key]

    # ---- bundles: a shuffle's map and its pieces, one Ray task, one object per piece --

    def _init_bundles(self, bundles: Mapping[Key, Iterable[Key]]) -> None:
        """Keep the bundles this graph can run as such: ``map -> pieces``.

        A bundle is a map key whose dependents are exactly its pieces, each piece
        reading only the map: the map runs once with the pieces still waiting, and each
        of those pieces becomes its own value (released, lost and recomputed on its
        own). The map's value never leaves the Ray task, so it must be no output and no
        given value. Anything else named a bundle runs as ordinary tasks.
        """
        self.bundles: dict[Key, tuple] = {}
        self.piece_of: dict[Key, Key] = {}
        for m, pieces in bundles.items():
            pieces = tuple(pieces)
            if (
                m not in self.dependencies
                or m in self.outputs
                or m in self.available
                or not pieces
                or set(pieces) != self.dependents[m]
                or any(self.dependencies[p] != {m} or p in self.available for p in pieces)
            ):
                continue
            self.bundles[m] = pieces
            self.piece_of.update(dict.fromkeys(pieces, m))

    def _bundle(self, key: Key) -> tuple:
        """The map and those of its pieces still to be made (after a loss: the lost ones)."""
        return (key, *(p for p in self.bundles[key] if self.state[p] == WAITING))

    def _bundle_returns(self, keys: tuple) -> tuple:
        return keys[1:] if keys[0] in self.bundles else ()

    def _validate_bundles(self) -> None:
        for m, pieces in self.bundles.items():
            assert self.state[m] != MEMORY, ("a bundle's map value left its task", m)
            assert all(self.piece_of[p] == m for p in pieces)
        for g in self.groups.values():
            if g.keys[0] in self.bundles:
                assert g.returns == g.keys[1:], g
                assert set(g.returns) <= set(self.bundles[g.keys[0]]), g
            else:
                assert not g.returns or g.returns == g.consumers, g
                assert not any(k in self.piece_of or k in self.bundles for k in g.keys), g

    # ---- checks -----------------------------------------------------------------

    def validate_state(self) -> None:
        """Assert every invariant; cheap enough for tests after each event, not for runs."""
        stopped = self.failed or self.aborted
        finished = (MEMORY, RELEASED)
        assert set(self.state) == set(self.dependencies)
        heaps = (*self.ready, *self.ready_sources)
        assert self.long_cats == {c for c, r in self.runtimes.items() if self._long_mean(r)}
        in_heap = {e[-1] for e in heaps if self.state[e[-1]] == READY}
        assert all(self.dependencies[e[-1]] <= self.available for e in self.ready_sources)
        assert self.full <= self.crowded <= set(self.stores), (self.crowded, self.stores)
        assert all(
            k in self.nbytes for k, s in self.state.items() if s == MEMORY and k in self.where
        )
        if not stopped:
            assert in_heap == {k for k, s in self.state.items() if s == READY}
            long_ready = {k for k in in_heap if self._known_long(k)}
            assert long_ready <= {e[-1] for e in self.ready_long}, long_ready
        for k, s in self.state.items():
            deps, dependents = self.dependencies[k], self.dependents[k]
            if s == READY:
                assert stopped or all(self.state[d] == MEMORY for d in deps), k
            elif s == WAITING:
                if not stopped:
                    assert self.missing[k] == sum(self.state[d] != MEMORY for d in deps) > 0, k
                    assert all(self.state[d] != RELEASED for d in deps), k
            elif s == PROCESSING:
                if not stopped:
                    g = self.groups[self.group_of[k]]
                    assert k in g.members
                    assert all(self.state[d] == MEMORY for d in g.inputs), (k, g)
            elif s == MEMORY:
                assert not stopped
                pending = sum(self.state[d] not in finished for d in dependents)
                assert self.waiters[k] == pending, (k, self.waiters[k], pending)
                assert pending or k in self.outputs, k
            elif s == RELEASED:
                if not stopped:
                    assert k not in self.outputs, k
                    assert all(self.state[d] in finished for d in dependents), k
            else:
                raise AssertionError(f"{k!r} in unknown state {s!r}")
        assert set(self.group_of) == {m for g in self.groups.values() for m in g.members}
        used = sum(g.cost * len(g.copies) for g in self.groups.values())
        assert abs(self.used - used) < 1e-9, (self.used, used)
        dups = {}
        for g in self.groups.values():
            assert g.copies, g
            nodes = [c.node for c in g.copies.values() if c.node is not None]
            assert len(nodes) == len(set(nodes)), ("two copies on one node", g)
            assert len(g.copies) <= 1 + self.speculation.max_copies, g
            for c, copy in g.copies.items():
                assert (c != g.id) == copy.duplicate, (c, g)
                if copy.duplicate:
                    dups[c] = g.id
                    assert copy.node is not None, (c, g)
        assert dups == self.copy_of, (dups, self.copy_of)
        assert len(self.copy_of) <= max(self.speculation.max_in_flight, 0)
        if not stopped:
            self._validate_bundles()
