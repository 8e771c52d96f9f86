"""Fusion: cheap tasks run several to one Ray task, and quick consumers in their producer's.

A Ray task costs the machine about 9 ms beyond its own work (the driver, the raylet, the
worker fetching and storing values), far more than many dask tasks. So when a ready
task's category has a measured mean below ``max_task_duration``, the state machine walks
up from it: while the current task's only dependent needs nothing but the current task,
values in memory and cheap ready subtrees that feed only it (a chain, or a reduction
tree over fresh inputs), those join the same Ray task, up to ``max_group_size`` tasks and
``max_group_duration`` of estimated work. Values inside a group never reach the object
store.

Worked example: ``read-0 -> clean-0 -> sum`` with ``read`` and ``clean`` measured at 2 ms
and ``sum`` reading ``clean-0 .. clean-3``. ``read-1`` becomes ready; ``clean-1`` reads only
it, and is cheap: it joins. ``sum`` reads three other cleans not in memory: unless each
is a cheap subtree whose leaves are ready (then they join too), the walk stops at
``clean-1``, and the group is ``(read-1, clean-1)``: one Ray task, one object.

**Consumers come along.** A task of any length takes its pending consumers into its Ray
task, right after it, when each reads nothing but it, values in memory and other tasks
that join, and together they are cheap or take at most ``CONSUMERS_SHARE`` of the task's
own mean runtime; with them come, to a fixpoint, the cheap tasks reading nothing but
the group's and memory's values. Worked example, a coffea skim of one partition: the
reader ``from-uproot-3`` (1.4 s) is read by ``Muon-3``, ``run-3``, ``event-3`` and by
``getitem-3`` (the selected events), which also reads ``mask-3``, made from ``Muon-3``.
``getitem-3`` reads a task not in memory, so it cannot join alone; but ``Muon-3`` joins,
then ``mask-3`` (it reads only ``Muon-3``), then ``getitem-3``, then the parquet write
and the histogram fill that read it: one Ray task for the partition, where each accessor
a Ray task of its own would cost a round trip on the partition's critical path. Those
read outside (the write's and the fill's values, read by the reductions) are kept. A
category measured fewer than ``PROBES`` times joins as a probe, while fewer than
``PROBES`` of its runs are in flight.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raydag import config
from raydag.core.records import MEMORY, READY, RELEASED, WAITING

if TYPE_CHECKING:
    from raydag.core.state import State

Key = Hashable

# Consumers that are not cheap still run in their producer's task when together they
# take at most this share of its runtime (a writer after an hour of processing).
CONSUMERS_SHARE = 0.5
# A consumer's category is judged on this many runs (the first run in a worker pays
# for imports and warm-up). Until then it joins groups as a probe while fewer than this
# many of its runs are in flight. Probes go several at once, not one group after
# another: a producer refused them keeps its value for consumers run as Ray tasks of
# their own, each a round trip through the object store that fusion is there to save
# (a coffea reader's events read back by a dozen accessors: 0.1-0.3 s each on 2 CPUs).
# A category that proves long has then run beside its producers a few times more than
# PROBES (those measured, and those in flight when the last probe joined).
PROBES = 3


def _d(key: str) -> object:
    return field(default_factory=lambda: config.default(key))


def _s(key: str) -> object:
    return field(default_factory=lambda: config.default_seconds(key))


@dataclass(frozen=True)
class Fusion:
    """Fusion's settings (``raydag.fusion.*``; defaults in raydag.yaml)."""

    enabled: bool = _d("fusion.enabled")  # type: ignore[assignment]
    max_task_duration: float = _s("fusion.max-task-duration")  # type: ignore[assignment]
    max_group_duration: float = _s("fusion.max-group-duration")  # type: ignore[assignment]
    max_group_size: int = _d("fusion.max-group-size")  # type: ignore[assignment]

    @classmethod
    def from_config(cls) -> Fusion:
        return cls(
            enabled=bool(config.get("fusion.enabled")),
            max_task_duration=config.seconds("fusion.max-task-duration"),
            max_group_duration=config.seconds("fusion.max-group-duration"),
            max_group_size=int(config.get("fusion.max-group-size")),
        )


