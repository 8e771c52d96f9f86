"""Recovery: what a node's death lost, and one wave that recomputes all of it.

When a node dies, every value whose primary copy it held is lost, with two exceptions:

- a value Ray returned inline (below its ``max_direct_call_object_size``, and the
  task's kept values together below ``task_rpc_inlined_bytes_limit``) lives in the
  driver's memory, on no node;
- a value read by a copy running on an alive node is held by that copy: it fetched
  its inputs before it started, so a long task that has its inputs goes on. A reader
  that also reads a lost value is cancelled and holds nothing, so the rule is applied
  until nothing changes.

Cached copies on other nodes are not counted on: Ray may drop them, or never confirm
them, at any moment, and counting on them split one death into a wave per value.

Every lost value still needed is recomputed in *one wave*: the lost values, and,
transitively, the released inputs those recomputations read, and nothing else. Groups
in flight that read a lost value cannot finish: they are cancelled and wait again.
Recomputations go ahead of all other work (tier 0 of the ready heaps).

Ray may also report a value lost before the cluster reports its node dead (a reader's
fetch fails first). Then the state machine takes that node for dead itself
(``NodeTakenDead``), so everything it held goes in that same wave, not one wave per
value as the readers fail one by one.

Worked example: ``a -> b -> c -> out`` with ``b`` released, ``c`` in memory on n2, ``out``
waiting on ``c`` and on ``d`` (in memory on n1, read by a running ``e`` on n1). n2 dies:
``c`` is lost; ``b`` was released, so it is recomputed too (``a`` is in memory); one
``Recover(lost=(c,), recompute=(c, b))``. Had n1 died instead, ``d`` would be kept: ``e``
holds it and goes on.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raydag import config
from raydag.core.events import NodeTakenDead, Recover
from raydag.core.records import MEMORY, READY, RELEASED, WAITING

if TYPE_CHECKING:
    from raydag.core.events import Instruction
    from raydag.core.state import State

Key = Hashable


@dataclass(frozen=True)
class Recovery:
    """Recovery's settings (``raydag.recovery.*``; defaults in raydag.yaml)."""

    # Ray's lineage reconstruction goes first: raydag recomputes only what Ray reports
    # it could not (an input lost for a copy).
    ray_first: bool = field(default_factory=lambda: config.default("recovery.ray-first"))

    @classmethod
    def from_config(cls) -> Recovery:
        return cls(ray_first=bool(config.get("recovery.ray-first")))


