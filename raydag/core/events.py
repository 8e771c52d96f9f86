"""The state machine's vocabulary: events (facts the Ray layer reports) and instructions
(decisions it carries out).

An event says what happened and nothing about what it means: a copy finished, raised,
lost its worker process or its node; a node died; the cluster's CPUs changed; Ray could
not fetch an input. Every judgement (is that value lost? is that node to be taken for
dead? retry or fail? duplicate? where to place?) is the state machine's, and comes back
as instructions. Each Ray task that runs a group is a *copy* with an id of its own: a
retry, a duplicate and a recomputation are new copies, so a late report of an old copy
is recognised by its id alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

Key = Hashable


class WorkerDiedError(RuntimeError):
    """A task kept killing the worker process running it; retries are exhausted."""


# ---- instructions (state machine -> Ray layer) ----------------------------------


@dataclass(frozen=True, slots=True)
class Submit:
    """Run ``keys`` (topological order) as one Ray task, copy ``copy`` of ``group``.

    ``kept``: the keys whose values leave the Ray task, each its own Ray object: the
    last key's alone, or ``returns`` (a shuffle map's pieces, a producer's consumers).
    """

    copy: int
    group: int
    keys: tuple
    inputs: tuple
    priority: int
    resources: Mapping[str, float] | None
    attempt: int = 0
    # Report the start (``TaskStarted``): where a copy runs decides what a death loses
    # (a running reader holds its inputs) and where a duplicate may go. ``notify_after``:
    # only once the copy has run that long (one that ends sooner reports its start with
    # its end, ``TaskFinished``).
    notify: bool = False
    notify_after: float = 0.0
    # A speculative duplicate, to run on ``node`` and nowhere else.
    duplicate: bool = False
    node: str | None = None
    # ``node`` is a preference, not a must: if that node is gone, Ray runs the task
    # elsewhere. ``placed``: why it was chosen. ``spill``: if that node has no CPU free
    # when Ray schedules it, elsewhere at once (storage-aware placement: better there
    # than waiting); not ``spill``: wait for it (speculation chose it over a slower
    # node, and its CPU, free by the state's count, is about to be: the last task
    # spilled at once would go to the one CPU Ray sees free, the slow node's).
    soft: bool = False
    spill: bool = True
    placed: str = ""
    returns: tuple = ()
    # Keys read back from their checkpoints instead of computed (raydag.core.checkpoints).
    restore: tuple = ()
    # Ray task options besides resources (``ray_remote_args``: ``scheduling_strategy``,
    # ``runtime_env``, ...), for ``.options()`` as given; one object per distinct dict.
    remote_args: Mapping[str, Any] | None = None

    @property
    def root(self) -> Key:
        return self.keys[-1]

    @property
    def kept(self) -> tuple:
        return self.returns or (self.keys[-1],)


@dataclass(frozen=True, slots=True)
class Release:
    """Nothing needs this key's value any more: drop it."""

    key: Key


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop this copy; its result, if any arrives, is ignored.

    ``node``: where it runs, when known and alive: a forced cancel may take its worker
    process down there, and the Ray layer starts a spare one.
    """

    copy: int
    node: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Fail:
    """The compute has failed: raise ``error``, raised by ``key``."""

    key: Key
    error: Any


@dataclass(frozen=True, slots=True)
class Recover:
    """One recovery wave: ``lost`` results are recomputed, with ``recompute``, at once.

    The Ray layer drops its refs of the keys to recompute; the Submits follow.
    """

    wave: int
    lost: tuple
    recompute: tuple
    reason: str = ""


@dataclass(frozen=True, slots=True)
class NodeTakenDead:
    """The state machine takes ``node`` for dead (Ray lost a value it held, before
    the cluster said so): nothing more is sent there, and what it held is lost."""

    node: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Won:
    """A duplicate's result came first; ``losers`` (copies) are cancelled.

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


# ---- checkpoints (raydag.core.checkpoints) --------------------------------------


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Write ``key``'s value (in memory) to the checkpoint store, beside its readers."""

    key: Key


@dataclass(frozen=True, slots=True)
class DropCheckpoints:
    """The compute is done: remove these keys' checkpoints (written, being written or
    found at the start), once the writes in flight have ended."""

    keys: tuple


