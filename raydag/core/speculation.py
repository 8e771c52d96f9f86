"""Speculative duplicates: a second copy of a long-running task on an idle CPU elsewhere.

When CPUs are idle and no first copy waits, a copy that runs *long* for its category
gets a duplicate on another node (never its own, never a slow one); the first copy to
finish wins and the others are cancelled. A straggler on a slow node is overtaken, and
a node dying under a long task costs no restart from scratch.

A copy is long once its category's mean runtime is at least ``long_task`` (from its
start), or once it has run ``min_runtime`` and either its runtime is past the
``quantile`` of its category's finished runtimes (with ``min_samples`` of them) or its
own runtime so far is at least ``long_task``. A node is *slow* once lone tasks
finished there (two or more, of categories with ``min_samples`` runtimes) took a median
of ``slow_node`` times their category's mean: a copy running there is a straggler from
its start. While a node is slow, or a first copy has run ``slow_node`` times its
category's mean, a ready task of a category known long goes first.

Worked example (``long_task`` 10 min, 3 nodes of one CPU): an hour-long ``fit`` task
starts on n1 while n2 and n3 run short tasks. When the short tasks are done and no
task waits, n2's CPU is idle: ``fit``'s category is known long (seeded from an earlier
run, or from a first ``fit`` that finished), so a duplicate starts on n2 at once. If n1
dies at minute 50, the duplicate has run 50 minutes: the restart it spared is ``Won.saved``.

Duplicates only borrow idle CPUs: a first copy that becomes ready preempts them,
youngest first (``preempt``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raydag import config
from raydag.core.events import Cancel, TaskFinished, TaskStarted, Tick, Won
from raydag.core.records import READY, Copy, Group, Runtimes

if TYPE_CHECKING:
    from raydag.core.events import Event, Instruction
    from raydag.core.records import Category
    from raydag.core.state import State

Key = Hashable


def _d(key: str) -> object:
    return field(default_factory=lambda: config.default(key))


def _s(key: str) -> object:
    return field(default_factory=lambda: config.default_seconds(key))


@dataclass(frozen=True)
class Speculation:
    """Speculation's settings (``raydag.speculation.*``; defaults in raydag.yaml).

    ``quantile``, ``long_task`` and ``slow_node`` are off when ``None``.
    """

    enabled: bool = _d("speculation.enabled")  # type: ignore[assignment]
    quantile: float | None = _d("speculation.quantile")  # type: ignore[assignment]
    min_samples: int = _d("speculation.min-samples")  # type: ignore[assignment]
    long_task: float | None = _s("speculation.long-task")  # type: ignore[assignment]
    min_runtime: float = _s("speculation.min-runtime")  # type: ignore[assignment]
    max_in_flight: int = _d("speculation.max-in-flight")  # type: ignore[assignment]
    max_copies: int = _d("speculation.max-copies")  # type: ignore[assignment]
    slow_node: float | None = _d("speculation.slow-node")  # type: ignore[assignment]

    @classmethod
    def from_config(cls) -> Speculation:
        q = config.get("speculation.quantile")
        slow = config.get("speculation.slow-node")
        return cls(
            enabled=bool(config.get("speculation.enabled")),
            quantile=None if q is None else float(q),
            min_samples=int(config.get("speculation.min-samples")),
            long_task=config.optional_seconds("speculation.long-task"),
            min_runtime=config.seconds("speculation.min-runtime"),
            max_in_flight=int(config.get("speculation.max-in-flight")),
            max_copies=int(config.get("speculation.max-copies")),
            slow_node=None if slow is None else float(slow),
        )


class Speculator:
    """The state machine's speculation part: runtimes and paces learned, duplicates made."""

    PACE = 8  # a node's latest runtimes kept to judge it slow

    def __init__(self, state: State, settings: Speculation) -> None:
        self.s = state
        self.settings = settings
        self.in_flight: set[int] = set()  # duplicate copies running
        # the ready tasks of categories known long, also in the state's heaps: they
        # go first while the cluster is short-handed (see ``short_handed``)
        self.ready_long: list[tuple[int, int, int, Key]] = []
        self._short_handed_now: bool | None = None  # per event: see ``short_handed``
        # (node, CPUs): where a duplicate just won; the next first copies go there
        self.steer: tuple[str, float] | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # ---- learning ------------------------------------------------------------------

    def learn(self, cat: Category, seconds: float, pace: list | None) -> None:
        """A task of ``cat`` ran ``seconds``; ``pace``: its node's, if it ran alone."""
        if not self.enabled:
            return
        sp = self.settings
        r = cat.runtimes
        if r is None:
            r = cat.runtimes = Runtimes()
        if pace is not None and r.count >= sp.min_samples and r.mean:
            pace.append(seconds / r.mean)
            del pace[: -self.PACE]
        r.add(seconds)
        long = self.long_mean(r)
        if long and not cat.long:
            cat.long = True
            self._index_long(cat.name)
        cat.long = long

    def long_mean(self, r: Runtimes) -> bool:
        """Does this category's mean make it known long, for reordering?"""
        sp = self.settings
        if not sp.enabled or sp.long_task is None or sp.slow_node is None:
            return False
        return r.count > 0 and r.mean >= sp.long_task

    def known_long(self, key: Key) -> bool:
        cat = self.s.categories.get(self.s.tasks[key].category)
        return cat is not None and cat.long

    def _index_long(self, name: str) -> None:
        """A category just became known long: its ready tasks join ``ready_long``."""
        for entry in (*self.s.ready, *self.s.ready_sources):
            ts = self.s.tasks[entry[-1]]
            if ts.state == READY and ts.category == name:
                heapq.heappush(self.ready_long, entry)

    def made_ready(self, entry: tuple) -> None:
        if self.known_long(entry[-1]):
            heapq.heappush(self.ready_long, entry)

    # ---- what goes first -------------------------------------------------------------

    def long_first(self, tops: list) -> list | None:
        """The long heap, if its top should run before the other heaps' ``tops``."""
        long = self.ready_long  # stale too: a category whose mean fell below long-task
        tasks = self.s.tasks
        while long and (tasks[long[0][-1]].state != READY or not self.known_long(long[0][-1])):
            heapq.heappop(long)
        if long and self.short_handed() and tops and long[0][0] <= min(tops)[0]:
            return long  # never ahead of a recovery wave
        return None

    def short_handed(self) -> bool:
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
        sp = self.settings
        factor = sp.slow_node
        if factor is None:
            return False
        if any(self.slow(n.id) for n in self.s.nodes.values() if n.pace and n.alive):
            return True
        for g in self.s.groups.values():
            r = self._runtimes(g.lead)
            if r is None or len(r.samples) < sp.min_samples or not r.mean:
                continue
            late = self.s.now - factor * r.mean  # a first copy started by then straggles
            for c in g.copies.values():
                if not c.duplicate and c.started is not None and c.started <= late:
                    return True
        return False

    def _runtimes(self, key: Key) -> Runtimes | None:
        cat = self.s.categories.get(self.s.tasks[key].category)
        return None if cat is None else cat.runtimes

    def slow(self, node: str | None) -> bool:
        """Have lone tasks run ``slow_node`` times their category's mean on this node?"""
        factor = self.settings.slow_node
        n = self.s.nodes.get(node) if factor is not None and node is not None else None
        pace = n.pace if n is not None else None
        if not pace or len(pace) < 2:
            return False
        s = sorted(pace)
        return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2 >= factor

    def long(self, key: Key, ran: float) -> bool:
        """Has this task, running for ``ran`` seconds, run long for its category?

        A category known long (its mean at least ``long_task``) is long from its
        start: ``min_runtime`` guards the tests on the task's own runtime only.
        """
        sp = self.settings
        r = self._runtimes(key)
        if sp.long_task is not None and r is not None and r.count and r.mean >= sp.long_task:
            return True
        if ran < sp.min_runtime:
            return False
        if sp.long_task is not None and ran >= sp.long_task:
            return True
        if sp.quantile is not None and r is not None and len(r.samples) >= sp.min_samples:
            return ran > r.quantile(sp.quantile)
        return False

    # ---- copies --------------------------------------------------------------------

    def started(self, group: Group, copy: Copy) -> None:
        if not copy.duplicate:  # a duplicate's CPU was taken when it was sent
            n = self.s.node(copy.node)
            n.free = max(0.0, n.free - self.s.cpus(group))

    def finished(self, group: Group, ev: TaskFinished, out: list[Instruction]) -> None:
        """Copy ``ev.copy`` of ``group`` won; the others are being cancelled."""
        winner = group.copies[ev.copy]
        losers = tuple(c for c in group.copies if c != ev.copy)
        if self.enabled:
            if ev.started:
                self.s.now = max(self.s.now, ev.started + sum(ev.durations.values()))
            if ev.node is not None:  # the winner's CPU is free now
                n = self.s.node(ev.node)
                n.free = max(n.free, self.s.cpus(group))
        if winner.duplicate:
            out.append(self._won(group, ev, losers))
        if losers and ev.node is not None:
            # The losers' nodes are losing their worker processes (a forced cancel), and
            # Ray's locality may well send the next task to one of them, to wait seconds
            # for a new process; the winner's node has a CPU and a worker free right now.
            self.steer = (ev.node, self.s.cpus(group))

    def _won(self, group: Group, ev: TaskFinished, losers: tuple) -> Won:
        win = group.copies[ev.copy]
        start = ev.started or win.started or self.s.now
        if group.spared_at is not None:
            saved = group.spared_at - start
            why = "a copy's node died while the duplicate ran"
        else:
            firsts = [group.copies[c].started for c in losers if group.copies[c].started]
            saved = start - min(firsts) if firsts else 0.0
            why = "the duplicate finished first"
        return Won(group.lead, group.id, ev.copy, losers, max(0.0, saved), why)

    def steered(self, group: Group) -> tuple[str | None, str]:
        """Where a first copy goes when a duplicate just won (else ``None``)."""
        if self.steer is None:
            return None, ""
        node, free = self.steer
        cpus = self.s.cpus(group)
        root = self.s.tasks[group.keys[-1]]
        if cpus <= free and set(root.resources or ()) <= {"CPU"} and not root.pinned:
            self.steer = (node, free - cpus) if free > cpus else None
            return node, "a duplicate won there (its losers' workers are stopped)"
        return None, ""

    def _may_duplicate(self, group: Group) -> bool:
        """Only a lone task that needs nothing but CPUs, of a category not known cheap."""
        lead = group.lead
        alone = len(group.keys) == 1 + len(group.consumers)  # consumers may come along
        ts = self.s.tasks[lead]
        plain = set(ts.resources or ()) <= {"CPU"} and not ts.pinned  # may run anywhere
        return alone and not self.s.fuser.cheap(lead) and plain

    def preempt(self, cost: float, out: list[Instruction]) -> bool:
        """Cancel duplicates, youngest first, if that lets a first copy of ``cost`` run.

        Duplicates only borrow idle CPUs: ready work never waits for them.
        """
        if not self.in_flight:
            return False
        s = self.s
        # a duplicate that is its group's last copy (the first died) is not spare
        dups = []
        for cid in self.in_flight:
            g = s.copies[cid]
            if len(g.copies) > 1:
                dups.append((g.copies[cid], cid, g))
        firsts = s.used - sum(g.cost for _, _, g in dups)
        if not dups or (firsts and firsts + cost > s.capacity + 1e-9):
            return False
        dups.sort(key=lambda d: -(d[0].started or math.inf))
        for copy, cid, g in dups:
            if s.used and s.used + cost > s.capacity + 1e-9 and len(g.copies) > 1:
                out.append(Cancel(cid, copy.node if s.is_alive(copy.node) else None))
                s.drop_copy(g, cid)
        return True

    # ---- duplicates ----------------------------------------------------------------

    def new_event(self) -> None:
        self._short_handed_now = None

    def ticked(self, tick: Tick) -> None:
        """Ray's view of the free CPUs replaces raydag's."""
        for n in self.s.nodes.values():
            n.free = 0.0
        for node, cpus in tick.idle.items():
            if cpus > 0:
                self.s.node(node).free = cpus

    # What changes the candidates and the free CPUs: time passing, a copy starting
    # (its node is known), a copy finishing (its CPU is free).
    LOOKS = (Tick, TaskStarted, TaskFinished)

    def after(self, event: Event, out: list[Instruction]) -> None:
        """Every event ends here: duplicate long-running copies onto free CPUs.

        Only after the events that change what could be duplicated and where
        (``LOOKS``): a copy dying with its node, say, frees a CPU Ray has not shown yet
        and may well be on that very node. On a ``Tick``, the free CPUs are Ray's.
        Between ticks, they are that view kept up to date by raydag's own events, which
        Ray's lags by a poll or so: the CPU a copy freed is taken at once. Then only
        while every copy in flight is known started: a copy sent but not started yet
        may be bound for that CPU, and goes first.
        """
        if type(event) in self.LOOKS:
            self._speculate(out, tick=type(event) is Tick)
        self.steer = None

    def _speculate(self, out: list[Instruction], tick: bool) -> None:
        sp, s = self.settings, self.s
        if not sp.enabled or s.stopped:
            return
        if s.next_ready() is not None:  # first copies go first
            return
        if len(self.in_flight) >= sp.max_in_flight or s.used >= s.capacity:
            return
        idle = {n.id: n.free for n in s.nodes.values() if n.free > 0 and n.alive}
        if not idle:
            return
        if not tick and any(c.node is None for g in s.groups.values() for c in g.copies.values()):
            return
        candidates = []
        for g in s.groups.values():
            if g.duplicated >= sp.max_copies or not self._may_duplicate(g):
                continue
            copies = g.copies.values()
            if any(c.node is None for c in copies):  # a copy not placed yet: nothing to avoid
                continue
            starts = [c.started for c in copies if c.started is not None]
            if not starts:
                continue
            ran = s.now - min(starts)
            if self.long(g.lead, ran) or any(self.slow(c.node) for c in copies):
                candidates.append((s.tasks[g.lead].priority, g.id))
        for _, gid in sorted(candidates):
            if len(self.in_flight) >= sp.max_in_flight:
                return
            g = s.groups[gid]
            if s.used + g.cost > s.capacity + 1e-9:
                return
            cpus = s.cpus(g)
            avoid = {c.node for c in g.copies.values()}
            nodes = [
                n for n, c in idle.items() if n not in avoid and c >= cpus and not self.slow(n)
            ]
            if not nodes:
                continue
            node = max(nodes, key=lambda n: (idle[n], n))
            idle[node] -= cpus
            s.nodes[node].free = idle[node]
            copy = s.new_copy(g, node=node, duplicate=True)
            g.duplicated += 1
            self.in_flight.add(copy.id)
            out.append(s.submit(g, copy, node=node))

    def dropped(self, copy: int) -> None:
        self.in_flight.discard(copy)

    def validate(self) -> None:
        dups = {cid for g in self.s.groups.values() for cid, c in g.copies.items() if c.duplicate}
        assert dups == self.in_flight, (dups, self.in_flight)
        assert len(self.in_flight) <= max(self.settings.max_in_flight, 0)
        for g in self.s.groups.values():
            assert len(g.copies) <= 1 + self.settings.max_copies, g
            for c in g.copies.values():
                assert not c.duplicate or c.node is not None, (c, g)
        long = {c.name for c in self.s.categories.values() if c.long}
        expect = {
            c.name
            for c in self.s.categories.values()
            if c.runtimes is not None and self.long_mean(c.runtimes)
        }
        assert long == expect, (long, expect)
