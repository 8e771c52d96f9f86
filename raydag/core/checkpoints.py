"""Checkpoints: which results are written durably, and reading them back instead of
recomputing them.

Everything a compute holds lives in Ray's object store, which a dead node empties in
part and a dead driver empties whole. A checkpoint is a result written to a store that
outlives both (a directory, a shared filesystem, an object store: any fsspec URL, see
``raydag.runtime.checkpoints``). This part decides, as instructions:

- **what is written**: a kept value whose loss would be expensive to make good, i.e.
  whose *lineage cost* (``TaskState.behind``) reaches ``min_cost``: the seconds its own
  group ran, plus the lineage costs of the inputs it read that are neither given nor
  checkpointed (what a loss would rerun once they are released; an upper bound, a
  shared ancestor counted once per path). A checkpointed value's cost is 0: a loss
  below it stops there. ``dask.annotate(checkpoint=True)`` forces a key,
  ``checkpoint=False`` forbids it; ``categories`` forces whole categories. Nothing
  more is written once the store refused a write (``CheckpointsOff``: a read-only or
  full store is reported once and the compute goes on without); a write lost with its
  node (the death recovery handles) is no reason to.
- **what a dead driver would redo, in sum**: the rule above bounds what the loss of one
  value redoes, but a driver's death loses every value in memory at once. Those not
  written each cost less than ``min_cost``; their sum (the *exposure*: the lineage costs
  of the kept values in memory that are not durable) is what a rerun would redo, spread
  over the cluster's CPUs. The Checkpointer keeps it at most ``min_cost`` times the CPUs
  (the same promise as for one value: a driver's death costs about ``min_cost`` of the
  cluster's time in recomputation): once a finished group takes it over, the exposed
  values with the largest lineage costs are written until it is under again. This
  catches what the per-value rule cannot: many values each under ``min_cost`` held
  together, typically the inputs of a fan-in (a merge of many partial results) waiting
  for the last of them.
- **how**: ``Checkpoint(key)`` once the value is in memory; the Ray layer writes it
  beside the value's readers (its node's writer, ``raydag.runtime.checkpoints``), so
  they never wait for the write and a failed write fails no task. The write reports ``CheckpointWritten`` or
  ``CheckpointFailed``.
- **reading back**: a key with a whole checkpoint (written here, or found in the store
  at the start: ``checkpointed``) that must be made again is *cut*: it reads nothing,
  its lineage is not walked, and its group's ``Submit.restore`` tells the Ray layer to
  read it instead of running it. At the start (resume), the outputs' lineage is walked
  down to the first checkpointed keys; in a recovery wave, the same (``Recoverer``).
  A checkpoint that cannot be read back (corrupt, gone) is forgotten
  (``CheckpointIgnored``), the key's lineage restored and recomputed in one wave.
- **superseded**: once every reader of a checkpointed key is checkpointed too, no
  lineage walk reaches it: ``RemoveCheckpoints`` removes it mid-compute (unless
  ``keep``) and ``max_size`` counts it no more, so the cap bounds the store's frontier,
  not every byte ever written (at 60k tasks of the founding user's shape the 50-GiB
  default was spent within minutes on early, cheap values, and nothing written after).
- **displaced**: ``max_size`` caps the bytes the store holds at once. A value worth
  writing that does not fit takes the room of the checkpoints that protect least per
  byte (their lineage seconds per byte), if together they protect less than it does:
  the store then holds more seconds of lineage in the same bytes (the greedy rule of a
  knapsack, as a cache keeps its dearest entries). Without it the first values worth
  writing fill the store and the dearest come too late for room: at the founding
  user's shape, its hour-long tasks wait behind minute-long 150-MB loads. A checkpoint
  being written, or being read back, is not displaced. A checkpoint's seconds are what
  losing it would redo: when it supersedes its inputs' checkpoints, theirs add to it;
  when it is displaced, its own go back onto the values made from it (down to the first
  durable ones), and those in memory are weighed again (written if now worth it).
- **hygiene**: once the compute is done, ``DropCheckpoints`` (unless ``keep``).

Worked example: ``a -> b -> c`` (output ``c``), ``min_cost=60``; ``a`` runs 50 s,
``b`` 20 s. ``a`` finishes: behind 50 s, not written. ``b`` finishes: behind 20 + 50 =
70 s: ``Checkpoint("b")``; ``a`` is released. The driver is killed while ``c`` runs.
The rerun is told ``checkpointed={"b"}``: ``start()`` cuts ``b`` (it reads nothing),
``a`` is not needed and stays released; ``b`` is submitted with ``restore=("b",)``,
then ``c`` runs. Done: ``DropCheckpoints(("b",))``.

Worked example of displacement: ``max_size`` 300 MB, ``min_cost`` 60; loads ``l0``,
``l1`` of 150 MB and 60 s each are written (0.4 s a MB). ``h`` (an hour-long task on
another load, 60 MB) finishes: behind 3,660 s, 61 s a MB, and no room. The cheapest per
byte, ``l0``, frees 150 MB and protects 60 s < 3,660: ``RemoveCheckpoints(("l0",))``
and ``Checkpoint("h")``. The store holds 210 MB protecting 3,720 s, not 300 MB
protecting 120.

Worked example of the exposure: 4 CPUs, ``min_cost=60``; ten inputs of 40 s each
(``x0`` .. ``x9``, none worth writing by itself) feed one merge. After six are in memory
the exposure is 240 s, the budget (60 x 4). The seventh makes it 280: the one with the
largest lineage cost is written (all equal: the earliest), 240 again; so is one more
per input after that. A driver killed before the merge runs leaves the rerun 240
task-seconds to redo (60 s on the 4 CPUs), not 400.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raydag import config
from raydag.core.events import (
    Checkpoint,
    CheckpointFailed,
    CheckpointIgnored,
    CheckpointsOff,
    CheckpointWritten,
    DropCheckpoints,
    RemoveCheckpoints,
)
from raydag.core.records import MEMORY, RELEASED, WAITING

if TYPE_CHECKING:
    from raydag.core.events import Instruction, TaskErred, TaskFinished
    from raydag.core.records import Group, TaskState
    from raydag.core.state import State

Key = Hashable

# TaskState.durable
WRITING = "writing"  # a write is in flight
WRITTEN = "written"  # written whole in this compute
FOUND = "found"  # found in the store at the start (an earlier compute's)
READABLE = (WRITTEN, FOUND)


def _enabled(value: Any, store: str | None) -> bool:
    """``auto``: on when a store is set."""
    return store is not None if value == "auto" else bool(value)


def _bytes(value: Any) -> int | None:
    from dask.utils import parse_bytes

    return None if value is None else int(parse_bytes(value))


@dataclass(frozen=True)
class Checkpoints:
    """Checkpoints' settings (``raydag.checkpoint.*``; defaults in raydag.yaml)."""

    enabled: bool = field(
        default_factory=lambda: _enabled(
            config.default("checkpoint.enabled"), config.default("checkpoint.store")
        )
    )
    store: str | None = field(default_factory=lambda: config.default("checkpoint.store"))
    min_cost: float = field(default_factory=lambda: config.default_seconds("checkpoint.min-cost"))
    categories: frozenset = field(
        default_factory=lambda: frozenset(config.default("checkpoint.categories") or ())
    )
    keep: bool = field(default_factory=lambda: config.default("checkpoint.keep"))
    max_size: int | None = field(
        default_factory=lambda: _bytes(config.default("checkpoint.max-size"))
    )
    resume: bool = field(default_factory=lambda: config.default("checkpoint.resume"))

    @classmethod
    def from_config(cls) -> Checkpoints:
        store = config.get("checkpoint.store")
        return cls(
            enabled=_enabled(config.get("checkpoint.enabled"), store),
            store=store,
            min_cost=config.seconds("checkpoint.min-cost"),
            categories=frozenset(config.get("checkpoint.categories") or ()),
            keep=bool(config.get("checkpoint.keep")),
            max_size=_bytes(config.get("checkpoint.max-size")),
            resume=bool(config.get("checkpoint.resume")),
        )


