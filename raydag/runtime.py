"""The Ray layer: carry out the state machine's instructions and report what Ray did.

It holds the only references to results (``ObjectRef``s), so dropping one on a
``Release`` is what frees the object. It decides nothing: ordering, fusion, release,
retries and failure all come from ``raydag.state``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions as rex
from dask._task_spec import TaskRef
from dask.callbacks import local_callbacks, unpack_callbacks
from dask.sizeof import sizeof

from raydag import config, progress, record, shuffle
from raydag.graph import Graph
from raydag.state import (
    Aborted,
    Cancel,
    CapacityChanged,
    Event,
    Fail,
    Fusion,
    Instruction,
    Placement,
    Recover,
    Release,
    ResultsLost,
    Speculation,
    State,
    StoresSampled,
    Submit,
    TaskErred,
    TaskFinished,
    TaskStarted,
    Tick,
    Won,
)
from raydag.stores import StoreSampler, shared_reader

logger = logging.getLogger(__name__)
Key = Hashable

# How a Ray task can fail without the user's code raising, by what it means for raydag.
NODE_DIED = (rex.NodeDiedError, rex.LocalRayletDiedError)  # retried, not counted
WORKER_DIED = (rex.WorkerCrashedError, rex.OutOfMemoryError, rex.RaySystemError)  # counted
INPUT_LOST = (rex.ObjectLostError, rex.ObjectFetchTimedOutError)  # recover the inputs
# Task returns below Ray's max_direct_call_object_size (default 100 KiB) are inlined
# into the owner's (the driver's) memory: a node's death cannot lose them.
INLINED = 100 * 1024


# ---- the cluster ------------------------------------------------------------------


def connect() -> None:
    """Use the initialised Ray or ``RAY_ADDRESS``; otherwise start an embedded local Ray."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    period = config.seconds("local-ray.free-objects-period")
    ray.init(
        address="local",
        num_cpus=config.get("local-ray.num-cpus"),
        object_store_memory=config.get("local-ray.object-store-memory"),
        include_dashboard=config.get("local-ray.include-dashboard"),
        logging_level=logging.WARNING,
        _system_config={"free_objects_period_milliseconds": max(1, int(period * 1000))},
    )
    logger.info("started an embedded local Ray: %s", ray.cluster_resources())


def alive_nodes() -> dict[str, float]:
    """Alive node ids and their CPUs (``ray.nodes()`` costs about 0.3 ms)."""
    return {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}


def slots(nodes: Mapping[str, float]) -> float:
    """Ray tasks to keep in flight: sized from the cluster's CPUs."""
    per_cpu = float(config.get("scheduling.in-flight-per-cpu"))
    return max(1.0, round(sum(nodes.values()) * per_cpu))


# ---- what runs on a worker ----------------------------------------------------------


@dataclass
class Outcome:
    """What a group's Ray task tells the driver, apart from the value itself."""

    durations: list[float]
    nbytes: int = 0
    node: str = ""
    pid: int = 0
    started: float = 0.0
    error: bytes | None = None
    error_key: Any = None
    sizes: list[int] | None = None  # of each kept value, when a group keeps several


def run_group(
    nodes: list, input_keys: tuple, notify: Any, *inputs: Any, returns: tuple = ()
) -> tuple[Any, ...]:
    """Run fused dask tasks in order; return the kept values, then an Outcome.

    ``returns``: the keys whose values to keep, each its own Ray object (a shuffle's
    pieces: the Ray task has ``len(returns) + 1`` returns); empty: the last key's.
    ``notify``: ``(inbox, run, tag)`` to say where and when it started (see ``_Inbox``).
    """
    values, outcome = _run_nodes(nodes, input_keys, notify, inputs)
    kept = returns or (nodes[-1].key,)
    if outcome.error is not None:
        return (*[None] * len(kept), outcome)
    results = [values[k] for k in kept]
    outcome.sizes = [sizeof(r) for r in results]
    outcome.nbytes = sum(outcome.sizes)
    return (*results, outcome)


def _run_nodes(nodes: list, input_keys: tuple, notify: Any, inputs: tuple) -> tuple[dict, Outcome]:
    started = time.time()
    if notify is not None:
        inbox, run, tag = notify
        inbox.started.remote(run, tag, ray.get_runtime_context().get_node_id(), started)
    values = dict(zip(input_keys, inputs, strict=True))
    durations = []
    node = None
    try:
        for node in nodes:
            t0 = time.perf_counter()
            values[node.key] = node(values)
            durations.append(time.perf_counter() - t0)
    except Exception as e:  # a user's error: ship it back whole, do not let Ray retry
        return values, Outcome(durations, error=pack_exception(e), error_key=node.key)
    ctx = ray.get_runtime_context()
    return values, Outcome(durations, 0, ctx.get_node_id(), os.getpid(), started)


def _nothing() -> None:
    return None


_spare_worker = ray.remote(num_cpus=0, max_retries=0)(_nothing)


# raydag retries and recovers tasks itself, from its own lineage (see the README):
# Ray's retries would re-run lost work one object at a time, behind raydag's back.
_remote = ray.remote(num_returns=2, max_retries=0)(run_group)


