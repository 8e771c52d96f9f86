"""The scheduling core: a pure state machine over one compute's graph.

Events in, instructions out, no I/O and no Ray, in the manner of
``distributed.worker_state_machine``. The Ray layer (``raydag.runtime``) reports facts
(``raydag.core.events``) and carries out the instructions; every decision is taken
here: what runs next and where, what to fuse, what may be freed, what a node's death
lost, what is retried, duplicated or given up. So each decision can be tested on random
graphs without a cluster, and each new capability is new events, instructions and a
policy part, not a new loop.

**One door.** ``handle(event)`` sends each event to its own handler (``_HANDLERS``);
every handler ends the same way (``_settle``): ready work is started (``_fill``), then
speculation looks at idle CPUs. An event about a copy no group owns any more (a late
report of a cancelled or superseded attempt) changes nothing, and ends there. A key's state changes only through ``transition``,
along the edges of ``TRANSITIONS``::

    waiting -> ready -> processing -> memory -> released
       ^         |          |   \\________________^  (a fused member: its value
       |_________|__________|                         never left its Ray task)
       (an input lost; a group reset; a value lost; released lineage recomputed)

**Records.** Per-key facts live on ``TaskState``, per-node on ``NodeState``, per-category
on ``Category`` (``raydag.core.records``). **Policies** are parts the machine owns, each
in its own module with its own settings: ``Fuser`` (fusion), ``Placer`` (placement),
``Speculator`` (speculation), ``Bundler`` (bundles), ``Recoverer`` (recovery).

Worked example: ``a -> b -> c`` (output ``c``), capacity 1. ``start()`` makes ``a`` ready
and returns ``[Submit(copy=1, group=0, keys=("a",))]``. ``TaskFinished(copy=1)``: ``a``
goes to memory, ``b`` is ready and submitted as copy 3 of group 2. ``TaskFinished(copy=3)``:
``b`` in memory, ``a`` has no waiter left: ``Release("a")``; ``c`` is submitted. A copy that
dies with its node is restarted as a new copy (a fresh id): a late report of the old one
is ignored, since no group owns its id any more.
"""

from __future__ import annotations

import functools
import gc
import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from dask.utils import key_split

from raydag.core.bundles import Bundler
from raydag.core.checkpoints import Checkpointer, Checkpoints
from raydag.core.events import (
    Aborted,
    Cancel,
    CheckpointFailed,
    CheckpointWritten,
    CpusChanged,
    Event,
    Fail,
    InputLost,
    Instruction,
    NodeDied,
    Ordered,
    Release,
    ResultsLost,
    StoresSampled,
    Submit,
    TaskErred,
    TaskFinished,
    TaskStarted,
    Tick,
    WorkerDiedError,
)
from raydag.core.fusion import Fuser, Fusion
from raydag.core.options import PLAIN_RESOURCES, TaskOptions, task_options
from raydag.core.placement import Placement, Placer
from raydag.core.records import (
    MEMORY,
    PROCESSING,
    READY,
    RELEASED,
    WAITING,
    Category,
    Copy,
    Group,
    NodeState,
    TaskState,
)
from raydag.core.recovery import Recoverer, Recovery
from raydag.core.speculation import Speculation, Speculator

Key = Hashable


def slots(cpus: float, per_cpu: float) -> float:
    """Ray tasks to keep in flight on ``cpus`` CPUs: each holds its inputs and output in
    the object store, so about one per CPU keeps memory at the strict need."""
    return max(1.0, round(cpus * per_cpu))