class LazyHeap:
    """Keys by priority, least first. A key pushed again replaces its entry; entries of
    keys discarded or pushed again since are skipped when met, and dropped in a rebuild
    once they are most of the heap."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Key]] = []
        self._latest: dict[Key, int] = {}  # each key's current entry
        self._seq = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._latest

    def keys(self) -> set:
        return set(self._latest)

    def push(self, key: Key, priority: float) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._latest) + 64:
            heap[:] = [e for e in heap if self._latest.get(e[2]) == e[1]]
            heapq.heapify(heap)
        self._seq += 1
        self._latest[key] = self._seq
        heapq.heappush(heap, (priority, self._seq, key))

    def discard(self, key: Key) -> None:
        self._latest.pop(key, None)
        if not self._latest:
            self._heap.clear()

    def pop(self) -> tuple[float, Key] | None:
        """The least key and its priority, taken out; None when empty."""
        heap = self._heap
        while heap:
            priority, seq, key = heapq.heappop(heap)
            if self._latest.get(key) == seq:
                del self._latest[key]
                return priority, key
        return None


class Checkpointer:
    """The state machine's checkpoint part."""

    def __init__(
        self,
        state: State,
        settings: Checkpoints,
        found: Iterable[Key] = (),
        marks: Mapping[Key, Any] | None = None,
    ) -> None:
        self.s = state
        self.settings = settings
        self.enabled = settings.enabled
        self.off = False  # a write failed: no more in this compute
        self.written_bytes = 0  # written, and being written (their sizes as measured)
        self._bytes: dict[Key, int] = {}  # of each: its size when the write began
        self.dropped = False
        # a cut key's own dependencies and source flag, to restore if its read fails
        self.lineage: dict[Key, tuple[frozenset, bool]] = {}
        # the kept values in memory, not durable, by lineage cost: what a driver's
        # death would redo (their sum, the exposure), and a max-heap of them (lazy:
        # entries of keys gone since are skipped)
        self.exposed: dict[Key, float] = {}
        self.exposure = 0.0
        self._dearest = LazyHeap()  # the exposed keys, largest lineage cost first
        # the checkpoints held (``_bytes``), cheapest per byte first: what a dearer
        # value displaces
        self._held = LazyHeap()
        # values in memory whose lineage cost rose (a checkpoint above them displaced)
        self._offers: list[Key] = []
        self.marks = {k: bool(v) for k, v in (marks or {}).items() if k in state.tasks}
        if self.enabled and settings.resume:
            for k in found:
                ts = state.tasks.get(k)
                if ts is not None and not ts.given:
                    ts.durable = FOUND

    # ---- queries --------------------------------------------------------------------

    def forced(self, key: Key) -> bool:
        """Annotated ``checkpoint=True``: its value must leave its Ray task (no fusing)."""
        return self.enabled and self.marks.get(key, False)

    def readable(self, ts: TaskState) -> bool:
        return ts.durable in READABLE and not ts.given

    def reads(self, ts: TaskState) -> frozenset:
        """What making ``ts`` again reads: nothing if it can be read back."""
        return frozenset() if self.readable(ts) else ts.dependencies

    # ---- cutting lineage -------------------------------------------------------------

    def cut(self, ts: TaskState) -> None:
        """``ts`` is read back from its checkpoint when it runs: it reads nothing."""
        if ts.restore or not self.readable(ts):
            return
        tasks = self.s.tasks
        self.lineage[ts.key] = (ts.dependencies, ts.source)
        for d in ts.dependencies:  # a new set: the graph's may be shared (``State``)
            tasks[d].dependents = tasks[d].dependents - {ts.key}
        ts.dependencies = frozenset()
        ts.source = True
        ts.restore = True

    def _uncut(self, ts: TaskState) -> None:
        deps, source = self.lineage.pop(ts.key)
        for d in deps:
            self.s.tasks[d].dependents = self.s.tasks[d].dependents | {ts.key}
        ts.dependencies = deps
        ts.source = source
        ts.restore = False

    # ---- hooks -----------------------------------------------------------------------

    def finished(self, group: Group, ev: TaskFinished, out: list[Instruction]) -> None:
        """A group's kept values are in memory: learn their lineage costs, write those
        worth it."""
        tasks = self.s.tasks
        if not self.enabled:
            return
        own = sum(ev.durations.get(m, 0.0) for m in group.keys if not tasks[m].restore)
        upstream = sum(self._cost(tasks[d]) for d in group.inputs)
        # the last values of a compute whose checkpoints go at its end: not worth writing
        last = self.s.done and not self.settings.keep
        for k in group.kept:
            ts = tasks[k]
            ts.behind = 0.0 if ts.restore else own + upstream
            if last or ts.state != MEMORY or ts.durable is not None or not self._allowed(ts):
                continue
            if self._worth(ts):
                if self._room(ts, out):
                    self._write(ts, out)
            elif ts.behind > 0:
                self._expose(ts)
        if not last:
            self._offer_again(out)
            self._bound(out)

    def _cost(self, ts: TaskState) -> float:
        return 0.0 if ts.given or ts.durable is not None else ts.behind

    def _allowed(self, ts: TaskState) -> bool:
        """May be written at all (not forbidden, nor read back, nor off)."""
        return not (self.off or ts.given or ts.restore or self.marks.get(ts.key) is False)

    def _protects(self, ts: TaskState) -> float:
        """The seconds of lineage a checkpoint of ``ts`` spares a loss; forced ones
        (annotated, or of a forced category) are never displaced."""
        if self.marks.get(ts.key) or ts.category in self.settings.categories:
            return float("inf")
        return ts.behind

    def _density(self, ts: TaskState) -> float:
        return self._protects(ts) / max(1, ts.nbytes or 0)

    def _room(self, ts: TaskState, out: list[Instruction]) -> bool:
        """Is there room for ``ts`` under ``max_size``? The room its write frees (the
        checkpoints it supersedes) counts; what is still missing is taken from the
        checkpoints that protect least per byte, if together they protect less than
        ``ts`` would (else ``ts`` is not written)."""
        cap = self.settings.max_size
        if cap is None:
            return True
        missing = self.written_bytes + (ts.nbytes or 0) - cap
        if missing > 0:
            missing -= self._frees(ts)
        if missing <= 0:
            return True
        worth, tasks, held = self._protects(ts), self.s.tasks, self._held
        taken: list[tuple[float, Key]] = []
        aside: list[tuple[float, Key]] = []  # being written, or read back: they stay
        freed, spared = 0, 0.0
        while freed < missing and (entry := held.pop()) is not None:
            t = tasks[entry[1]]
            if t.durable != WRITTEN or t.restore or t.key in ts.dependencies:
                aside.append(entry)  # an input's room is counted above, if it frees any
                continue
            if spared + self._protects(t) >= worth:
                aside.append(entry)
                break
            taken.append(entry)
            freed += self._bytes[t.key]
            spared += self._protects(t)
        fits = freed >= missing
        for density, k in aside + ([] if fits else taken):
            held.push(k, density)
        if not fits:
            return False
        gone = tuple(k for _, k in taken)
        for k in gone:
            tasks[k].durable = None
            self._unhold(k)
            self._unspare(tasks[k])
        out.append(RemoveCheckpoints(gone))
        return True

    def _unspare(self, ts: TaskState) -> None:
        """``ts``'s checkpoint was displaced: a loss below it reruns its lineage again.
        Its lineage cost goes back onto the values made from it (as ``_supersede`` moves
        an input's onto the value that supersedes it), down to the first durable ones;
        those in memory are offered again (``_offer_again``): a value refused room while
        its inputs were written (132 s of lineage, say) may protect 1,000 s once they
        are gone, more than what took their room."""
        tasks, cost = self.s.tasks, ts.behind
        seen, todo = {ts.key}, list(ts.dependents)
        while todo:
            t = tasks[todo.pop()]
            if t.key in seen or t.durable is not None or t.given:
                continue  # a loss below a durable value stops there
            seen.add(t.key)
            if t.state == MEMORY:
                t.behind += cost
                if t.key in self.exposed:
                    self._expose(t)  # at its new cost
                self._offers.append(t.key)
            elif t.state != RELEASED:
                continue  # not made yet: its cost is its inputs' when it is
            todo.extend(t.dependents)

    def _offer_again(self, out: list[Instruction]) -> None:
        """The values in memory whose lineage cost rose (``_unspare``) are weighed again:
        written if now worth it and there is room, else exposed at their new cost. After
        a group's own values: the room they took is taken. Those of a displacement by
        ``_bound`` wait for the next group."""
        tasks = self.s.tasks
        while self._offers:
            ts = tasks[self._offers.pop()]
            if ts.state != MEMORY or ts.durable is not None or not self._allowed(ts):
                continue
            if self._worth(ts):
                if self._room(ts, out):
                    self._write(ts, out)
            else:
                self._expose(ts)

    def _worth(self, ts: TaskState) -> bool:
        """Worth writing by itself: forced, or its loss would redo ``min_cost``."""
        st = self.settings
        return (
            bool(self.marks.get(ts.key))
            or ts.category in st.categories
            or (ts.behind >= st.min_cost)
        )

    def _write(self, ts: TaskState, out: list[Instruction]) -> None:
        self.forget(ts)
        ts.durable = WRITING
        self._bytes[ts.key] = ts.nbytes or 0
        self.written_bytes += self._bytes[ts.key]
        self._held.push(ts.key, self._density(ts))
        out.append(Checkpoint(ts.key))

    def _unhold(self, key: Key) -> None:
        """``key``'s checkpoint takes no room any more (removed, failed, unreadable)."""
        self.written_bytes -= self._bytes.pop(key, 0)
        self._held.discard(key)

    # ---- the exposure: what a driver's death would redo ----------------------------------

    def _expose(self, ts: TaskState) -> None:
        self.forget(ts)  # made again (a recomputation, a duplicate's win): counted once
        self.exposed[ts.key] = ts.behind
        self.exposure += ts.behind
        self._dearest.push(ts.key, -ts.behind)

    def forget(self, ts: TaskState) -> None:
        """``ts``'s value left memory (released, lost) or is being written: no longer
        exposed."""
        cost = self.exposed.pop(ts.key, None)
        if cost is not None:
            self.exposure -= cost
            self._dearest.discard(ts.key)
            if not self.exposed:
                self.exposure = 0.0  # no drift from float sums

    def budget(self) -> float:
        """The exposure allowed: ``min_cost`` on every CPU of the cluster."""
        s = self.s
        return self.settings.min_cost * max(1.0, s.capacity / max(s.in_flight_per_cpu, 1e-9))

    def _bound(self, out: list[Instruction]) -> None:
        """Write the exposed values with the largest lineage costs until the exposure is
        within the budget."""
        budget = self.budget()
        tasks = self.s.tasks
        while self.exposure > budget and not self.off and (top := self._dearest.pop()):
            ts = tasks[top[1]]
            if self._allowed(ts) and self._room(ts, out):
                self._write(ts, out)
            else:
                self.forget(ts)  # no room: no write would take it off the exposure

    def written(self, ev: CheckpointWritten, out: list[Instruction]) -> None:
        ts = self.s.tasks.get(ev.key)
        if ts is not None and ts.durable == WRITING:
            ts.durable = WRITTEN
            self._supersede(ts, out)

    def _superseded(self, ts: TaskState) -> list[Key]:
        """The inputs of ``ts`` whose checkpoints protect nothing once ``ts`` is
        written: every other reader of each is checkpointed already."""
        if self.settings.keep:
            return []
        tasks = self.s.tasks
        return [
            d
            for d in ts.dependencies
            if tasks[d].durable in READABLE
            and not tasks[d].restore
            and not tasks[d].given
            and all(c == ts.key or tasks[c].durable in READABLE for c in tasks[d].dependents)
        ]

    def _frees(self, ts: TaskState) -> int:
        return sum(self._bytes.get(d, 0) for d in self._superseded(ts))

    def _supersede(self, ts: TaskState, out: list[Instruction]) -> None:
        """``ts`` is written: an input's checkpoint whose readers are now all written
        protects nothing (every lineage walk, a wave's or a resume's, stops above it), so
        it goes, and ``max_size`` counts only checkpoints that still protect something.
        Not when they are to be kept: a later compute sharing part of the graph reads them."""
        gone = self._superseded(ts)
        for d in gone:
            self.s.tasks[d].durable = None
            self._unhold(d)
            ts.behind += self.s.tasks[d].behind  # what losing ts redoes from now on
        if gone:
            self._held.push(ts.key, self._density(ts))  # re-weighed
            out.append(RemoveCheckpoints(tuple(gone)))

    def write_failed(self, ev: CheckpointFailed, out: list[Instruction]) -> None:
        """A write that the store refused turns checkpoints off; one lost with its node
        (``ev.lost``) says nothing of the store: the key is simply not durable (written
        again if it is made again and still worth it)."""
        ts = self.s.tasks.get(ev.key)
        if ts is not None and ts.durable == WRITING:
            ts.durable = None
            self._unhold(ts.key)
        if ev.lost:
            return
        if not self.off:
            self.off = True
            out.append(
                CheckpointsOff(
                    f"writing the checkpoint of {ev.key!r} failed "
                    f"({type(ev.error).__name__}: {ev.error}); the compute goes on without"
                )
            )

    def at_start(self, ts: TaskState) -> frozenset:
        """What the start walk follows below ``ts``: nothing if it is read back."""
        self.cut(ts)
        return ts.dependencies

    def read_failed(self, group: Group, ev: TaskErred, out: list[Instruction]) -> bool:
        """A read back failed (a corrupt or vanished checkpoint): forget it, restore the
        key's lineage and recompute it in one wave. False: not a read's failure."""
        tasks = self.s.tasks
        ts = tasks.get(ev.key)
        if ts is None or not ts.restore or ev.node_died or ev.worker_died:
            return False
        reason = f"{type(ev.error).__name__}: {ev.error}"
        reset = self.s.reset_group(group, out)
        ts.durable = None
        self._unhold(ev.key)  # unreadable: it holds no room
        self._uncut(ts)
        out.append(CheckpointIgnored(ev.key, reason))
        self.s.recoverer.rerun([ev.key], reset, f"checkpoint of {ev.key!r} unreadable", out)
        return True

    def settled(self, out: list[Instruction]) -> None:
        """Once the compute is done, its checkpoints go (unless kept)."""
        s = self.s
        if not self.enabled or self.dropped or s.stopped or not s.done:
            return
        self.dropped = True
        if self.settings.keep:
            return
        keys = tuple(k for k, ts in s.tasks.items() if ts.durable is not None)
        if keys:
            out.append(DropCheckpoints(keys))

    def validate(self) -> None:
        assert self.written_bytes == sum(self._bytes.values()), self._bytes
        assert self._held.keys() == set(self._bytes), (self._held.keys(), self._bytes)
        assert self._dearest.keys() == set(self.exposed), (self._dearest.keys(), self.exposed)
        for k in self._bytes:  # what max_size counts: written, or being written
            assert self.s.tasks[k].durable is not None, k
        total = 0.0
        for k, cost in self.exposed.items():
            ts = self.s.tasks[k]
            assert ts.state == MEMORY and ts.durable is None and not ts.given, k
            assert cost == ts.behind > 0, k
            total += cost
        assert abs(total - self.exposure) <= 1e-6 * max(1.0, total), (total, self.exposure)
        for k, ts in self.s.tasks.items():
            assert ts.restore == (k in self.lineage), k
            if ts.restore:
                assert ts.durable in READABLE and not ts.dependencies, k
            if ts.state == WAITING and ts.restore:
                raise AssertionError(f"{k!r}: read back, yet waiting")