class _Inbox:
    """Where tasks not known to be cheap say where and when they started; and where
    the driver's cancels go out from (see ``cancel``).

    Ray tells the driver nothing of a task until it ends (its state API needs the
    dashboard), yet a duplicate must avoid the original's node, a task's runtime
    counts from its real start, not from its submission (it may wait for a worker
    process), and a running task holds its inputs when the node that made them dies.
    The task's one-way call costs it about a millisecond. The driver keeps one
    ``drain`` in flight, among the refs it waits on: it returns as soon as a note
    arrives (or after ``hold`` seconds), so a start is heard at once, not at the
    next poll.
    """

    def __init__(self) -> None:
        self.notes: list[tuple] = []
        self.waiting: dict[int, Any] = {}  # run -> the asyncio.Event its drain awaits

    async def started(self, run: int, tag: tuple, node: str, t: float) -> None:
        self.notes.append((run, tag, node, t))
        if (arrived := self.waiting.get(run)) is not None:
            arrived.set()

    async def drain(self, run: int, hold: float = 0.0) -> list[tuple]:
        """Run ``run``'s notes; none yet: wait up to ``hold`` s for the first. Each run
        drains its own: a drain left behind by an ended compute takes no other's."""
        import asyncio

        mine = [n for n in self.notes if n[0] == run]
        if not mine and hold > 0:
            arrived = self.waiting[run] = asyncio.Event()
            try:
                await asyncio.wait_for(arrived.wait(), hold)
            except asyncio.TimeoutError:
                pass
            finally:
                if self.waiting.get(run) is arrived:
                    del self.waiting[run]
            mine = [n for n in self.notes if n[0] == run]
        if mine:  # and the notes of ended computes nobody drained, after a while
            stale = time.time() - 600.0
            self.notes = [n for n in self.notes if n[0] != run and n[3] > stale]
        return mine

    async def cancel(self, boxed: list, force: bool) -> None:
        for ref in boxed:
            try:
                ray.cancel(ref, force=force)
            except Exception as e:  # one that cannot be cancelled stops no other
                logger.warning("raydag: could not cancel a task: %s", e)


_inbox: tuple[Any, Any] | None = None  # (the Ray session's id, the actor handle)
_runs = iter(range(1, 2**62))


def _session() -> tuple[str, str]:
    ctx = ray.get_runtime_context()
    return (ctx.gcs_address, ctx.get_job_id())  # job ids restart in every new cluster


def inbox() -> Any:
    """This driver's inbox actor on its own node, started on first use, one per Ray session."""
    global _inbox
    ctx = ray.get_runtime_context()
    session = _session()
    if _inbox is None or _inbox[0] != session:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Hard affinity: the driver's node lives as long as the driver does, and an
        # inbox elsewhere would lose its notes with that node (soft affinity let Ray
        # put it on a worker node now and then).
        here = NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=False)
        actor = (
            ray.remote(_Inbox)
            .options(num_cpus=0, max_restarts=-1, scheduling_strategy=here)
            .remote()
        )
        _inbox = (session, actor)
    return _inbox[1]


def cancel(refs: Sequence[ray.ObjectRef], force: bool) -> None:
    """Cancel the Ray tasks of ``refs`` from the inbox, not from this process.

    Ray 2.60 aborts the process that owns a task when that process's own
    ``ray.cancel`` meets the task's reply (a check fails in its core worker: see the
    README). A cancel from another process reaches the owner as a request, handled on
    the same thread as the replies, one after the other.
    """
    if refs:
        inbox().cancel.remote(list(refs), force)  # in a list: refs, not their values


class _Graveyard:
    """The refs of cancelled Ray tasks, held until each task has ended.

    Ray (2.60) can keep a cancelled task's value pinned in the object store for good,
    referenced by nobody, when the driver drops the task's refs before it has ended:
    seen under load, for a task cancelled while its worker process was starting. Refs
    dropped once the task has ended free its value as usual. A thread waits for the
    ends, so that neither a compute nor its error waits for them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._held: dict[ray.ObjectRef, tuple[tuple, tuple[str, str]]] = {}
        self._thread: threading.Thread | None = None

    def hold(self, meta_ref: ray.ObjectRef, value_refs: tuple) -> None:
        session = _session()
        with self._lock:
            self._held[meta_ref] = (value_refs, session)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._reap, name="raydag-graveyard", daemon=True
                )
                self._thread.start()
            self._more.notify()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _reap(self) -> None:
        while True:
            with self._lock:
                while not self._held:
                    self._more.wait()
            self._bury_ended()  # its locals, refs among them, go when it returns

    def _bury_ended(self) -> None:
        with self._lock:
            held = {r: session for r, (_, session) in self._held.items()}
        try:
            now = _session() if ray.is_initialized() else None
        except Exception:  # Ray shutting down
            now = None
        # refs of an earlier Ray session never end: let them go
        ended = [r for r, session in held.items() if session != now]
        waiting = [r for r, session in held.items() if session == now]
        if waiting:
            try:
                ended += _ended(waiting, timeout=0.5, fetch_local=False)
            except Exception:  # Ray shut down meanwhile: its refs mean nothing now
                ended = list(held)
        with self._lock:
            for r in ended:
                self._held.pop(r, None)


_graveyard = _Graveyard()
hold_until_ended = _graveyard.hold


def _ended(refs: list, timeout: float, fetch_local: bool = True) -> list:
    """Every ref of ``refs`` ready once the first is (or none after ``timeout`` s)."""
    ready, _ = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=fetch_local)
    if not ready:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=fetch_local)
    return ready


def idle_cpus(alive: Mapping[str, float]) -> dict[str, float]:
    """Free CPUs of each alive node, as the cluster's control store last heard."""
    from ray._private import state as ray_state

    free = ray_state.available_resources_per_node()
    return {n: float(free.get(n, {}).get("CPU", 0.0)) for n in alive}