class Recoverer:
    """The state machine's recovery part."""

    def __init__(self, state: State, settings: Recovery) -> None:
        self.s = state
        self.settings = settings
        self.wave = 0
        self.kept: set = set()  # values a death spared, read by running copies (to log)

    def node_died(self, node: str, reason: str, out: list[Instruction]) -> None:
        n = self.s.node(node)
        if not n.alive:
            return
        self.s.dead(n)
        if not self.settings.ray_first:
            self.lose(self.lost_with_dead_nodes(), reason or f"node died: {node[:12]}", out)

    def input_lost(
        self, copy: int, keys: Iterable[Key], reason: str, out: list[Instruction]
    ) -> None:
        """Copy ``copy`` could not fetch ``keys``: their nodes are taken for dead, and
        everything those nodes held goes in one wave with them."""
        tasks = self.s.tasks
        keys = [k for k in keys if k in tasks]
        suspects = {tasks[k].node for k in keys} - {None}
        for node in sorted(suspects):
            n = self.s.node(node)
            if n.alive:
                self.s.dead(n)
                out.append(NodeTakenDead(node, f"Ray lost a value it held ({reason})"))
        self.lose(self.lost_with_dead_nodes(ended={copy}, gone=keys), reason, out)

    def lost_with_dead_nodes(self, ended: Collection[int] = (), gone: Iterable[Key] = ()) -> list:
        """The values gone with the dead nodes, and ``gone`` (values Ray says it lost).

        Of every dead node, not only the latest: one spared then because a reader held
        it is lost now if that reader is being cancelled. ``ended``: copies known to
        have ended, whatever was heard of them: they hold nothing.
        """
        s = self.s
        self.kept = set()
        gone = [k for k in gone if s.tasks[k].state == MEMORY]
        keys = [
            k
            for n in s.nodes.values()
            if not n.alive
            for k in n.held
            if not s.tasks[k].inline and s.tasks[k].state == MEMORY and k not in gone
        ]
        if not keys:
            return gone
        readers = [
            set(g.inputs)
            for g in s.groups.values()
            if any(
                c.started is not None and s.is_alive(c.node) and cid not in ended
                for cid, c in g.copies.items()
            )
        ]
        read = set().union(*readers)
        lost = [*gone, *(k for k in keys if k not in read)]
        held = {k for k in keys if k in read}
        while lost and held:
            staying = [inputs for inputs in readers if inputs.isdisjoint(lost)]
            still = {k for k in held if any(k in inputs for inputs in staying)}
            if still == held:
                break
            lost.extend(held - still)
            held = still
        self.kept = held  # for the Ray layer's debug log
        return lost

    def lose(self, keys: Iterable[Key], reason: str, out: list[Instruction]) -> None:
        """Recompute, in one wave, every lost value still needed and what it needs.

        A value in memory is needed by definition (it is released once nothing needs
        it), so every lost one is recomputed; so are the released inputs of those
        recomputations, transitively, and nothing else.
        """
        tasks = self.s.tasks
        lost = [k for k in dict.fromkeys(keys) if k in tasks and tasks[k].state == MEMORY]
        if lost:
            self._wave(lost, reason, out)

    def rerun(
        self, keys: Iterable[Key], reset: Iterable[Key], reason: str, out: list[Instruction]
    ) -> None:
        """Recompute ``keys`` (waiting again: reading their checkpoints failed) and the
        released inputs they need, in one wave; ``reset``: the keys of their group."""
        self._wave(list(keys), reason, out, reset)

    def _wave(
        self, lost: list, reason: str, out: list[Instruction], reset: Iterable[Key] = ()
    ) -> None:
        s = self.s
        tasks = s.tasks
        lost_set = set(lost)
        recompute, held = self._lineage(lost)
        given = [k for k in recompute if tasks[k].fixed]  # a gone one among the inputs too
        if given:
            err = RuntimeError(
                f"{given[0]!r} was given to this compute (persisted earlier) and is lost: "
                f"{reason or 'its node died'}; raydag holds no lineage for it"
            )
            s.fail(given[0], err, out)
            return
        reset = list(reset)
        for g in list(s.groups.values()):
            if lost_set.intersection(g.inputs):
                reset.extend(s.reset_group(g, out))
        for k in held:
            s.transition(tasks[k], MEMORY)
        for k in recompute:
            ts = tasks[k]
            ts.recovering = True
            s.checkpointer.cut(ts)  # read back, if it can be: its lineage is not walked
            if ts.state != WAITING:  # waiting already: its read back failed (``rerun``)
                s.transition(ts, WAITING)
        reset.extend(self._unkept(recompute, out))
        self.wave += 1
        out.append(Recover(self.wave, tuple(lost), tuple(recompute), reason))
        touched = set(recompute) | set(reset)
        for k in lost:
            touched.update(tasks[k].dependents)
        self._recount(touched, recompute)

    def _lineage(self, lost: list) -> tuple[list, list]:
        """The lost values and the released inputs their recomputation reads,
        transitively; and the released given values it reads, to hold again (their
        owner still has them), unless gone (``State.gone``: of an earlier Ray session).
        A value that can be read back from its checkpoint reads nothing.
        Changes nothing: the wave may yet fail (a value without lineage)."""
        tasks = self.s.tasks
        reads = self.s.checkpointer.reads
        gone = self.s.gone
        lost_set = set(lost)
        recompute: list = []
        held: dict = {}
        seen: set = set()
        stack = list(lost)
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            recompute.append(k)
            for d in reads(tasks[k]):
                td = tasks[d]
                if td.given and td.state == RELEASED and d not in gone:
                    held[d] = None
                elif td.state == RELEASED or d in lost_set or (d in gone and td.state == MEMORY):
                    stack.append(d)
        return recompute, list(held)

    def _recount(self, touched: set, recompute: list) -> None:
        """Who waits on what after a wave, and who is ready now."""
        s, tasks = self.s, self.s.tasks
        for k in touched:
            ts = tasks[k]
            if ts.state not in (WAITING, READY):
                continue
            ts.missing = sum(tasks[d].state != MEMORY for d in ts.dependencies)
            if ts.missing == 0 and ts.state == WAITING:
                s.transition(ts, READY)
            elif ts.missing and ts.state == READY:
                s.transition(ts, WAITING)
        for k in {d for r in touched for d in tasks[r].dependencies} | set(recompute):
            ts = tasks[k]
            ts.waiters = sum(tasks[d].state not in (MEMORY, RELEASED) for d in ts.dependents)

    def _unkept(self, recompute: list, out: list[Instruction]) -> list:
        """Groups in flight that make, but do not keep, a value that ``recompute`` reads
        (a shuffle's map running for other pieces, a producer running with other
        consumers): they cannot hand it over, so they are cancelled and run again with
        every reader then waiting."""
        s = self.s
        reset: list = []
        for k in recompute:
            for d in s.tasks[k].dependencies:
                gid = s.tasks[d].group
                if gid is not None and gid in s.groups and d not in s.groups[gid].kept:
                    reset.extend(s.reset_group(s.groups[gid], out))
        return reset
