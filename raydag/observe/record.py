"""The run record: what happened in one compute, as columnar tables.

A ``Recorder`` observes the state machine's transcript (every event and the
instructions it gave) and only appends it to a list while the compute runs: a
tuple per transition, so recording costs next to nothing on tiny tasks. The
transcript is replayed into tables once, when they are first asked for or written:

- ``events``: one row per thing that happened to a task or a node (schema in
  ``EVENT_COLUMNS`` and the README);
- ``stores``: every node's object store, sampled during the run;
- ``meta``: the graph, the nodes, the settings, the versions, start and end.

``last_run()`` is the most recent compute's record (kept in memory, bounded by
``raydag.record.max-tasks``); with ``raydag.record.directory`` set, each compute is
also written there as parquet, one directory per compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask.utils import key_split

from raydag import config
from raydag.core.events import (
    Aborted,
    Cancel,
    CpusChanged,
    Event,
    Fail,
    InputLost,
    Instruction,
    NodeDied,
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
)

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from raydag.runtime.stores import Sample

logger = logging.getLogger(__name__)

FORMAT = 1

# What the ``event`` column holds.
SUBMITTED = "submitted"  # the task was sent to Ray (one row per task of a fused group)
DUPLICATED = "duplicated"  # sent to Ray while another copy of it was still running
STARTED = "started"  # began on a worker (worker's clock)
FINISHED = "finished"  # its value was made (worker's clock)
SUPERSEDED = "superseded"  # finished, but another copy had already won
RETRIED = "retried"  # raised or lost its worker or node, and is sent again
FAILED = "failed"  # the compute fails with this task's error
CANCELLED = "cancelled"  # stopped in flight (failure, Ctrl-C, or an input was lost)
RELEASED = "released"  # nothing needs its value any more: dropped
LOST = "lost"  # its value was lost with a node
RECOVERY = "recovery"  # will be recomputed in recovery wave ``wave``
NODE_LOST = "node-lost"
NODE_JOINED = "node-joined"
CAPACITY = "capacity"  # the driver's task slots changed (``slots``)
ABORTED = "aborted"  # the driver gave up (Ctrl-C or an error outside the tasks)
WON = "won"  # a duplicate's value came first (``duration``: seconds it saved, an estimate)

# (name, arrow type name, meaning): the events table, in column order.
EVENT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("time", "float64", "seconds since the compute started; started/finished: the worker's clock"),
    ("seq", "int64", "the state-machine transition the row comes from (0: the start)"),
    ("event", "string", "what happened (see the README)"),
    ("key", "string", "the task's key, as str()"),
    ("category", "string", "dask.utils.key_split of the key"),
    (
        "group",
        "int64",
        "the Ray task (a copy of its fused group; each attempt and duplicate its own) it ran in",
    ),
    ("attempt", "int64", "0 for the first try, n for the n-th retry"),
    ("wave", "int64", "the recovery wave it is recomputed in, 0 if none"),
    ("node", "string", "the node it ran on (hex node id); submitted: the node raydag chose"),
    ("worker", "int64", "the worker process id"),
    ("nbytes", "int64", "size of its value (finished, last task of a group)"),
    ("input_bytes", "int64", "known sizes of the group's inputs (on the group's last task)"),
    ("duration", "float64", "seconds it ran (finished)"),
    ("duplicate", "bool", "it ran as a duplicate of a copy already running"),
    ("slots", "float64", "task slots after a capacity change"),
    ("reason", "string", "why: the error, the loss; submitted: why raydag chose the node"),
    ("run", "int64", "which compute, when records are merged (0 otherwise)"),
)

STORE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("time", "float64", "seconds since the compute started (one sampling round shares it)"),
    ("node", "string", "hex node id"),
    ("used_bytes", "int64", "bytes in the node's object store"),
    ("capacity_bytes", "int64", "the store's size"),
    ("spilled_bytes", "int64", "bytes spilled to disk since the node started (cumulative)"),
    ("num_objects", "int64", "objects in the store"),
    ("run", "int64", "which compute, when records are merged (0 otherwise)"),
)


@dataclass(frozen=True)
class Capacity:
    """Ray tasks in flight the state machine allows, after the cluster's CPUs changed."""

    slots: float