def pack_exception(e: BaseException) -> bytes:
    from tblib import Traceback

    tb = e.__traceback__.tb_next if e.__traceback__ else None  # drop run_group's frame
    try:
        blob = pickle.dumps((e, Traceback(tb).as_dict() if tb else None))
        pickle.loads(blob)  # some pickle but cannot be rebuilt (e.g. required __init__ args)
        return blob
    except Exception:
        plain = RuntimeError(f"{type(e).__name__}: {e} (the exception could not be pickled)")
        return pickle.dumps((plain, Traceback(tb).as_dict() if tb else None))


def unpack_exception(blob: bytes) -> BaseException:
    exc, tb = pickle.loads(blob)
    if tb is not None:
        exc = exc.with_traceback(_rebuilt(tb))
    return exc


def _rebuilt(tb: dict) -> Any:
    """tblib makes each frame of the traceback by running code, and a frame keeps its
    caller's frame (``f_back``) and so its locals: made on the driver loop's stack, the
    error would keep the loop's refs, and their objects, for as long as it lives. A
    fresh thread's stack holds none."""
    from tblib import Traceback

    made: list = []
    t = threading.Thread(target=lambda: made.append(Traceback.from_dict(tb).as_traceback()))
    t.start()
    t.join()
    return made[0]


def _ray_options(resources: Mapping[str, float] | None) -> dict:
    if not resources:
        return {}
    resources = dict(resources)
    opts: dict[str, Any] = {}
    for name, option in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("memory", "memory")):
        if name in resources:
            opts[option] = resources.pop(name)
    if resources:
        opts["resources"] = resources
    return opts


class Persisted(TaskRef):
    """A result that ``raydag.persist`` keeps in Ray's object store.

    It stands in a persisted collection's graph in place of the value. Being a
    ``TaskRef`` (as distributed's ``Future`` is), dask's optimisations treat it as a
    reference to its key rather than as data to inline. It carries the tasks that
    made it, so a later compute can recompute it if its node dies, and it is updated
    in place when that happens.
    """

    __slots__ = ("ref", "node", "lineage", "__weakref__")

    def __init__(self, key: Key, ref: ray.ObjectRef, node: str | None, lineage: Mapping):
        super().__init__(key)
        self.ref = ref
        self.node = node
        self.lineage = lineage
        _persisted.setdefault(key, []).append(weakref.ref(self, functools.partial(_forget, key)))

    def __repr__(self) -> str:
        return f"Persisted({self.key!r}, {self.ref.hex()[:16]})"


# Live persisted results by key: a later graph refers to them only by key. A key has
# several when a collection was persisted more than once; any live one will do.
_persisted: dict[Key, list[weakref.ref]] = {}


def _forget(key: Key, dead: weakref.ref) -> None:
    refs = _persisted.get(key)
    if refs is not None:
        refs[:] = [r for r in refs if r is not dead and r() is not None]
        if not refs:
            _persisted.pop(key, None)


def find_persisted(key: Key) -> Persisted | None:
    for r in _persisted.get(key, ()):
        p = r()
        if p is not None:
            return p
    return None


def _given_ref(value: Any) -> ray.ObjectRef:
    return value.ref if isinstance(value, Persisted) else value


def is_given(value: Any) -> bool:
    return isinstance(value, Persisted | ray.ObjectRef)


# ---- the driver loop ---------------------------------------------------------------