def _gc_paused(fn: Callable) -> Callable:
    """Run ``fn`` with the cyclic garbage collector paused. Building a record per key
    makes only objects that live as long as the compute, and the collector, run every
    700 new objects, walks them over and over: at 330k keys, 2 of the 3 s of ``State()``."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


class InvalidTransition(AssertionError):
    """A key was asked to move along an edge the transition table does not have."""


class State:
    """What is waiting, ready, running, held and released, for one compute.

    Policies not given are off. The engine's facts: ``capacity`` (Ray tasks in flight
    to start with), ``nodes`` (alive nodes and their CPUs, when known), ``inline_bytes``
    and ``inline_total`` (Ray's inlining of small returns, see ``raydag.core.recovery``),
    ``gone`` (given values known lost before the compute began, e.g. made in an earlier
    Ray session: those it needs are recomputed at the start from their lineage, or it
    fails naming the first without one). ``dependents``: each key's readers, if the
    caller has them already (the graph's sets, kept as they are, not copied: 85 MB at
    330k keys); derived from ``dependencies`` otherwise.
    """

    @_gc_paused
    def __init__(
        self,
        dependencies: Mapping[Key, Iterable[Key]],
        priorities: Mapping[Key, int],
        outputs: Iterable[Key],
        *,
        capacity: float,
        dependents: Mapping[Key, set] | None = None,
        available: Iterable[Key] = (),
        resources: Mapping[Key, Mapping[str, float]] | None = None,
        remote_args: Mapping[Key, Mapping[str, Any]] | None = None,
        pinned: Iterable[Key] = (),
        retries: Mapping[Key, int] | None = None,
        default_retries: int = 3,
        fusion: Fusion | None = None,
        category: Callable[[Key], str] = key_split,
        cheap_cost: float = 1.0,
        fixed: Iterable[Key] = (),
        speculation: Speculation | None = None,
        seed_runtimes: Mapping[str, Iterable[float]] | None = None,
        placement: Placement | None = None,
        bundles: Mapping[Key, Iterable[Key]] | None = None,
        recovery: Recovery | None = None,
        nodes: Mapping[str, float] | None = None,
        given_nodes: Mapping[Key, str | None] | None = None,
        in_flight_per_cpu: float = 1.0,
        inline_bytes: int = 0,
        inline_total: int = 0,
        gone: Iterable[Key] = (),
        checkpoints: Checkpoints | None = None,
        checkpointed: Iterable[Key] = (),
        checkpoint_marks: Mapping[Key, Any] | None = None,
    ):
        self.tasks: dict[Key, TaskState] = {}
        cats: dict[str, str] = {}
        for k, deps in dependencies.items():
            cat = category(k)
            deps = deps if type(deps) is frozenset else frozenset(deps)
            # the graph's own set of readers, shared (see ``Checkpointer.cut``)
            readers = None if dependents is None else dependents[k]
            self.tasks[k] = TaskState(k, deps, priorities[k], cats.setdefault(cat, cat), readers)
        if dependents is None:
            for k, ts in self.tasks.items():
                for d in ts.dependencies:
                    self.tasks[d].dependents.add(k)
        self.outputs = set(outputs)
        for k in self.outputs:
            self.tasks[k].output = True
        self.given = set(available)
        for k in self.given:
            self.tasks[k].given = True
        # given values whose objects are gone: never held again, recomputed when needed
        self.gone = set(gone) & self.given
        for k in fixed:
            self.tasks[k].fixed = True
        for k, r in (resources or {}).items():
            self.tasks[k].resources = dict(r) if r else None
            if r and set(r) - PLAIN_RESOURCES:  # custom resources say where it may run
                self.tasks[k].pinned = True
        for k, args in (remote_args or {}).items():
            self.tasks[k].remote_args = args or None  # as given: one object per distinct dict
        for k in pinned:
            self.tasks[k].pinned = True
        for k, n in (retries or {}).items():
            self.tasks[k].retries = int(n)
        for ts in self.tasks.values():
            ts.source = ts.dependencies <= self.given
        for k, node in (given_nodes or {}).items():
            if k in self.tasks:
                self.tasks[k].node = node
        self.capacity = capacity
        self.in_flight_per_cpu = in_flight_per_cpu
        self.default_retries = default_retries
        self.cheap_cost = cheap_cost
        self.inline_bytes = inline_bytes
        self.inline_total = inline_total
        self.categories: dict[str, Category] = {}
        self.nodes: dict[str, NodeState] = {}
        self.known_nodes = nodes is not None
        for n in nodes or {}:
            self.node(n)
        self.groups: dict[int, Group] = {}
        self.copies: dict[int, Group] = {}  # every live copy's id -> its group
        # (tier, priority, seq, key): tier 0 is recovery, ahead of everything else.
        # Ready keys that read no intermediate (sources) wait apart: under store
        # pressure they go behind ready keys that free what they read.
        self.ready: list[tuple[int, int, int, Key]] = []
        self.ready_sources: list[tuple[int, int, int, Key]] = []
        self.used = 0.0  # slots taken by the copies in flight
        self.unplaced = 0  # copies whose node Ray chooses, not started yet (Copy.ray_places)
        self.failed: tuple[Key, Any] | None = None
        self.aborted = False
        self.now = 0.0  # the latest wall clock heard (a Tick, a start)
        self._ids = 0
        self._seq = 0
        self.out: list[Instruction] = []  # the current event's instructions
        self.stale = False  # the current event is about a copy no group owns: no change

        self.fuser = Fuser(self, fusion or Fusion(enabled=False))
        self.placer = Placer(self, placement or Placement(enabled=False))
        self.speculator = Speculator(self, speculation or Speculation(enabled=False))
        self.bundler = Bundler(self, bundles)
        self.recoverer = Recoverer(self, recovery or Recovery(ray_first=False))
        self.checkpointer = Checkpointer(
            self, checkpoints or Checkpoints(enabled=False), checkpointed, checkpoint_marks
        )
        for name, seconds in (seed_runtimes or {}).items():
            self.speculator.seed(self.category(name), [float(x) for x in seconds])

    @classmethod
    def from_graph(cls, graph: Any, options: TaskOptions | None = None, **kwargs: Any) -> State:
        """``options``: each task's Ray options (``core.options``); without them, the
        ``resources`` annotation alone."""
        given = graph.external
        if options is None:
            options = task_options(
                graph.tasks, {"resources": graph.annotations.get("resources", {})}
            )
        return cls(
            graph.dependencies,
            graph.priorities,
            graph.outputs,
            dependents=graph.dependents,
            available=given,
            fixed=set(given) - graph.lineage,
            resources=options.resources,
            remote_args=options.remote_args,
            pinned=options.pinned,
            retries=graph.annotations.get("retries"),
            checkpoint_marks=graph.annotations.get("checkpoint"),
            given_nodes={k: getattr(v, "node", None) for k, v in given.items()},
            **kwargs,
        )

    # ---- public -----------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return bool(self.failed or self.aborted)

    @property
    def done(self) -> bool:
        if self.stopped:
            return True
        return not self.groups and all(self.tasks[k].state == MEMORY for k in self.outputs)

    @property
    def wave(self) -> int:
        return self.recoverer.wave

    @_gc_paused
    def start(self) -> list[Instruction]:
        """The first instructions: what the outputs need is waiting or ready; the rest
        (the lineage of given values) starts released, run only if a given value is lost."""
        out = self.out = []
        self.speculator.new_event()
        needed: set = set()
        stack = list(self.outputs)
        while stack:
            k = stack.pop()
            if k not in needed:
                needed.add(k)
                if not self.tasks[k].given:  # a key read back from its checkpoint: nothing
                    stack.extend(self.checkpointer.at_start(self.tasks[k]))
        for ts in self.tasks.values():
            if ts.given:
                ts.state = MEMORY
                if ts.node is not None:
                    known = ts.node in self.nodes
                    n = self.node(ts.node)
                    n.held.add(ts.key)
                    if self.known_nodes and not known:  # not among the alive nodes
                        n.alive = False
            elif ts.key not in needed:
                ts.state = RELEASED
            else:
                ts.state = None  # type: ignore[assignment]  (placed below)
        # Set sizes, not a look-up per edge (330k keys: 1.3 of start's 1.7 s): in memory
        # now are the given values only; waiting or ready, the needed keys not given.
        given = self.given
        for ts in self.tasks.values():
            if ts.state is not None:
                continue
            deps = ts.dependencies
            ts.missing = len(deps) - len(deps & given) if given else len(deps)
            ts.state = WAITING
            if not ts.missing:
                self.transition(ts, READY)
        live = needed - given
        for ts in self.tasks.values():
            ts.waiters = len(ts.dependents & live) if ts.dependents else 0
        # Given values gone before the compute began, that something here reads: Ray's
        # lineage cannot bring back what an earlier Ray session made, ray-first or not.
        gone = sorted(
            (k for k in self.gone if self.tasks[k].waiters or self.tasks[k].output), key=repr
        )
        if gone:
            self.recoverer.lose(gone, "made in an earlier Ray session", out)
        if not self.recoverer.settings.ray_first:
            self.recoverer.lose(
                self.recoverer.lost_with_dead_nodes(), "node died before the compute", out
            )
        for k in self.given:  # given values that nothing here reads
            ts = self.tasks[k]
            if ts.state == MEMORY and ts.waiters == 0 and not ts.output:
                self.transition(ts, RELEASED)
        self._fill()
        self.out = []
        return out

    def handle(self, event: Event) -> list[Instruction]:
        """The one door: the event's handler, then what every event ends with."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"Unknown event {event!r}")
        out = self.out = []
        self.speculator.new_event()
        self.stale = False
        handler(self, event)
        if not self.stale:
            self._settle(event)
        self.out = []
        return out

    def estimate(self, key: Key) -> float | None:
        """Mean runtime of the key's category so far, ``None`` before the first one."""
        cat = self.categories.get(self.tasks[key].category)
        return None if cat is None else cat.mean

    def priority(self, key: Key) -> int:
        return self.tasks[key].priority

    def category(self, name: str) -> Category:
        cat = self.categories.get(name)
        if cat is None:
            cat = self.categories[name] = Category(name)
        return cat

    def node(self, node: str) -> NodeState:
        n = self.nodes.get(node)
        if n is None:
            n = self.nodes[node] = NodeState(node)
        return n

    def is_alive(self, node: str | None) -> bool:
        """Is ``node`` alive? A node never heard dead is."""
        if node is None:
            return False
        n = self.nodes.get(node)
        return n is None or n.alive

    def held_on(self, node: str) -> set:
        """The keys whose values ``node`` holds."""
        n = self.nodes.get(node)
        return set(n.held) if n is not None else set()

    def cpus(self, group: Group) -> float:
        return float((self.tasks[group.lead].resources or {}).get("CPU", 1))

    # ---- handlers: one per event ---------------------------------------------------

    def _on_finished(self, ev: TaskFinished) -> None:
        group = self.copies.get(ev.copy)
        if group is None:  # cancelled or superseded: its result is not ours to keep
            self.stale = True
            return
        del self.groups[group.id]
        self.speculator.finished(group, ev, self.out)
        for cid, copy in group.copies.items():
            if cid != ev.copy:
                self.out.append(Cancel(cid, copy.node if self.is_alive(copy.node) else None))
            del self.copies[cid]
            self.speculator.dropped(group, copy)
            self._placed(copy)
        self.used -= group.cost * len(group.copies)
        self._learn(group, ev)
        tasks = self.tasks
        kept = set(group.kept)
        for m in group.keys:
            ts = tasks[m]
            ts.group = None
            for dep in ts.dependencies:
                if dep not in group.members:
                    self._one_waiter_less(tasks[dep])
                elif dep in kept:  # read inside the group too: kept for readers outside
                    tasks[dep].waiters -= 1
            if m not in kept:
                ts.waiters = 0
                self.transition(ts, RELEASED)
            ts.recovering = False
        self._keep(group, ev)
        self.checkpointer.finished(group, ev, self.out)
        if ev.node is not None and not self.is_alive(ev.node):
            # reported after its node's death: what it kept in that node's store is gone
            self.recoverer.lose(group.kept, f"made on {ev.node[:12]}, which died", self.out)

    def _learn(self, group: Group, ev: TaskFinished) -> None:
        """Each category's runtimes; a lone task's pace tells its node's (a fused group's
        does not: cheap by construction)."""
        sp = self.speculator
        alone = len(group.keys) == 1 + len(group.consumers)
        node = ev.node if alone else None
        for m, seconds in ev.durations.items():
            if m in group.members and not self.tasks[m].restore:  # a read back: no runtime
                cat = self.category(self.tasks[m].category)
                cat.count += 1
                cat.total += seconds
                sp.learn(cat, seconds, node)

    def _one_waiter_less(self, ts: TaskState) -> None:
        ts.waiters -= 1
        if ts.waiters == 0 and not ts.output:
            self.transition(ts, RELEASED)

    def _keep(self, group: Group, ev: TaskFinished) -> None:
        """The group's kept values are in memory, where the copy ran; readers get ready."""
        kept = group.kept
        sizes = ev.sizes
        if len(sizes) != len(kept):  # not told: a bundle's pieces are about alike
            sizes = (ev.nbytes // len(kept),) * len(kept)
        inlined = 0
        for root, nbytes in zip(kept, sizes, strict=True):
            ts = self.tasks[root]
            if self.placer.settings.enabled:  # sizes per category: only placement reads them
                cat = self.category(ts.category)
                cat.made += 1
                cat.made_bytes += nbytes
            ts.node = ev.node
            ts.nbytes = nbytes
            ts.inline = nbytes < self.inline_bytes and inlined + nbytes <= self.inline_total
            inlined += nbytes if ts.inline else 0
            self.transition(ts, MEMORY)
            for d in ts.dependents:
                td = self.tasks[d]
                if td.state != WAITING:  # given, or released lineage of a given value
                    continue
                td.missing -= 1
                if td.missing == 0:
                    self.transition(td, READY)
            if ts.waiters == 0 and not ts.output:  # a piece nobody reads
                self.transition(ts, RELEASED)

    def _on_erred(self, ev: TaskErred) -> None:
        group = self.copies.get(ev.copy)
        if group is None:
            self.stale = True
            return
        if self.checkpointer.read_failed(group, ev, self.out):
            return
        if len(group.copies) > 1:
            if ev.node_died or ev.worker_died:  # another copy carries on: no restart
                if ev.node_died and not group.copies[ev.copy].duplicate:
                    group.spared_at = self.now
                self.drop_copy(group, ev.copy)
                if ev.node_died:
                    self.speculator.spared(group)
                return
            # The task's own error, whichever copy raised it: the others stop.
            for cid in [c for c in group.copies if c != ev.copy]:
                self.out.append(Cancel(cid))
                self.drop_copy(group, cid)
        if ev.node_died:
            self._restart(group, ev.copy)
            return
        annotated = max((self.tasks[k].retries for k in group.keys), default=0)
        limit = max(annotated, self.default_retries) if ev.worker_died else annotated
        if group.attempt < limit:
            group.attempt += 1
            self._restart(group, ev.copy)
            return
        error = ev.error
        if ev.worker_died:
            error = WorkerDiedError(
                f"Task {ev.key!r} (category {self.tasks[ev.key].category!r}) killed its "
                f"worker process {group.attempt + 1} times (out of memory, or a crash); "
                f"last: {type(ev.error).__name__}: {ev.error}"
            )
            error.__cause__ = ev.error if isinstance(ev.error, BaseException) else None
        self.drop_copy(group, ev.copy)
        for m in group.keys:
            self.tasks[m].group = None
        del self.groups[group.id]
        self.fail(ev.key, error, self.out)

    def _on_started(self, ev: TaskStarted) -> None:
        group = self.copies.get(ev.copy)
        if group is None:
            self.stale = True
            return
        copy = group.copies[ev.copy]
        copy.node, copy.started = ev.node, ev.started
        self._placed(copy)
        self.now = max(self.now, ev.started)
        self.speculator.started(group, copy)

    def _on_input_lost(self, ev: InputLost) -> None:
        self.recoverer.input_lost(ev.copy, ev.keys, ev.reason, self.out)
        group = self.copies.get(ev.copy)
        if group is not None:  # its inputs were not in the wave (Ray's word alone)
            self._on_erred(TaskErred(ev.copy, group.keys[-1], ev.reason, node_died=True))

    def _on_node_died(self, ev: NodeDied) -> None:
        self.recoverer.node_died(ev.node, ev.reason, self.out)

    def _on_results_lost(self, ev: ResultsLost) -> None:
        self.recoverer.lose(ev.keys, ev.reason, self.out)

    def _on_cpus_changed(self, ev: CpusChanged) -> None:
        self.capacity = slots(ev.cpus, self.in_flight_per_cpu)

    def _on_aborted(self, ev: Aborted) -> None:
        self.aborted = True
        self._stop(self.out)

    def _on_tick(self, ev: Tick) -> None:
        self.now = max(self.now, ev.now)
        self.speculator.ticked(ev)

    def _on_stores_sampled(self, ev: StoresSampled) -> None:
        self.placer.sampled(dict(ev.stores), dict(ev.idle))

    def _on_ordered(self, ev: Ordered) -> None:
        """The whole graph's order, come after the start: every key takes its priority
        from it and the ready heaps are rebuilt, so what is chosen from now on follows
        it (what runs or ran already ran in the provisional order)."""
        tasks = self.tasks
        for k, p in ev.priorities.items():
            ts = tasks.get(k)
            if ts is not None:
                ts.priority = p
        for heap in (
            self.ready,
            self.ready_sources,
            self.speculator.ready_long,
            self.speculator.ready_lasting,
            self.speculator.ready_feeders,
        ):
            # stale entries (no longer ready) go; a key ready twice keeps both, as before
            heap[:] = [(e[0], tasks[e[-1]].priority, *e[2:]) for e in heap
                       if tasks[e[-1]].state == READY]  # fmt: skip
            heapq.heapify(heap)

    def _on_checkpoint_written(self, ev: CheckpointWritten) -> None:
        self.checkpointer.written(ev, self.out)

    def _on_checkpoint_failed(self, ev: CheckpointFailed) -> None:
        self.checkpointer.write_failed(ev, self.out)

    def _settle(self, event: Event) -> None:
        """What every event ends with: start ready work, then duplicate on idle CPUs;
        once done, the checkpoints go."""
        self._fill()
        self.speculator.after(event, self.out)
        self.checkpointer.settled(self.out)

    # ---- transitions ----------------------------------------------------------------

    def transition(self, ts: TaskState, new: str) -> None:
        fn = TRANSITIONS.get((ts.state, new))
        if fn is None:
            raise InvalidTransition(f"{ts.key!r}: {ts.state} -> {new}")
        if ts.state == PROCESSING:
            self.categories[ts.category].processing -= 1
        fn(self, ts)

    def _to_ready(self, ts: TaskState) -> None:
        ts.state = READY
        self._seq += 1
        entry = (0 if ts.recovering else 1, ts.priority, self._seq, ts.key)
        heapq.heappush(self.ready_sources if ts.source else self.ready, entry)
        self.speculator.made_ready(entry)

    def _to_waiting(self, ts: TaskState) -> None:
        if ts.state == MEMORY:
            self._forget(ts)
        ts.state = WAITING
        ts.group = None

    def _to_processing(self, ts: TaskState) -> None:
        ts.state = PROCESSING
        self.category(ts.category).processing += 1

    def _to_memory(self, ts: TaskState) -> None:
        ts.state = MEMORY
        self.gone.discard(ts.key)  # made here: a given value gone before is back
        if ts.node is not None:
            self.node(ts.node).held.add(ts.key)

    def _fused_away(self, ts: TaskState) -> None:
        """A group member whose value only ever lived inside its Ray task."""
        ts.state = RELEASED

    def _release(self, ts: TaskState) -> None:
        self._forget(ts)
        ts.state = RELEASED
        self.out.append(Release(ts.key))

    def _forget(self, ts: TaskState) -> None:
        """Where a value lived, once it is gone."""
        self.checkpointer.forget(ts)
        if ts.node is not None and ts.node in self.nodes:
            self.nodes[ts.node].held.discard(ts.key)
        if not ts.given:  # a given value's node is its owner's to know
            ts.node = None
        ts.nbytes = None
        ts.inline = False

    # ---- copies and groups ----------------------------------------------------------

    def new_copy(self, group: Group, node: str | None = None, duplicate: bool = False) -> Copy:
        self._ids += 1
        copy = Copy(self._ids, node=node, duplicate=duplicate)
        group.copies[copy.id] = copy
        self.copies[copy.id] = group
        self.used += group.cost
        return copy

    def drop_copy(self, group: Group, copy: int) -> None:
        gone = group.copies.pop(copy)
        self._placed(gone)
        del self.copies[copy]
        self.speculator.dropped(group, gone)
        self.used -= group.cost

    def submit(
        self,
        group: Group,
        copy: Copy,
        node: str | None = None,
        soft: bool = False,
        placed: str = "",
        spill: bool = True,
    ) -> Submit:
        root = self.tasks[group.keys[-1]]
        notify, after = self._start_report(group, copy)
        return Submit(
            copy.id,
            group.id,
            group.keys,
            group.inputs,
            root.priority,
            root.resources,
            group.attempt,
            notify=notify,
            notify_after=after,
            duplicate=copy.duplicate,
            node=node,
            soft=soft,
            spill=spill,
            placed=placed,
            returns=group.returns,
            restore=tuple(k for k in group.keys if self.tasks[k].restore),
            remote_args=root.remote_args,
        )

    def _start_report(self, group: Group, copy: Copy) -> tuple[bool, float]:
        """Whether a copy reports its start before its end, and after how long running.

        Where and since when a copy runs matter for duplicates, and because a running
        copy holds its inputs when a node that made them dies (recovery). A group of
        cheap tasks (each category measured under fusion's ``max_task_duration``) ends
        before either could use it: no report. A group with a task not measured yet
        reports once it has run that long: one that ends sooner has shown itself
        cheap, and the report (an actor call from the worker) would have cost it for
        nothing: a tenth of a one-task compute's latency. A duplicate, or a group
        with a task known to be long, reports as it starts.
        """
        limit = self.fuser.settings.max_task_duration
        means = [self.estimate(k) for k in group.keys]
        if copy.duplicate or any(m is not None and m >= limit for m in means):
            return True, 0.0
        if all(m is not None for m in means):
            return False, 0.0
        return True, limit

    def _first_copy(self, group: Group) -> None:
        """Start the group's first copy (again, after a retry): the only one running it."""
        copy = self.new_copy(group)
        node, why = self.placer.place(group)
        spill = True  # placed by storage: elsewhere rather than wait
        if node is None:
            node, why, wait = self.speculator.place(group)
            spill = not wait  # chosen for its pace: wait for it, if sure of its CPU
        if spill:
            copy.ray_places = True
            self.unplaced += 1
        self.out.append(
            self.submit(group, copy, node=node, soft=node is not None, placed=why, spill=spill)
        )

    def _restart(self, group: Group, copy: int) -> None:
        self.drop_copy(group, copy)
        self._first_copy(group)

    def _placed(self, copy: Copy) -> None:
        """``copy`` started (its node is known) or is gone: Ray placed it, or never will."""
        if copy.ray_places:
            copy.ray_places = False
            self.unplaced -= 1

    def reset_group(self, group: Group, out: list[Instruction]) -> tuple:
        """Cancel an in-flight group: its keys wait again. Returns them."""
        del self.groups[group.id]
        for cid, copy in group.copies.items():
            out.append(Cancel(cid))
            del self.copies[cid]
            self.speculator.dropped(group, copy)
            self._placed(copy)
        self.used -= group.cost * len(group.copies)
        for m in group.keys:
            self.transition(self.tasks[m], WAITING)
        return group.keys

    def dead(self, node: NodeState) -> None:
        """Take ``node`` for dead: nothing more goes there."""
        node.alive = False
        node.free = 0.0
        node.idle = 0.0
        node.store = None
        self.placer.node_gone()
        self.speculator.node_gone(node.id)

    def fail(self, key: Key, error: Any, out: list[Instruction]) -> None:
        self.failed = (key, error)
        self._stop(out)
        out.append(Fail(key, error))

    def _stop(self, out: list[Instruction]) -> None:
        for g in self.groups.values():
            for cid in g.copies:
                out.append(Cancel(cid))
            for m in g.keys:
                self.tasks[m].group = None
        self.groups.clear()
        self.copies.clear()
        self.speculator.stopped()
        self.used = 0.0
        self.unplaced = 0
        self.ready.clear()
        self.ready_sources.clear()
        for ts in self.tasks.values():
            if ts.state == MEMORY:
                self.transition(ts, RELEASED)

    # ---- choosing work --------------------------------------------------------------

    def _fill(self) -> None:
        if self.stopped:
            return
        tasks = self.tasks
        while (heap := self.next_ready()) is not None:
            key = heap[0][-1]
            cost = self.fuser.cost(key, self.estimate(key))
            if (
                self.used
                and self.used + cost > self.capacity - self.speculator.withheld()
                and not self.speculator.preempt(cost, self.out)
            ):
                return
            heapq.heappop(heap)
            self.speculator.took(heap, key)
            bundle = self.bundler.group(key)
            consumers: tuple = ()
            if bundle is not None:
                keys, returns = bundle
            else:
                keys, returns = self.fuser.chain(key), ()
                consumers = self.fuser.consumers(keys)
                if consumers:
                    keys += consumers
                    kept = self.fuser.kept(keys)
                    returns = kept if kept != keys[-1:] else ()
                if len(keys) > 1:
                    estimates = [self.estimate(k) for k in keys]
                    total = None if None in estimates else sum(estimates)  # type: ignore[arg-type]
                    fused = self.fuser.cost(key, total)
                    # A group takes at most what is left: fusing must not wait for a
                    # whole free slot, nor push the work in flight past capacity.
                    cost = min(fused, self.capacity - self.used) if self.used else fused
            members = frozenset(keys)
            inputs = tuple(
                {d: None for m in keys for d in tasks[m].dependencies if d not in members}
            )
            self._ids += 1
            group = Group(
                self._ids, keys, members, inputs, cost, returns=returns, consumers=consumers
            )
            self.groups[group.id] = group
            for m in keys:
                ts = tasks[m]
                ts.group = group.id
                self.transition(ts, PROCESSING)
            self._first_copy(group)

    def next_ready(self) -> list | None:
        """The heap whose top runs next: by priority, but consumers first while a store
        is full (what they read is freed when they finish; a source only adds), what
        feeds long work, and the long work so fed, first (speculation), and a task known
        long first while the cluster is short-handed (speculation)."""
        tasks = self.tasks
        for h in (self.ready, self.ready_sources):
            while h and tasks[h[0][-1]].state != READY:  # fused into a group, or input lost
                heapq.heappop(h)
        tops = [h[0] for h in (self.ready, self.ready_sources) if h]
        if not self.placer.any_full:
            first = self.speculator.long_work_first(tops)
            if first is not None:
                return first
        long = self.speculator.long_first(tops)
        if long is not None:
            return long
        if not self.ready_sources:
            return self.ready or None
        if not self.ready:
            return self.ready_sources
        if self.placer.any_full or self.ready[0] < self.ready_sources[0]:
            return self.ready
        return self.ready_sources

    # ---- checks -----------------------------------------------------------------

    def validate_state(self) -> None:
        """Assert every invariant; cheap enough for tests after each event, not for runs."""
        stopped = self.stopped
        tasks = self.tasks
        heaps = (*self.ready, *self.ready_sources)
        in_heap = {e[-1] for e in heaps if tasks[e[-1]].state == READY}
        assert all(tasks[e[-1]].source for e in self.ready_sources)
        if not stopped:
            assert in_heap == {k for k, ts in tasks.items() if ts.state == READY}
            long_ready = {k for k in in_heap if self.speculator.known_long(k)}
            assert long_ready <= {e[-1] for e in self.speculator.ready_long}, long_ready
            lasting = {k for k in in_heap if self.speculator.fed_long(k)}
            assert lasting <= {e[-1] for e in self.speculator.ready_lasting}, lasting
            feeders = {k for k in in_heap if self.speculator.feeds_long(k)}
            assert feeders <= {e[-1] for e in self.speculator.ready_feeders}, feeders
        for ts in tasks.values():
            self._validate_task(ts, stopped)
        for n in self.nodes.values():
            expect = {k for k in n.held if tasks[k].state == MEMORY and tasks[k].node == n.id}
            assert n.held == expect, (n.id, n.held - expect)
        if not stopped:
            processing = Counter(ts.category for ts in tasks.values() if ts.state == PROCESSING)
            for cat in self.categories.values():
                assert cat.processing == processing[cat.name], (cat.name, cat.processing)
        grouped = {k for k, ts in tasks.items() if ts.group is not None}
        assert grouped == {m for g in self.groups.values() for m in g.members}, grouped
        assert set(self.copies) == {c for g in self.groups.values() for c in g.copies}
        used = sum(g.cost * len(g.copies) for g in self.groups.values())
        unplaced = [c for g in self.groups.values() for c in g.copies.values() if c.ray_places]
        assert self.unplaced == len(unplaced), (self.unplaced, unplaced)
        assert all(c.started is None for c in unplaced), unplaced
        assert abs(self.used - used) < 1e-9, (self.used, used)
        for g in self.groups.values():
            assert g.copies, g
            nodes = [c.node for c in g.copies.values() if c.node is not None]
            assert len(nodes) == len(set(nodes)), ("two copies on one node", g)
            assert sum(not c.duplicate for c in g.copies.values()) <= 1, g
            assert all(tasks[m].group == g.id for m in g.members), g
        self.speculator.validate()
        self.placer.validate()
        self.checkpointer.validate()
        if not stopped:
            self.bundler.validate()

    def _validate_task(self, ts: TaskState, stopped: bool) -> None:
        tasks = self.tasks
        k, s = ts.key, ts.state
        finished = (MEMORY, RELEASED)
        if s == MEMORY and ts.node is not None:
            assert ts.nbytes is not None or ts.given, k
            assert k in self.node(ts.node).held, k
        if s == READY:
            assert stopped or all(tasks[d].state == MEMORY for d in ts.dependencies), k
        elif s == WAITING:
            if not stopped:
                missing = sum(tasks[d].state != MEMORY for d in ts.dependencies)
                assert ts.missing == missing > 0, (k, ts.missing, missing)
                assert all(tasks[d].state != RELEASED for d in ts.dependencies), k
        elif s == PROCESSING:
            if not stopped:
                g = self.groups[ts.group]  # type: ignore[index]
                assert k in g.members
                assert all(tasks[d].state == MEMORY for d in g.inputs), (k, g)
        elif s == MEMORY:
            assert not stopped
            pending = sum(tasks[d].state not in finished for d in ts.dependents)
            assert ts.waiters == pending, (k, ts.waiters, pending)
            assert pending or ts.output, k
        elif s == RELEASED:
            if not stopped:
                assert not ts.output, k
                assert all(tasks[d].state in finished for d in ts.dependents), k
        else:
            raise AssertionError(f"{k!r} in unknown state {s!r}")


TRANSITIONS: dict[tuple[str, str], Callable[[State, TaskState], None]] = {
    (WAITING, READY): State._to_ready,
    (READY, PROCESSING): State._to_processing,
    (WAITING, PROCESSING): State._to_processing,  # a fused member, ready with its group
    (PROCESSING, MEMORY): State._to_memory,
    (PROCESSING, RELEASED): State._fused_away,
    (MEMORY, RELEASED): State._release,
    (READY, WAITING): State._to_waiting,  # an input lost
    (PROCESSING, WAITING): State._to_waiting,  # its group reset
    (MEMORY, WAITING): State._to_waiting,  # its value lost
    (RELEASED, WAITING): State._to_waiting,  # recomputed for a lost value
    (RELEASED, MEMORY): State._to_memory,  # a given value read again after a loss
}

_HANDLERS: dict[type, Callable[[State, Any], None]] = {
    TaskFinished: State._on_finished,
    TaskErred: State._on_erred,
    TaskStarted: State._on_started,
    InputLost: State._on_input_lost,
    NodeDied: State._on_node_died,
    ResultsLost: State._on_results_lost,
    CpusChanged: State._on_cpus_changed,
    Aborted: State._on_aborted,
    Tick: State._on_tick,
    StoresSampled: State._on_stores_sampled,
    Ordered: State._on_ordered,
    CheckpointWritten: State._on_checkpoint_written,
    CheckpointFailed: State._on_checkpoint_failed,
}