@dataclass(frozen=True)
class NodeChange:
    """A node joined or left, as the recorder saw it (kept in the transcript)."""

    node: str
    joined: bool
    cpus: float = 0.0


# Events the replay (``event_rows``) makes no row of: kept only for their instructions.
# A start note per copy and a tick per poll would be a third of a large run's transcript.
_SILENT = frozenset({TaskStarted, Tick, StoresSampled})


def _describe(error: Any) -> str:
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    return str(error)


class Recorder:
    """An observer (``observe(event, instructions)``) that keeps the transcript of one compute.

    Per transition it appends one tuple; only errors are turned into text at once
    (a kept exception would keep its traceback's frames alive), and only events that
    hint at a changed cluster ask ``nodes`` which nodes are alive.
    """

    def __init__(
        self,
        graph: Any = None,
        nodes: Mapping[str, float] | None = None,
        alive_nodes: Callable[[], Mapping[str, float]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall: float | None = None,
        capacity: Callable[[], float] | None = None,
    ) -> None:
        self.clock = clock
        self._slots = capacity  # the state machine's slots, read when the CPUs change
        self.t0 = clock()
        self.mono0 = time.monotonic()
        self.wall0 = time.time() if wall is None else wall
        self.transcript: list[tuple[float, Any, Sequence[Instruction]]] = []
        self.samples: list[Sample] = []
        self.nodes = dict(nodes or {})
        self._alive_nodes = alive_nodes
        self._end: tuple[float, float] | None = None
        self._failed = False  # a task's error failed the compute (not the driver's Ctrl-C)
        self.meta: dict[str, Any] = {
            "format": FORMAT,
            "id": time.strftime("%Y%m%d-%H%M%S-", time.localtime(self.wall0))
            + secrets.token_hex(3),
            "started_at": _iso(self.wall0),
            "graph": _graph_meta(graph) if graph is not None else {},
            "nodes_at_start": {n: {"cpus": c} for n, c in self.nodes.items()},
        }

    def __call__(self, event: Event | None, instructions: Sequence[Instruction]) -> None:
        if not instructions and type(event) in _SILENT:  # the replay reads nothing there
            return
        t = self.clock() - self.t0
        if type(event) is not TaskFinished and (
            event is not None or any(isinstance(i, Fail) for i in instructions)
        ):  # the start fails when a given value is lost and has no lineage
            event, instructions = self._unusual(t, event, instructions)
        self.transcript.append((t, event, instructions))

    def _unusual(
        self, t: float, event: Event | None, instructions: Sequence[Instruction]
    ) -> tuple[Event | None, Sequence[Instruction]]:
        if isinstance(event, TaskErred):
            event = dataclasses.replace(event, error=_describe(event.error))
        if isinstance(event, Ordered):  # a priority per key: not worth keeping
            event = Ordered({})
        if isinstance(event, CpusChanged):
            self.transcript.append((t, Capacity(self._slots() if self._slots else event.cpus), ()))
        if any(isinstance(i, Fail) for i in instructions):
            self._failed = True
            instructions = [
                dataclasses.replace(i, error=_describe(i.error)) if isinstance(i, Fail) else i
                for i in instructions
            ]
        changed = isinstance(event, CpusChanged | NodeDied | InputLost | ResultsLost) or (
            isinstance(event, TaskErred) and event.node_died
        )
        if changed and self._alive_nodes is not None:
            try:
                now = dict(self._alive_nodes())
            except Exception:  # the record must never break a compute
                logger.debug("could not list the nodes", exc_info=True)
            else:
                for n in self.nodes.keys() - now.keys():
                    self.transcript.append((t, NodeChange(n, False, self.nodes[n]), ()))
                for n in now.keys() - self.nodes.keys():
                    self.transcript.append((t, NodeChange(n, True, now[n]), ()))
                self.nodes = now
        return event, instructions

    def add_samples(self, samples: Sequence[Sample]) -> None:
        self.samples.extend(samples)

    def stop(self) -> None:
        """The compute's end, taken before the sampler's last round and other teardown."""
        if self._end is None:
            self._end = (time.time(), self.clock() - self.t0)

    def finish(self, error: BaseException | None = None) -> RunRecord:
        """The compute is over: close the metadata, hand back the (lazily built) record."""
        self.stop()
        assert self._end is not None
        self.meta["ended_at"] = _iso(self._end[0])
        self.meta["wall_seconds"] = self._end[1]
        if error is None:
            self.meta["status"] = "ok"
        elif isinstance(error, KeyboardInterrupt) and not self._failed:  # not a task's own
            self.meta["status"] = "aborted"
        else:
            self.meta["status"] = "failed"
        self.meta["error"] = None if error is None else _describe(error)
        self.meta["nodes_at_end"] = {n: {"cpus": c} for n, c in self.nodes.items()}
        self.meta["config"] = _jsonable(dask_config())
        self.meta["versions"] = versions()
        self.meta["host"] = socket.gethostname()
        self.meta["pid"] = os.getpid()
        self.meta["stores_sampled"] = bool(self.samples)
        return RunRecord(self.meta, recorder=self)

    # ---- replay -------------------------------------------------------------------

    def event_rows(self) -> list[tuple]:
        """The transcript replayed into rows, tuples in ``EVENT_COLUMNS`` order.

        One tuple per task per event: this is the record's main cost, paid only
        when the tables are wanted.
        """
        rows: list[tuple] = []
        add = rows.append
        wall0 = self.wall0
        names = _Names()  # key -> (str(key), category)
        # group id -> (keys, attempt, wave, duplicate, input bytes), while in flight
        groups: dict[int, tuple] = {}
        # A copy of a group computes the same last key (its root), so roots suffice:
        running: dict[Any, int] = {}  # root -> groups in flight making it
        done: set = set()  # roots made since they were last lost
        nbytes: dict[Any, int] = {}  # root -> size of its latest value
        recovering: dict[Any, int] = {}  # key -> recovery wave
        losers: set = set()  # copies cancelled because a duplicate won

        def stop(root: Any) -> None:
            n = running.pop(root, 1) - 1
            if n:
                running[root] = n

        def other(t: float, seq: int, event: str, node: str | None = None,
                  slots: float | None = None) -> None:  # fmt: skip
            add((t, seq, event, None, None, None, None, None, node, None, None, None, None,
                 None, slots, None, 0))  # fmt: skip

        # time, seq, event, key, category, group, attempt, wave, node, worker, nbytes,
        # input_bytes, duration, duplicate, slots, reason, run
        for seq, (t, ev, instructions) in enumerate(self.transcript):
            cls = type(ev)
            if cls is TaskFinished:
                group = ev.copy
                g = groups.pop(group, None)
                durations = ev.durations
                if g is None:  # cancelled earlier, or unknown: a copy that lost
                    keys, attempt, wave, dup, inb, kept = tuple(durations), 0, 0, False, None, ()
                else:
                    keys, attempt, wave, dup, inb, kept, _ = g
                    stop(keys[-1])
                if not keys:
                    continue
                root = keys[-1]
                kind = SUPERSEDED if (g is None or root in done) else FINISHED
                start = (ev.started - wall0) if ev.started else t - sum(durations.values())
                node, worker = ev.node, ev.worker
                get = durations.get
                # the size of each value kept, when several are (else the root's)
                sizes = dict(zip(kept, ev.sizes, strict=True)) if len(ev.sizes) == len(kept) else {}
                for k in keys[:-1]:  # fused members: no size unless kept
                    d = get(k)
                    name, cat = names[k]
                    add((start, seq, STARTED, name, cat, group, attempt, wave, node, worker,
                         None, None, None, dup, None, None, 0))  # fmt: skip
                    if d is not None:
                        start += d
                    size = sizes.get(k)
                    add((start, seq, kind, name, cat, group, attempt, wave, node, worker,
                         size, None, d, dup, None, None, 0))  # fmt: skip
                    if size is not None and kind is FINISHED:
                        nbytes[k] = size
                d = get(root)
                name, cat = names[root]
                add((start, seq, STARTED, name, cat, group, attempt, wave, node, worker,
                     None, None, None, dup, None, None, 0))  # fmt: skip
                size = sizes.get(root, ev.nbytes)
                add((start + (d or 0.0), seq, kind, name, cat, group, attempt, wave, node,
                     worker, size, inb, d, dup, None, None, 0))  # fmt: skip
                if kind is FINISHED:
                    done.add(root)
                    nbytes[root] = size
                    if recovering:
                        for k in keys:
                            recovering.pop(k, None)
            elif cls is NodeChange:
                other(t, seq, NODE_JOINED if ev.joined else NODE_LOST, ev.node, ev.cpus)
            elif cls is TaskErred:
                g = groups.pop(ev.copy, None)
                if g is not None:
                    stop(g[0][-1])
                    again = [i for i in instructions if type(i) is Submit and i.group == g[6]]
                    if again:
                        why = ("node lost: " if ev.node_died else "") + str(ev.error)
                        add((t, seq, RETRIED, *names[ev.key], ev.copy, again[0].attempt, g[2],
                             None, None, None, None, None, g[3], None, why, 0))  # fmt: skip
            elif cls is Capacity:
                other(t, seq, CAPACITY, slots=ev.slots)
            elif cls is Aborted:
                other(t, seq, ABORTED)

            for ins in instructions:
                icls = type(ins)
                if icls is Release:
                    name, cat = names[ins.key]
                    add((t, seq, RELEASED, name, cat, None, None, None, None, None, None,
                         None, None, None, None, None, 0))  # fmt: skip
                elif icls is Submit:
                    keys = ins.keys
                    root = keys[-1]
                    dup = root in running
                    running[root] = running.get(root, 0) + 1
                    wave = max(recovering.get(k, 0) for k in keys) if recovering else 0
                    inb = sum(nbytes.get(k) or 0 for k in ins.inputs)
                    group, attempt = ins.copy, ins.attempt
                    groups[group] = (keys, attempt, wave, dup, inb, ins.kept, ins.group)
                    kind = DUPLICATED if dup else SUBMITTED
                    # where it was sent: a duplicate's node, or where placement put it
                    node, why = ins.node, ins.placed or None
                    for k in keys:
                        name, cat = names[k]
                        add((t, seq, kind, name, cat, group, attempt, wave, node, None, None,
                             None, None, dup, None, why, 0))  # fmt: skip
                elif icls is Cancel:
                    g = groups.pop(ins.copy, None)
                    if g is not None:
                        stop(g[0][-1])
                        why = "superseded" if ins.copy in losers else None
                        for k in g[0]:
                            add((t, seq, CANCELLED, *names[k], ins.copy, g[1], g[2], None, None,
                                 None, None, None, g[3], None, why, 0))  # fmt: skip
                elif icls is Won:
                    losers.update(ins.losers)
                    add((t, seq, WON, *names[ins.key], ins.copy, None, None, None, None, None,
                         None, ins.saved, True, None, ins.reason, 0))  # fmt: skip
                elif icls is Fail:
                    add((t, seq, FAILED, *names[ins.key], None, None, None, None, None, None,
                         None, None, None, None, str(ins.error), 0))  # fmt: skip
                elif icls is Recover:
                    for k in ins.lost:
                        done.discard(k)
                        add((t, seq, LOST, *names[k], None, None, ins.wave, None, None,
                             nbytes.get(k), None, None, None, None, ins.reason, 0))  # fmt: skip
                    for k in ins.recompute:
                        done.discard(k)
                        recovering[k] = ins.wave
                        add((t, seq, RECOVERY, *names[k], None, None, ins.wave, None, None, None,
                             None, None, None, None, ins.reason, 0))  # fmt: skip
        return rows

    def events_table(self) -> pa.Table:
        import pyarrow as pa
        import pyarrow.compute as pc

        with _no_gc():  # tens of thousands of fresh tuples, no cycles: spare the collector
            rows = self.event_rows()
            # Arrow converts the tuples itself, far faster than column lists in Python.
            table = pa.Table.from_struct_array(pa.array(rows, type=pa.struct(events_schema())))
            del rows
        if table.num_rows:
            table = table.take(
                pc.sort_indices(table, [("time", "ascending"), ("seq", "ascending")])
            )
        return table

    def stores_table(self) -> pa.Table:
        import pyarrow as pa

        m0 = self.mono0
        s = self.samples
        cols = [
            [x.time - m0 for x in s],
            [x.node for x in s],
            [x.used_bytes for x in s],
            [x.capacity_bytes for x in s],
            [x.spilled_bytes for x in s],
            [x.num_objects for x in s],
            [0] * len(s),
        ]
        arrays = [
            pa.array(c, type=_arrow_type(t))
            for c, (_, t, _) in zip(cols, STORE_COLUMNS, strict=True)
        ]
        return pa.Table.from_arrays(arrays, schema=stores_schema())


class _Names(dict):
    """key -> (its string, its category), each computed once per key."""

    def __missing__(self, key: Any) -> tuple[str | None, str | None]:
        value = self[key] = (None, None) if key is None else (str(key), key_split(key))
        return value


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    """Nullable integer and boolean columns as pandas' nullable dtypes, not floats."""
    import pandas as pd
    import pyarrow as pa

    mapping = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
    return table.to_pandas(types_mapper=mapping.get)


def _arrow_type(name: str) -> pa.DataType:
    import pyarrow as pa

    return {
        "float64": pa.float64(),
        "int64": pa.int64(),
        "string": pa.string(),
        "bool": pa.bool_(),
    }[name]


def events_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema([(n, _arrow_type(t)) for n, t, _ in EVENT_COLUMNS])


def stores_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema([(n, _arrow_type(t)) for n, t, _ in STORE_COLUMNS])


class RunRecord:
    """One compute's record (or several merged): ``events``, ``stores`` and ``meta``.

    Tables are built from the recorder's transcript on first use, so a record that
    is never looked at costs only the transcript.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        events: pa.Table | None = None,
        stores: pa.Table | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.meta = meta
        self._events = events
        self._stores = stores
        self._recorder = recorder
        self._lock = threading.Lock()

    def _build(self) -> None:
        with self._lock:
            if self._events is None:
                assert self._recorder is not None
                self._events = self._recorder.events_table()
                self._stores = self._recorder.stores_table()
                self._recorder = None  # the transcript is not needed any more

    @property
    def events_table(self) -> pa.Table:
        self._build()
        assert self._events is not None
        return self._events

    @property
    def stores_table(self) -> pa.Table:
        self._build()
        assert self._stores is not None
        return self._stores

    @property
    def events(self) -> pd.DataFrame:
        """One row per event (columns: ``EVENT_COLUMNS``; integers stay integers)."""
        return _to_pandas(self.events_table)

    @property
    def stores(self) -> pd.DataFrame:
        """Object-store samples per node (columns: ``STORE_COLUMNS``)."""
        return _to_pandas(self.stores_table)

    @property
    def tasks(self) -> pd.DataFrame:
        """One row per task execution that finished: start, end, where, how big."""
        ev = self.events
        done = ev[ev.event.isin([FINISHED, SUPERSEDED])].copy()
        done["end"] = done["time"]
        done["start"] = done["end"] - done["duration"].fillna(0.0)
        done["won"] = done["event"] == FINISHED
        done["duplicate"] = done["duplicate"].fillna(False).astype(bool)
        for c in ("group", "attempt", "wave", "run"):
            done[c] = done[c].fillna(0).astype("int64")
        cols = ["run", "key", "category", "group", "attempt", "wave", "duplicate", "won"]
        cols += ["node", "worker", "start", "end", "duration", "nbytes", "input_bytes"]
        return done[cols].reset_index(drop=True)

    def summary(self) -> dict[str, Any]:
        """The numbers a report leads with (computed in Arrow: cheap enough to write each run)."""
        import pyarrow.compute as pc

        ev = self.events_table.select(
            ["event", "run", "group", "wave", "duplicate", "nbytes", "duration"]
        )
        counts = pc.value_counts(ev["event"])
        n = dict(zip(counts.field(0).to_pylist(), counts.field(1).to_pylist(), strict=True))

        def rows(event: str) -> pa.Table:
            return ev.filter(pc.equal(ev["event"], event))

        def distinct(table: pa.Table, columns: list[str]) -> int:
            return table.select(columns).group_by(columns).aggregate([]).num_rows

        finished = rows(FINISHED)
        won = finished.filter(pc.fill_null(finished["duplicate"], False))
        st = self.stores_table
        spilled = peak = 0
        if st.num_rows:
            per_node = st.group_by(["run", "node"]).aggregate(
                [("spilled_bytes", "max"), ("spilled_bytes", "min")]
            )
            grown = pc.subtract(per_node["spilled_bytes_max"], per_node["spilled_bytes_min"])
            spilled = pc.sum(grown).as_py() or 0
            rounds = st.group_by(["run", "time"]).aggregate([("used_bytes", "sum")])
            peak = pc.max(rounds["used_bytes_sum"]).as_py() or 0
        runs = self.meta.get("runs", [self.meta])
        return {
            "status": _worst(r.get("status", "ok") for r in runs),
            "computes": len(runs),
            "makespan_s": float(self.meta.get("wall_seconds") or 0.0),
            "tasks": int(sum(r.get("graph", {}).get("tasks", 0) for r in runs)),
            "executions": finished.num_rows,
            "retries": n.get(RETRIED, 0),
            "failures": n.get(FAILED, 0),
            "cancelled": n.get(CANCELLED, 0),
            "recovery_waves": distinct(rows(RECOVERY), ["run", "wave"]),
            "recomputed": n.get(RECOVERY, 0),
            "lost": n.get(LOST, 0),
            "nodes_lost": n.get(NODE_LOST, 0),
            "duplicates": distinct(rows(DUPLICATED), ["run", "group"]),
            "duplicates_won": distinct(won, ["run", "group"]),
            "time_saved_s": float(pc.sum(rows(WON)["duration"]).as_py() or 0.0),
            "bytes_made": int(pc.sum(finished["nbytes"]).as_py() or 0),
            "bytes_spilled": int(spilled),
            "peak_store_bytes": int(peak),
        }

    # ---- files --------------------------------------------------------------------

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``events.parquet``, ``stores.parquet`` and ``run.json`` into ``directory``."""
        import pyarrow.parquet as pq

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        # zstd: a third smaller than snappy, as fast; dictionaries only where values repeat
        repeat = ["event", "category", "node", "reason"]
        pq.write_table(
            self.events_table, path / "events.parquet", compression="zstd", use_dictionary=repeat
        )
        pq.write_table(
            self.stores_table, path / "stores.parquet", compression="zstd", use_dictionary=["node"]
        )
        meta = dict(self.meta)
        try:
            meta["summary"] = self.summary()
        except Exception:  # a summary must not cost the record itself
            logger.debug("no summary for the run record", exc_info=True)
        with open(path / "run.json", "w") as f:
            json.dump(_jsonable(meta), f, indent=2)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> RunRecord:
        """A record written by ``write`` (or by a compute with ``raydag.record.directory``)."""
        import pyarrow.parquet as pq

        path = Path(directory)
        if not (path / "events.parquet").exists():
            raise FileNotFoundError(f"{path} is not a raydag run record (no events.parquet)")
        meta = json.loads((path / "run.json").read_text()) if (path / "run.json").exists() else {}
        events = pq.read_table(path / "events.parquet")
        stores_path = path / "stores.parquet"
        stores = (
            pq.read_table(stores_path) if stores_path.exists() else stores_schema().empty_table()
        )
        return cls(meta, events=events, stores=stores)

    @classmethod
    def merge(cls, records: Sequence[RunRecord]) -> RunRecord:
        """Several computes as one record, on one clock: ``run`` tells them apart."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if len(records) == 1:
            return records[0]
        if not records:
            meta = {"format": FORMAT, "runs": [], "wall_seconds": 0.0}
            return cls(meta, events_schema().empty_table(), stores_schema().empty_table())
        starts = [_epoch(r.meta.get("started_at")) for r in records]
        first = min(starts)
        events, stores, metas = [], [], []
        end = first
        for i, (r, s) in enumerate(zip(records, starts, strict=True)):
            off = s - first
            end = max(end, s + float(r.meta.get("wall_seconds") or 0.0))
            for table, out in ((r.events_table, events), (r.stores_table, stores)):
                table = table.set_column(0, "time", pc.add(table["time"], off))
                idx = table.schema.get_field_index("run")
                table = table.set_column(idx, "run", pa.array([i] * len(table), pa.int64()))
                out.append(table)
            metas.append({**r.meta, "offset_seconds": off})
        meta = {
            "format": FORMAT,
            "started_at": _iso(first),
            "wall_seconds": end - first,
            "runs": metas,
        }
        return cls(meta, pa.concat_tables(events), pa.concat_tables(stores))

    def report(self, filename: str | os.PathLike[str], title: str | None = None) -> Path:
        """Write the HTML report of this record (see ``raydag.report``)."""
        from raydag.observe import report

        return report.write_report(self, filename, title=title)


def load(directory: str | os.PathLike[str]) -> RunRecord:
    """``RunRecord.load``: a record written to ``directory``."""
    return RunRecord.load(directory)


def category_runtimes(record: RunRecord) -> dict[str, list[float]]:
    """Each category's runtimes in a record (tasks that finished): to seed speculation."""
    import pyarrow.compute as pc

    ev = record.events_table.select(["event", "category", "duration"])
    done = ev.filter(pc.and_(pc.equal(ev["event"], FINISHED), pc.is_valid(ev["duration"])))
    out: dict[str, list[float]] = {}
    for cat, d in zip(done["category"].to_pylist(), done["duration"].to_pylist(), strict=True):
        out.setdefault(cat, []).append(d)
    return out


# ---- which computes are recorded ----------------------------------------------------

_last: RunRecord | None = None
_collectors: list[list[RunRecord]] = []
_lock = threading.Lock()


def last_run() -> RunRecord | None:
    """The most recent compute's record, or ``None`` (none yet, recording off, too big)."""
    return _last


@contextlib.contextmanager
def collecting() -> Iterator[list[RunRecord]]:
    """Record every compute in the block (whatever the settings) into the yielded list."""
    runs: list[RunRecord] = []
    with _lock:
        _collectors.append(runs)
    try:
        yield runs
    finally:
        with _lock:
            _collectors.remove(runs)


def wanted(n_tasks: int) -> tuple[bool, bool]:
    """(record this compute?, sample the stores for it?) from the settings and collectors."""
    global _last
    if _collectors:
        return True, True
    if not config.get("record.enabled"):
        _last = None
        return False, False
    if config.get("record.directory"):
        return True, True
    limit = config.get("record.max-tasks")
    if limit is not None and n_tasks > int(limit):
        logger.info(
            "raydag: not keeping a record of this compute: %d tasks > raydag.record.max-tasks",
            n_tasks,
        )
        _last = None
        return False, False
    return True, False


def finished(record: RunRecord) -> None:
    """Keep ``record`` as the last run, hand it to collectors, write it if configured."""
    global _last
    _last = record
    with _lock:
        for runs in _collectors:
            runs.append(record)
    directory = config.get("record.directory")
    if directory and config.get("record.enabled"):
        path = Path(os.path.expanduser(str(directory))) / record.meta["id"]
        record.meta["directory"] = str(path)
        global _writer
        with _lock:
            if _writer is None:
                _writer = ThreadPoolExecutor(1, thread_name_prefix="raydag-record")
            _writing.append(_writer.submit(_write, record, path))


# Records are written by one thread, in order, after their compute returned: building
# the tables costs about 10 us per task, which a compute of tiny tasks would feel. The
# interpreter waits for that thread at exit; ``flush`` waits for it sooner.
_writer: ThreadPoolExecutor | None = None
_writing: list[Future] = []


def _write(record: RunRecord, path: Path) -> None:
    try:
        record.write(path)
    except Exception:
        logger.exception("raydag: could not write the run record to %s", path)
    else:
        logger.info("raydag: wrote the run record to %s", path)


def flush(timeout: float | None = None) -> None:
    """Wait until every record asked for so far is written (see ``raydag.record.directory``)."""
    with _lock:
        pending, _writing[:] = list(_writing), []
    futures_wait(pending, timeout=timeout)


# ---- metadata -----------------------------------------------------------------------


def _graph_meta(graph: Any) -> dict[str, Any]:
    outputs = list(getattr(graph, "outputs", ()))
    return {
        "tasks": len(graph),
        "given": len(getattr(graph, "external", ())),
        "outputs": len(outputs),
        "output_keys": [str(k) for k in outputs[:100]],
    }


def dask_config() -> Any:
    import dask.config

    return dask.config.get("raydag", default={})


def versions() -> dict[str, str]:
    import dask
    import ray

    import raydag

    return {
        "python": platform.python_version(),
        "raydag": raydag.__version__,
        "ray": ray.__version__,
        "dask": dask.__version__,
    }


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def _epoch(iso: str | None) -> float:
    return datetime.datetime.fromisoformat(iso).timestamp() if iso else 0.0


def _jsonable(x: Any) -> Any:
    """``x`` as JSON holds it: mappings with string keys, lists, and ``str`` of what
    else. By ``json`` in C where it can (0.04 ms for raydag's config, not 0.11)."""
    try:
        return json.loads(json.dumps(x, default=_plain))
    except (TypeError, ValueError):  # keys JSON will not take
        return _walked(x)


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return dict(x)
    return list(x) if isinstance(x, set | frozenset) else str(x)


def _walked(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _walked(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [_walked(v) for v in x]
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return str(x)


def _worst(statuses: Any) -> str:
    order = {"ok": 0, "aborted": 1, "failed": 2}
    return max(statuses, key=lambda s: order.get(s, 3), default="ok")


@contextlib.contextmanager
def performance_report(
    filename: str | os.PathLike[str] = "raydag-report.html", title: str | None = None
) -> Iterator[list[RunRecord]]:
    """Record every raydag compute in the block; write their report on leaving it.

    Like ``distributed.performance_report``. The report is written even when the
    block raises: that is when it is wanted most. Yields the list the records are
    collected into.
    """
    with collecting() as runs:
        try:
            yield runs
        finally:
            from raydag.observe.report import write_report

            try:
                write_report(
                    RunRecord.merge(runs), filename, title=title or "raydag performance report"
                )
            except Exception:
                logger.exception("raydag: could not write the report to %s", filename)