class Fuser:
    """The state machine's fusion part: which keys run together, what a group costs."""

    def __init__(self, state: State, settings: Fusion) -> None:
        self.s = state
        self.settings = settings

    def cheap(self, key: Key) -> bool:
        est = self.s.estimate(key)
        return est is not None and est < self.settings.max_task_duration

    def cost(self, key: Key, estimate: float | None) -> float:
        """Slots a group led by ``key`` takes: its CPUs, a fraction when measured cheap,
        or when it is read back from its checkpoint (``raydag.core.checkpoints``): a read
        runs none of the task's code, waits on I/O, and holds nothing in the object store
        until it runs, so a resume's frontier of reads is handed to Ray at once (its CPUs
        run them back to back, no round trip to the driver between two) rather than a
        slot's worth at a time."""
        ts = self.s.tasks[key]
        r = ts.resources
        cpus = float(r.get("CPU", 1)) if r else 1.0
        if ts.restore or (estimate is not None and estimate < self.settings.max_task_duration):
            return cpus * self.s.cheap_cost
        return cpus

    def _same_kind(self, a: Key, b: Key) -> bool:
        ta, tb = self.s.tasks[a], self.s.tasks[b]
        return (
            ta.resources == tb.resources
            and ta.retries == tb.retries
            and ta.remote_args == tb.remote_args
        )

    def _fusable(self, key: Key) -> bool:
        """No output, no given value, no bundle's map or piece, no key annotated
        ``checkpoint=True``: those keep their values."""
        ts = self.s.tasks[key]
        return not (
            ts.output or ts.given or self.s.bundler.member(key) or self.s.checkpointer.forced(key)
        )

    def chain(self, key: Key) -> tuple:
        """``key`` plus the cheap consumers it completes, and what else feeds only them.

        Every member but the last has its one consumer inside the group, so its value
        never leaves the Ray task.
        """
        f, tasks = self.settings, self.s.tasks
        if not f.enabled or not self.cheap(key) or self.s.bundler.member(key):
            return (key,)
        keys = [key]
        members = {key}
        total = self.s.estimate(key) or 0.0
        cur = key
        # a given value recomputed after a loss must reach the object store, like an
        # output, so the Ray layer can hand it back to its owner: never fused away
        while self._fusable(cur) and len(tasks[cur].dependents) == 1:
            (nxt,) = tasks[cur].dependents
            if self.s.bundler.member(nxt):  # a bundle runs as its own group
                break
            if tasks[nxt].state != WAITING or not self.cheap(nxt) or not self._same_kind(key, nxt):
                break
            budget = f.max_group_size - len(keys) - 1
            if budget < 0:  # no room for ``nxt`` itself
                break
            extra: list = []
            for d in sorted(tasks[nxt].dependencies - members, key=self.s.priority):
                if tasks[d].state == MEMORY:
                    continue
                sub = self._exclusive_subtree(d, key, budget - len(extra))
                if sub is None:
                    return tuple(keys)
                extra.extend(sub)
            more = sum(self.s.estimate(d) or 0.0 for d in extra) + (self.s.estimate(nxt) or 0.0)
            if total + more > f.max_group_duration:
                break
            keys.extend(extra)
            keys.append(nxt)
            members.update(extra)
            members.add(nxt)
            total += more
            cur = nxt
        return tuple(keys)

    def _exclusive_subtree(self, key: Key, like: Key, budget: int) -> list | None:
        """``key`` and its unfinished ancestors, topologically, if all can join a group:
        each cheap, of ``like``'s kind, read by nothing outside, the leaves ready."""
        ts = self.s.tasks[key]
        if (
            budget <= 0
            or not self._fusable(key)
            or len(ts.dependents) != 1
            or not self.cheap(key)
            or not self._same_kind(like, key)
        ):
            return None
        if ts.state == READY:
            return [key]
        if ts.state != WAITING:
            return None
        keys: list = []
        for d in sorted(ts.dependencies, key=self.s.priority):
            if self.s.tasks[d].state == MEMORY:
                continue
            sub = self._exclusive_subtree(d, like, budget - len(keys) - 1)
            if sub is None:
                return None
            keys.extend(sub)
        return keys + [key]

    def consumers(self, keys: tuple) -> tuple:
        """The tasks that run in the group's Ray task right after its root, in order.

        All of the root's pending consumers or none, so that its value never leaves the
        task; with them, the cheap tasks that read nothing but the root, each other and
        values in memory (a skim's field accessors, masks and selections on one
        partition, whatever their shape), taken to a fixpoint. Each must be of the
        root's kind and no bundle's; together cheap (the group within
        ``max_group_duration``), or short beside the root (``CONSUMERS_SHARE``). Those
        read outside the group are kept (``kept``); the rest never leave the worker.
        """
        root = keys[-1]
        f, tasks = self.settings, self.s.tasks
        if not f.enabled or not self._fusable(root):
            return ()
        pending = [d for d in tasks[root].dependents if tasks[d].state not in (MEMORY, RELEASED)]
        room = f.max_group_size - len(keys)
        if not pending or len(pending) > room:
            return ()
        inside = set(keys)
        joined: list = []
        direct = set(pending)
        candidates = set(pending)
        while candidates:  # a candidate joins once every input is inside or in memory
            ready = []
            for d in sorted(candidates, key=self.s.priority):
                td = tasks[d]
                if (
                    td.state != WAITING
                    or self.s.bundler.member(d)
                    or not self._same_kind(root, d)
                    or (d not in direct and not self._fusable(d))
                    or (d not in direct and not self.cheap(d) and self._measured(d))
                ):
                    if d in direct:
                        return ()
                    candidates.discard(d)
                elif all(x in inside or tasks[x].state == MEMORY for x in td.dependencies):
                    ready.append(d)
            if not ready:
                break
            for d in ready:
                if len(joined) == room:
                    break
                candidates.discard(d)
                inside.add(d)
                joined.append(d)
                candidates.update(
                    x for x in tasks[d].dependents if x not in inside and tasks[x].state == WAITING
                )
            if len(joined) == room:
                break
        if not direct <= inside:
            return ()
        total = 0.0
        probes: set = set()
        for d in joined:
            cat = self.s.categories.get(tasks[d].category)
            if cat is None or cat.count < PROBES:
                probes.add(tasks[d].category)
            else:
                total += cat.total / cat.count
        group = sum(self.s.estimate(k) or 0.0 for k in keys) + total
        cheap = total < f.max_task_duration and group <= f.max_group_duration
        lead = self.s.estimate(root)
        if not cheap and (lead is None or total > lead * CONSUMERS_SHARE):
            return ()
        if probes:  # a few probes of a category in flight at once (see PROBES)
            cats = self.s.categories
            if any(tasks[k].category in probes for k in keys) or any(
                cats[c].processing >= PROBES for c in probes if c in cats
            ):
                return ()
        return tuple(joined)

    def _measured(self, key: Key) -> bool:
        cat = self.s.categories.get(self.s.tasks[key].category)
        return cat is not None and cat.count >= PROBES

    def kept(self, keys: tuple) -> tuple:
        """The members of a group whose values leave its Ray task: those that must
        (outputs, given values recomputed after a loss, which the Ray layer hands back
        to their owner, and keys annotated ``checkpoint=True``: ``_fusable``), and
        those a task outside the group has still to read."""
        members, tasks = set(keys), self.s.tasks
        done = (MEMORY, RELEASED)
        return tuple(
            k
            for k in keys
            if not self._fusable(k)
            or any(d not in members and tasks[d].state not in done for d in tasks[k].dependents)
        )
