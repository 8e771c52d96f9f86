"""What the state machine knows, one record per thing: a task, a node, a category, a group.

Every fact about a key (its state, who waits on it, where its value lives and how big
it is, which group runs it) is on its ``TaskState``; every fact about a node on its
``NodeState``; every runtime and size learned about a category (``key_split`` of the
key) on its ``Category``. The policies read and write these records, never a dict of
their own keyed the same way.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

Key = Hashable

WAITING = "waiting"
READY = "ready"
PROCESSING = "processing"
MEMORY = "memory"
RELEASED = "released"


class TaskState:
    """One key of the graph."""

    __slots__ = (
        "key",
        "state",
        "dependencies",
        "dependents",
        "priority",
        "category",
        "missing",
        "waiters",
        "node",
        "nbytes",
        "group",
        "recovering",
        "output",
        "given",
        "fixed",
        "resources",
        "remote_args",
        "pinned",
        "retries",
        "source",
        "inline",
        "durable",
        "behind",
        "restore",
    )

    def __init__(
        self,
        key: Key,
        dependencies: frozenset,
        priority: int,
        category: str,
        dependents: set | None = None,
    ) -> None:
        self.key = key
        self.state = RELEASED
        self.dependencies = dependencies  # keys it reads
        self.dependents: set = set() if dependents is None else dependents  # keys that read it
        self.priority = priority  # dask.order's: lower runs first
        self.category = category
        self.missing = 0  # dependencies not in memory (while waiting)
        self.waiters = 0  # dependents not finished (while in memory)
        self.node: str | None = None  # where its value lives (None: unknown, or inline)
        self.nbytes: int | None = None  # its value's size, as measured
        self.group: int | None = None  # the group running it (processing)
        self.recovering = False  # recomputed in a recovery wave, not finished since
        self.output = False  # requested by the caller: held until the end
        self.given = False  # its value came from outside (a persisted result, a ref)
        self.fixed = False  # given, and nothing here can recompute it
        self.resources: dict | None = None  # resources=, ray_remote_args' (core.options)
        self.remote_args: dict | None = None  # other Ray task options, passed through
        self.pinned = False  # its options say where it runs: not placed, not duplicated
        self.retries = 0  # dask.annotate(retries=...): tries after a user error
        self.source = False  # reads nothing but given values
        self.inline = False  # its value lives in the driver's memory: no death loses it
        # checkpoints (raydag.core.checkpoints): its checkpoint's state (None: none),
        # the seconds of work a loss of its value would redo, and whether it is read
        # back from its checkpoint (its lineage cut) instead of computed
        self.durable: str | None = None
        self.behind = 0.0
        self.restore = False

    def __repr__(self) -> str:
        return f"<TaskState {self.key!r} {self.state}>"


@dataclass
class NodeState:
    """One node of the cluster, as the state machine has heard of it."""

    id: str
    alive: bool = True
    # Speculation's view of its free CPUs: the latest Tick's, plus what a finished
    # copy freed and less what a started copy or a duplicate took since.
    free: float = 0.0
    # Placement's: the latest store sample's, less what was placed there since.
    idle: float = 0.0
    store: tuple[int, int] | None = None  # (used, capacity) bytes, the latest sample
    full: bool = False  # its store is above the high-water mark
    crowded: bool = False  # full, or much fuller than the emptiest
    cpus: float = 0.0  # the most CPUs a Tick saw free on it (what a slow node withholds)
    # since when speculation takes it for slow: no first copies go there till looked
    # at again (``Speculation.block_slow_node`` later)
    slow_since: float | None = None
    held: set = field(default_factory=set)  # keys whose values it holds (in memory)


class Runtimes:
    """A category's runtimes: count and total (the mean), the latest samples (quantiles)."""

    KEEP = 1000

    __slots__ = ("count", "total", "samples", "_next", "_sorted")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.samples: list[float] = []
        self._next = 0
        self._sorted: list[float] | None = None  # the samples sorted, until the next add

    def add(self, seconds: float) -> None:
        self._sorted = None
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
        s = self._sorted
        if s is None:  # asked for every copy in flight, per event: sorted once
            s = self._sorted = sorted(self.samples)
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Category:
    """What is learned of one category (``key_split`` of its keys) as its tasks finish."""

    __slots__ = (
        "name", "count", "total", "runtimes", "made", "made_bytes", "long", "runs_on",
        "processing",
    )  # fmt: skip

    def __init__(self, name: str) -> None:
        self.name = name
        # measured runtimes in this compute: the mean that fusion and costs use
        self.count = 0
        self.total = 0.0
        # for speculation: seeded from an earlier run, then learned (None: not kept)
        self.runtimes: Runtimes | None = None
        # values made and their bytes: placement's expected output size
        self.made = 0
        self.made_bytes = 0
        self.long = False  # known long: its ready tasks also wait in the long heap
        # speculation's: per node (``None``: seeded from an earlier run), its latest lone
        # runs as (seconds, finished); a run not finished (a loser) lasted at least that
        self.runs_on: dict[str | None, list[tuple[float, bool]]] = {}
        self.processing = 0  # its keys in groups in flight (fusion's probes count them)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class Copy:
    """One Ray task running a group: where and since when, once it said so."""

    id: int
    node: str | None = None
    started: float | None = None
    duplicate: bool = False
    # Ray chooses its node (sent with none, or free to spill): until it starts, the
    # state cannot say which node's CPU it takes
    ray_places: bool = False


@dataclass
class Group:
    """Keys that run as one Ray task; one or more copies of it may be in flight."""

    id: int
    keys: tuple
    members: frozenset
    inputs: tuple
    cost: float
    attempt: int = 0
    copies: dict = field(default_factory=dict)  # copy id -> Copy
    # when a copy died with its node while a duplicate ran on (for ``Won.saved``)
    spared_at: float | None = None
    # duplicates started, less copies lost with their node while another ran on:
    # capped by Speculation.max_copies (``Speculator.spared``)
    duplicated: int = 0
    returns: tuple = ()  # the kept values when several (bundle pieces, consumers)
    # Consumers run in the task of the key they read, last in ``keys``.
    consumers: tuple = ()

    @property
    def kept(self) -> tuple:
        return self.returns or (self.keys[-1],)

    @property
    def lead(self) -> Key:
        """The key the group runs for: its root, or the key its consumers read."""
        return self.keys[-1 - len(self.consumers)]

    @property
    def first(self) -> Copy | None:
        """The copy that is no duplicate, while it runs."""
        return next((c for c in self.copies.values() if not c.duplicate), None)