@dataclass(frozen=True, slots=True)
class RemoveCheckpoints:
    """Remove these keys' checkpoints now, mid-compute: superseded (every reader of each
    is checkpointed: no lineage walk reaches them) or displaced (under ``max-size``, by
    a value whose checkpoint protects more)."""

    keys: tuple


@dataclass(frozen=True, slots=True)
class CheckpointsOff:
    """No more checkpoints are written in this compute (the store failed a write)."""

    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointIgnored:
    """``key``'s checkpoint could not be read back: its value is computed instead."""

    key: Key
    reason: str


Instruction = (
    Submit
    | Release
    | Cancel
    | Fail
    | Recover
    | NodeTakenDead
    | Won
    | Checkpoint
    | DropCheckpoints
    | RemoveCheckpoints
    | CheckpointsOff
    | CheckpointIgnored
)


# ---- events (Ray layer -> state machine) ----------------------------------------


@dataclass(frozen=True, slots=True)
class TaskFinished:
    """Copy ``copy`` ran to its end on ``node``; ``durations`` of each key it ran."""

    copy: int
    durations: Mapping[Key, float] = field(default_factory=dict)
    nbytes: int = 0
    node: str | None = None
    # For the run record: when the copy started on its worker (wall clock, seconds
    # since the epoch) and the worker's process id.
    started: float = 0.0
    worker: int = 0
    # The size of each kept value (``Submit.kept``), when the copy keeps several.
    sizes: tuple = ()


@dataclass(frozen=True, slots=True)
class TaskErred:
    """``key`` of copy ``copy`` raised ``error``, or the copy could not run.

    ``worker_died``: the worker process died under it (a crash, out of memory);
    ``node_died``: its node died. Neither: the task's own error.
    """

    copy: int
    key: Key
    error: Any
    worker_died: bool = False
    node_died: bool = False


@dataclass(frozen=True, slots=True)
class TaskStarted:
    """Copy ``copy`` began on ``node`` at ``started`` (wall clock, the worker's)."""

    copy: int
    node: str
    started: float


@dataclass(frozen=True, slots=True)
class InputLost:
    """Copy ``copy`` could not fetch inputs ``keys``: Ray says their values are gone."""

    copy: int
    keys: tuple
    reason: str = ""


@dataclass(frozen=True, slots=True)
class NodeDied:
    """The cluster reports ``node`` dead."""

    node: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ResultsLost:
    """Ray reports these values gone (given values whose node raydag never knew)."""

    keys: tuple
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CpusChanged:
    """The cluster's alive nodes now have ``cpus`` CPUs in all."""

    cpus: float


@dataclass(frozen=True, slots=True)
class Aborted:
    """The driver gives up (Ctrl-C): cancel everything, release everything."""


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passes: ``now`` (wall clock); ``idle``: each alive node's free CPUs now."""

    now: float
    idle: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoresSampled:
    """Every alive node's object store (``(used, capacity)`` bytes) and free CPUs, now.

    ``used`` counts what the store must keep (pinned copies), not cached copies of
    values held elsewhere, which Ray evicts when it needs the room.
    """

    stores: Mapping[str, tuple[int, int]]
    idle: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ordered:
    """The graph's priorities (``dask.order``'s, lower runs first: ``Graph.order``),
    computed while the compute ran on a provisional order (``core.graph.depth_first``)."""

    priorities: Mapping[Key, int]


@dataclass(frozen=True, slots=True)
class CheckpointWritten:
    """``key``'s checkpoint is written whole (``nbytes`` in the store)."""

    key: Key
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class CheckpointFailed:
    """Writing ``key``'s checkpoint failed with ``error``: the store refused it (a
    read-only or full store), or, ``lost``, the write never reached the store (its
    worker or node died, or the value it was writing was lost with its node)."""

    key: Key
    error: Any = None
    lost: bool = False


Event = (
    TaskFinished
    | TaskErred
    | TaskStarted
    | InputLost
    | NodeDied
    | ResultsLost
    | CpusChanged
    | Aborted
    | Tick
    | StoresSampled
    | Ordered
    | CheckpointWritten
    | CheckpointFailed
)