class Runner:
    """One compute: feeds Ray completions to the state machine, carries out its answers."""

    def __init__(
        self,
        graph: Graph,
        state: State,
        nodes: dict[str, float],
        callbacks: Any = (),
        observers: Sequence[Callable[[Event | None, list[Instruction]], None]] = (),
        sampler: StoreSampler | None = None,
    ):
        self.graph = graph
        self.state = state
        # Called with every event (None for the start) and the instructions it gave:
        # the state machine's transcript, for the run record and progress displays.
        self.observers = list(observers)
        # Refs this compute produced, and the node each value was made on. Values
        # given from outside (graph.external) are read from the graph, never dropped.
        self.values = {k: _given_ref(v) for k, v in graph.external.items()}
        self.node_of = {k: v.node for k, v in graph.external.items() if isinstance(v, Persisted)}
        self.nbytes: dict[Key, int] = {}  # each value's size, as the task measured it
        self.nodes = nodes
        # Nodes known dead, or taken for dead since Ray lost a value they held.
        self.gone: set[str] = set()
        self.pending: dict[ray.ObjectRef, tuple[Submit, ray.ObjectRef]] = {}
        self.by_group: dict[int, ray.ObjectRef] = {}
        self.failure: Fail | None = None
        self.force_cancel = bool(config.get("cancel.force"))
        self.poll = config.seconds("scheduling.cluster-poll-interval")
        # Let Ray reconstruct lost objects first and step in when it gives up.
        self.ray_first = bool(config.get("recovery.ray-first"))
        self.ray_retries = int(config.get("retries"))
        self._options: dict[Any, Any] = {}
        self.speculation = state.speculation.enabled
        # the object stores, sampled in a thread: placement reads each new round
        self.sampler = sampler if state.placement.enabled else None
        self._round = 0
        self.run_id = next(_runs)
        self._inbox: Any = None
        self._drain: ray.ObjectRef | None = None
        # group -> the serial number of its latest submission: a retry reuses the
        # group's id, and a late note of the earlier attempt must not count for it
        self.serial: dict[int, int] = {}
        self._serials = itertools.count(1)
        self.callbacks = callbacks
        _, _, self.pretask, self.posttask, _ = unpack_callbacks(callbacks)
        self.dask_state = _dask_state(graph) if callbacks else None

    def run(self) -> dict[Key, tuple[ray.ObjectRef, str | None]]:
        """Run to the end; return the outputs' refs and nodes (the caller owns them now)."""
        try:
            self._step(None)
            # Given values whose node died before this compute: one wave for all of them,
            # before their readers fail one by one.
            self.gone |= {n for n in self.node_of.values() if n and n not in self.nodes}
            if self.gone and not self.ray_first:
                self._step(ResultsLost(tuple(self._lost()), "node died before the compute"))
            last_poll = time.monotonic()
            while not self.state.done:
                if not self.pending:
                    raise RuntimeError("raydag: nothing in flight but the graph is not done")
                self._wait_and_handle()
                if time.monotonic() - last_poll > self.poll:
                    last_poll = time.monotonic()
                    self._tick()
                    self._watch_cluster()
            if self.failure is not None:
                exc = self.failure.error
                raise exc.with_traceback(exc.__traceback__)
            return {k: (self._ref(k), self.node_of.get(k)) for k in self.graph.outputs}
        except BaseException:
            if not self.state.done:
                self._step(Aborted())
            raise
        finally:
            self.values.clear()
            for meta_ref, (_, value_refs) in self.pending.items():  # none, unless interrupted
                _graveyard.hold(meta_ref, value_refs)
            self.pending.clear()
            self.by_group.clear()
            self._drain = None

    def _wait_and_handle(self) -> None:
        """Wait for Ray tasks to end (up to a poll interval); step through what they
        mean. The refs stay in this frame, not in ``run``'s: a raised error keeps
        the frames it passed through, with their locals, for as long as it lives."""
        # the inbox's drain too: a start note wakes the loop (see ``_Inbox``)
        refs = [*self.pending, *([self._drain] if self._drain is not None else [])]
        for ref in _ended(refs, timeout=self.poll):
            if self._drain is not None and ref == self._drain:
                self._take_notes(wait=0)
                continue
            if ref not in self.pending:  # cancelled while handling an earlier one
                continue
            for event in self._events(ref):
                self._step(event)
            if self.state.done:
                break

    def _hex(self, key: Key) -> str | None:
        ref = self.values.get(key)
        return ref.hex() if ref is not None else None

    def _ref(self, key: Key) -> ray.ObjectRef:
        ref = self.values.get(key)
        return _given_ref(self.graph.external[key]) if ref is None else ref

    def _watch_cluster(self) -> None:
        """Tell the state machine of lost nodes' values and of a changed CPU count."""
        nodes = alive_nodes()
        dead = set(self.nodes) - set(nodes)
        changed = nodes != self.nodes
        self.nodes = nodes
        self.gone |= dead
        if dead and not self.ray_first:
            self._take_notes(wait=2.0)
            self._finish_ready()
        if dead:
            for node in dead:
                logger.warning("raydag: node %s died", node[:12])
        if dead and not self.ray_first:
            lost = self._lost()
            reason = "node died: " + ", ".join(sorted(n[:12] for n in dead))
            self._step(ResultsLost(tuple(lost), reason))
        if changed:
            self._step(CapacityChanged(slots(nodes)))

    def _finish_ready(self) -> None:
        """Before judging what a death lost: the groups whose results came in meanwhile.

        A group that finished has read its inputs: those it alone still needed are
        released, not lost, and the group is not reset and run again for nothing; a
        result made on the dead node goes in the wave. Only successes: a failure (an
        input lost, the node gone) waits for the main loop, after the wave, as before.
        """
        if not self.pending:
            return
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        for ref in ready:
            if ref not in self.pending:
                continue
            try:
                outcome = ray.get(ref, timeout=0)
            except Exception as e:
                frameless(e)
                continue
            if getattr(outcome, "error", True) is not None:
                continue
            for event in self._events(ref):
                self._step(event)

    def _tick(self) -> None:
        """Tell the state machine which copies started where, the time and the idle CPUs."""
        if self.state.done:
            return
        self._take_notes(wait=0)
        alive = {n: c for n, c in self.nodes.items() if n not in self.gone}
        idle = None
        if self.sampler is not None and self.sampler.rounds != self._round:
            self._round = self.sampler.rounds
            stats = self.sampler.latest
            # Pinned (primary) copies only: Ray evicts cached copies of others' values as
            # it needs room, and spills primaries past its threshold. Nodes that can run
            # tasks only: a head without CPUs holds values but runs nothing.
            stores = {
                n: (s.primary_bytes, s.capacity_bytes) for n, s in stats.items() if alive.get(n)
            }
            idle = idle_cpus(alive)
            self._step(StoresSampled(stores, idle), quiet=True)
        if self.speculation:
            self._step(Tick(time.time(), idle or idle_cpus(alive)), quiet=True)

    def _take_notes(self, wait: float) -> None:
        """Pass on the start notes the inbox holds; ask for the next ones. With ``wait``,
        every note sent so far (a node died: who holds which inputs matters)."""
        if self._inbox is None:
            return
        if self._drain is not None:
            self._collect(wait + self.poll if wait else 0)
        if wait and self._drain is None:  # the inbox answers in order: ask once more
            self._drain = self._inbox.drain.remote(self.run_id)
            self._collect(wait)
        if self._drain is None:  # held at the inbox until a note comes: see ``run``
            self._drain = self._inbox.drain.remote(self.run_id, self.poll)

    def _collect(self, wait: float) -> None:
        ready, _ = ray.wait([self._drain], timeout=wait)
        if not ready:
            return
        try:
            notes = ray.get(self._drain)
        except ray.exceptions.RayError as e:  # the inbox restarts; notes are lost
            logger.warning("raydag: the inbox of start notes failed: %s", frameless(e))
            notes = []
        self._drain = None
        for run, (group, serial), node, t in notes:
            live = self.serial.get(group) == serial and group in self.by_group
            if run == self.run_id and live:
                self._step(TaskStarted(group, node, t))

    def _lost(self, also: Collection = (), ended: Collection = ()) -> list:
        """The values gone with their nodes: of every gone node, not only the latest
        (one spared then because a reader held it is lost now if that reader is being
        cancelled), and of ``also`` those whose node raydag does not know.

        A value made on a gone node (its primary copy) is lost unless a task running
        on an alive node reads it: that task fetched it before it started and holds
        it, so a long task that already has its inputs goes on. Other copies are
        caches that Ray may drop, or never confirm, at any moment: counting on them
        split one death into a wave per value. A reader that also reads a lost value
        is cancelled and holds nothing. A ref given from outside, whose node raydag
        does not know, is judged by its copies alone. ``ended``: copies (Ray tasks)
        known to have ended, whatever the state machine has heard yet.
        """
        on_gone = [k for k, n in self.node_of.items() if n in self.gone]
        unknown = [k for k in also if k in self.values and not self.node_of.get(k)]
        keys = [k for k in dict.fromkeys([*on_gone, *unknown]) if k in self.values]
        if not keys:
            return []
        refs = [self.values[k] for k in keys]
        try:
            where = ray.experimental.get_object_locations(refs, timeout_ms=2000)
        except Exception:  # the owner cannot say: assume the worst
            return keys
        # Ray stores the error of an object it cannot recover on its owner's node, and
        # lists that node as the object's location: a copy there proves nothing.
        alive = set(self.nodes) - {ray.get_runtime_context().get_node_id()} - self.gone
        # The inputs of each group with a copy known to run on an alive node.
        readers = [
            set(g.inputs)
            for g in self.state.groups.values()
            if any(
                c.started is not None and c.node in alive and cid not in ended
                for cid, c in g.copies.items()
            )
        ]
        read = set().union(*readers)
        lost, held = [], set()
        for k, ref in zip(keys, refs, strict=True):
            info = where.get(ref) or {}
            # A lost object's owner may report no size: then go by the value's own.
            size = info.get("object_size") or self.nbytes.get(k, INLINED)
            if info and not info["node_ids"] and size < INLINED:
                continue  # returned inline: it lives in the driver's memory, on no node
            if not self.node_of.get(k):
                if not any(n in alive for n in info.get("node_ids", ())):
                    lost.append(k)
            elif k in read:
                held.add(k)
            else:
                lost.append(k)
        while lost and held:
            staying = [inputs for inputs in readers if inputs.isdisjoint(lost)]
            still = {k for k in held if any(k in inputs for inputs in staying)}
            if still == held:
                break
            lost.extend(held - still)
            held = still
        if held and logger.isEnabledFor(logging.DEBUG):
            logger.debug("raydag: kept, read by running tasks: %s", _few(held))
        return lost

    def _events(self, meta_ref: ray.ObjectRef) -> list:
        """What one finished Ray task means, as state machine events."""
        sub, value_refs = self.pending.pop(meta_ref)
        del self.by_group[sub.group]
        outcome = _outcome(meta_ref, value_refs)
        if isinstance(outcome, Exception):
            return self._ray_erred(sub, outcome)
        if outcome.error is not None:
            return [TaskErred(sub.group, outcome.error_key, unpack_exception(outcome.error))]
        sizes = outcome.sizes or [outcome.nbytes]
        for k, ref, size in zip(sub.kept, value_refs, sizes, strict=True):
            self.values[k] = ref
            self.node_of[k] = outcome.node
            self.nbytes[k] = size
        given = self.graph.external.get(sub.root)
        if isinstance(given, Persisted):  # recomputed after a loss: heal the collection
            given.ref, given.node = value_refs[-1], outcome.node
        if self.dask_state is not None:
            self._posttask(sub, outcome)
        durations = dict(zip(sub.keys, outcome.durations, strict=True))
        return [
            TaskFinished(
                sub.group,
                durations,
                outcome.nbytes,
                outcome.node,
                outcome.started,
                outcome.pid,
                tuple(sizes) if len(sub.kept) > 1 else (),
            )
        ]

    def _ray_erred(self, sub: Submit, e: Exception) -> list:
        """What Ray's error for a Ray task means (the user's own errors come in its
        Outcome): a node or a worker process died, an input is lost, or the task could
        not run at all."""
        if isinstance(e, rex.TaskUnschedulableError):  # a duplicate's node died before it ran
            logger.warning("raydag: the node for a copy of %r is gone", sub.root)
            return [TaskErred(sub.group, sub.root, e, node_lost=True)]
        if isinstance(e, NODE_DIED):
            logger.warning("raydag: the node running %r died; retrying it%s", sub.root, _with(sub))
            self._watch_cluster()
            return [TaskErred(sub.group, sub.root, e, node_lost=True)]
        if isinstance(e, WORKER_DIED):
            if isinstance(e, rex.RayTaskError):  # e.g. RaySystemError: cannot unpickle the
                cause = e.cause if isinstance(e.cause, BaseException) else e  # task: no retry
                return [TaskErred(sub.group, sub.root, cause)]
            logger.warning(
                "raydag: %r lost its worker process (%s)%s", sub.root, type(e).__name__, _with(sub)
            )
            return [TaskErred(sub.group, sub.root, e, retryable=True)]
        if isinstance(e, INPUT_LOST):
            logger.warning("raydag: an input of %r is lost (%s)", sub.root, type(e).__name__)
            self._watch_cluster()
            # Ray names the input it could not get: believe it over the locations, since
            # the error Ray stores in place of a lost object is copied to its readers.
            named = getattr(getattr(e, "cause", None) or e, "object_ref_hex", None)
            culprits = [k for k in sub.inputs if named and self._hex(k) == named]
            # Ray may know of the loss before the cluster reports the node dead: then
            # everything on that node is gone too, and goes in this one wave.
            suspects = {self.node_of.get(k) for k in culprits} - {None} - self.gone
            if suspects:
                logger.warning("raydag: node %s lost a value: taking it for dead",
                               ", ".join(sorted(n[:12] for n in suspects)))  # fmt: skip
                self.gone |= suspects
            lost = self._lost(also=sub.inputs, ended={sub.group})
            lost += [k for k in culprits if k not in lost]
            events: list = [ResultsLost(tuple(lost), f"input of {sub.root!r} lost")] if lost else []
            return [*events, TaskErred(sub.group, sub.root, e, node_lost=True)]
        if isinstance(e, rex.RayTaskError):  # failed outside the user's code (e.g. arguments)
            cause = e.cause if isinstance(e.cause, BaseException) else e
            return [TaskErred(sub.group, sub.root, cause)]
        raise e

    def _step(self, event: Event | None, quiet: bool = False) -> None:
        """One transition: the event in (``None`` to start), its instructions out.

        ``quiet``: observers see the event only if it gave instructions (a Tick that
        changed nothing is not worth a row, four times a second).
        """
        instructions = self.state.start() if event is None else self.state.handle(event)
        if instructions or not quiet:
            for observe in self.observers:
                observe(event, instructions)
        self._carry_out(instructions)

    def _carry_out(self, instructions: list[Instruction]) -> None:
        cancelled: list[ray.ObjectRef] = []
        for ins in instructions:
            if isinstance(ins, Submit):
                self._submit(ins)
            elif isinstance(ins, Release):
                self.values.pop(ins.key, None)
                self.node_of.pop(ins.key, None)
                self.nbytes.pop(ins.key, None)
                if self.dask_state is not None:
                    self.dask_state["released"].add(ins.key)
            elif isinstance(ins, Cancel):
                meta_ref = self.by_group.pop(ins.group, None)
                if meta_ref is not None:
                    _, value_refs = self.pending.pop(meta_ref)
                    cancelled.append(value_refs[0])
                    _graveyard.hold(meta_ref, value_refs)
                    if self.force_cancel and ins.node in self.nodes and ins.node not in self.gone:
                        self._spare(ins.node)
            elif isinstance(ins, Fail):
                self.failure = ins
            elif isinstance(ins, Won):
                logger.info(
                    "raydag: a duplicate of %r won (%s); about %.1f s saved",
                    ins.key,
                    ins.reason,
                    ins.saved,
                )
            elif isinstance(ins, Recover):
                for k in ins.recompute:
                    self.values.pop(k, None)
                    self.node_of.pop(k, None)
                    self.nbytes.pop(k, None)
                logger.warning(
                    "raydag: recovery wave %d: %d lost results, %d tasks to recompute (%s)",
                    ins.wave,
                    len(ins.lost),
                    len(ins.recompute),
                    ins.reason,
                )
                if logger.isEnabledFor(logging.DEBUG):  # a wave may lose thousands
                    logger.debug("raydag: wave %d lost %s", ins.wave, _few(ins.lost))
        cancel(cancelled, self.force_cancel)

    def _spare(self, node: str) -> None:
        """A forced cancel kills the copy's worker process, and Ray starts another only
        when a task needs it: a node whose loser was cancelled would make its next task
        (the graph's last, perhaps) wait 0.4-3 s for a process. A task needing no CPU
        starts one now, while the node is idle, and leaves it idle in the pool."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        there = NodeAffinitySchedulingStrategy(node, soft=True)
        _spare_worker.options(scheduling_strategy=there).remote()

    def _submit(self, sub: Submit) -> None:
        spec: Any = tuple(sorted(sub.resources.items())) if sub.resources else None
        if sub.returns:  # a shuffle's map: one Ray object per piece, and the Outcome
            spec = (spec, len(sub.returns))
        fn = self._options.get((spec, sub.node, sub.soft))
        if fn is None:
            opts = _ray_options(sub.resources)
            if sub.returns:
                opts["num_returns"] = len(sub.returns) + 1
            if self.ray_first:
                opts["max_retries"] = self.ray_retries
            if sub.node is not None:
                # A duplicate: on that node and no other (soft=False), never by its
                # original. A placed task: there if it can, elsewhere if that node is
                # gone or has no CPU free (soft, spilling).
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    sub.node, soft=sub.soft, _spill_on_unavailable=sub.soft
                )
            fn = self._options[(spec, sub.node, sub.soft)] = _remote.options(**opts)
        notify = None
        if sub.notify:
            if self._inbox is None:
                self._inbox = inbox()
            serial = self.serial[sub.group] = next(self._serials)
            notify = (self._inbox, self.run_id, (sub.group, serial))
        nodes = [self.graph.tasks[k] for k in sub.keys]
        refs = [self._ref(k) for k in sub.inputs]
        kw = {"returns": sub.returns} if sub.returns else {}
        *value_refs, meta_ref = fn.remote(nodes, sub.inputs, notify, *refs, **kw)
        self.pending[meta_ref] = (sub, tuple(value_refs))
        self.by_group[sub.group] = meta_ref
        if self.dask_state is not None and sub.duplicate_of is None:
            s = self.dask_state
            for k in sub.keys:
                s["waiting"].discard(k)
                s["running"].add(k)
                for f in self.pretask:
                    f(k, self.graph.tasks, s)

    def _posttask(self, sub: Submit, outcome: Outcome) -> None:
        s = self.dask_state
        for k in sub.keys:
            s["running"].discard(k)
            s["finished"].add(k)
            for f in self.posttask:
                f(k, None, self.graph.tasks, s, outcome.pid)


def _with(sub: Submit) -> str:
    """The other tasks of a retried group: they run again too (their values never left)."""
    others = [k for k in sub.keys if k != sub.root]
    return f" (with {', '.join(map(repr, others))} in its Ray task)" if others else ""


def _outcome(meta_ref: ray.ObjectRef, value_refs: Sequence[ray.ObjectRef]) -> Outcome | Exception:
    """``ray.get`` of a Ray task's outcome, or Ray's error for it (see ``frameless``).
    When the task failed, its value refs hold the error too: read them, or Ray logs each
    as an "Unhandled error" when it is dropped (a line per value per worker death, on
    top of raydag's own warning)."""
    try:
        return ray.get(meta_ref)
    except Exception as e:
        for ref in value_refs:
            try:
                ray.get(ref, timeout=0)
            except Exception as again:
                frameless(again)
        return frameless(e)


def frameless(e: BaseException) -> BaseException:
    """``e`` without its traceback, nor those of the errors it chains to.

    ``ray.get`` raises an error it holds in a local variable: the error and that frame
    refer to each other, a cycle only the garbage collector frees. The frames hold the
    refs they were given, and so the objects stay in the store until a collection runs,
    or for as long as a caller keeps the error (a notebook keeps the last one). They
    are Ray's and raydag's frames on the driver, which tell a user nothing.
    """
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        todo += [x.__context__, x.__cause__]
    return e


def _few(keys: Iterable, n: int = 40) -> str:
    """Keys for a debug line: the first ``n`` of them, sorted, and how many more."""
    shown = sorted(map(repr, keys))
    more = f" and {len(shown) - n} more" if len(shown) > n else ""
    return ", ".join(shown[:n]) + more


def _dask_state(graph: Graph) -> dict:
    """The subset of dask.local's state dict that dask's callbacks read."""
    return {
        "dependencies": {k: set(v) for k, v in graph.dependencies.items()},
        "dependents": graph.dependents,
        "waiting": set(graph.tasks) - set(graph.external),
        "ready": set(),
        "running": set(),
        "finished": set(graph.external),
        "released": set(),
        "cache": {},
    }


# ---- entry points ------------------------------------------------------------------


def fusion_settings() -> Fusion:
    return Fusion(
        enabled=bool(config.get("fusion.enabled")),
        max_task_duration=config.seconds("fusion.max-task-duration"),
        max_group_duration=config.seconds("fusion.max-group-duration"),
        max_group_size=int(config.get("fusion.max-group-size")),
    )


def placement_settings() -> Placement:
    hw = float(config.get("placement.high-water"))
    if not 0.0 < hw <= 1.0:
        raise ValueError(f"raydag.placement.high-water must be in (0, 1], not {hw!r}")
    balance = float(config.get("placement.balance"))
    if not 0.0 <= balance <= 1.0:
        raise ValueError(f"raydag.placement.balance must be in [0, 1], not {balance!r}")
    return Placement(enabled=bool(config.get("placement.enabled")), high_water=hw, balance=balance)


def speculation_settings() -> Speculation:
    def opt(key: str) -> float | None:
        return None if config.get(key) is None else config.seconds(key)

    q = config.get("speculation.quantile")
    slow = config.get("speculation.slow-node")
    return Speculation(
        enabled=bool(config.get("speculation.enabled")),
        quantile=None if q is None else float(q),
        min_samples=int(config.get("speculation.min-samples")),
        long_task=opt("speculation.long-task"),
        min_runtime=config.seconds("speculation.min-runtime"),
        max_in_flight=int(config.get("speculation.max-in-flight")),
        max_copies=int(config.get("speculation.max-copies")),
        slow_node=None if slow is None else float(slow),
    )


def seed_runtimes() -> dict[str, list[float]] | None:
    """Runtimes per category from ``raydag.speculation.seed``: a run directory or record."""
    seed = config.get("speculation.seed")
    if seed is None:
        return None
    try:
        rec = seed if isinstance(seed, record.RunRecord) else record.load(os.path.expanduser(seed))
        return record.category_runtimes(rec)
    except Exception as e:  # a missing or unreadable record must not stop the compute
        logger.warning("raydag: cannot seed runtimes from %r: %s", seed, e)
        return None


def run(
    dsk: Any, keys: Any, callbacks: Any = None
) -> tuple[Graph, dict[Key, tuple[ray.ObjectRef, str | None]]]:
    """Build the graph, run it on Ray, return the outputs' refs and nodes."""
    graph = Graph.from_dask(dsk, keys, is_external=is_given, find_external=find_persisted)
    connect()
    nodes = alive_nodes()
    state = State.from_graph(
        graph,
        bundles=shuffle.bundles(graph.tasks, graph.dependents),
        capacity=slots(nodes),
        default_retries=int(config.get("retries")),
        fusion=fusion_settings(),
        cheap_cost=float(config.get("scheduling.cheap-task-cost")),
        speculation=(spec := speculation_settings()),
        seed_runtimes=seed_runtimes() if spec.enabled else None,
        placement=placement_settings(),
    )
    with (
        local_callbacks(callbacks) as cbs,
        _watching(graph, state, nodes, cbs) as (observers, sampler),
    ):
        started = []
        failed = True
        runner = Runner(graph, state, nodes, cbs, observers, sampler)
        try:
            for cb in cbs:
                if cb[0]:
                    cb[0](graph.tasks)
                started.append(cb)
            for cb in cbs:
                if cb[1]:
                    cb[1](graph.tasks, runner.dask_state)
            refs = runner.run()
            failed = False
            return graph, refs
        finally:
            for cb in started:
                if cb[4]:
                    cb[4](graph.tasks, runner.dask_state or {}, failed)


@contextlib.contextmanager
def _watching(
    graph: Graph, state: State, nodes: dict[str, float], callbacks: Any
) -> Iterator[tuple[list[Callable[[Event | None, list[Instruction]], None]], Any]]:
    """The compute's observers: its run record and progress display; and the
    object-store sampler, whose rounds they show and placement reads (only when
    written, displayed or placing)."""
    keep, sample = record.wanted(len(graph))
    recorder = record.Recorder(graph, nodes, alive_nodes) if keep else None
    display = progress.start(state, callbacks)
    sampler = None
    placing = state.placement.enabled
    if sample or display is not None or placing:
        try:
            interval = min(
                config.seconds("record.store-interval") if sample or display else math.inf,
                config.seconds("placement.interval") if placing else math.inf,
            )
            on_round = display.stores if display is not None else None
            keeping = bool(sample or display is not None)  # placement needs only the latest
            sampler = StoreSampler(
                interval, on_round=on_round, reader=shared_reader(), keep=keeping
            )
            sampler.start(wait=False)  # the first round in its thread: the compute goes on
        except Exception as e:  # the record goes on without store samples
            logger.warning("raydag: cannot sample the object stores: %s", e)
            sampler = None
    error = None
    try:
        yield [o for o in (recorder, display) if o is not None], sampler
    except BaseException as e:
        error = e
        raise
    finally:
        if recorder is not None:
            recorder.stop()
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.stop()
        if display is not None:
            display.close(error)
        if recorder is not None:
            if sampler is not None:
                recorder.add_samples(sampler.samples)
            try:
                record.finished(recorder.finish(error))
            except Exception:  # the record must never break a compute
                logger.exception("raydag: could not finish the run record")


def nested(keys: Any, values: Mapping[Key, Any]) -> Any:
    if isinstance(keys, list):
        return [nested(k, values) for k in keys]
    return values[keys]
