"""The chaos kit: recorded tasks, a multi-node cluster to kill nodes in, and the oracle.

Shared by the fault tests (tests/test_faults.py) and the recovery benchmark
(bench/recovery.py). Every task built here notes each of its runs (start and end,
node, pid, time) in a file under /tmp, which all nodes share (each node has its own
TMPDIR, so not there). From those runs alone, ``expected_recovery`` works out what a
dead node took that was still needed: the minimum any recovery must run again.

Ray workers import this module by name (its tasks are not shipped by value):
``Clusters`` puts this directory on the nodes' PYTHONPATH.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import dask
import numpy as np
import ray
from dask._task_spec import Task, TaskRef
from harness import MultiNodeCluster

from raydag.runtime.stores import StoreStats, store_stats

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20
# Task returns below Ray's max_direct_call_object_size (100 KiB) live in the owner's
# (the driver's) memory, not in a node's object store: a node's death cannot lose them.
INLINE_BYTES = 100 * 1024


def note(log: str | None, kind: str, label: str) -> None:
    """Append one line per event; O_APPEND keeps concurrent writers' lines whole."""
    if log is None:
        return
    node = ray.get_runtime_context().get_node_id()
    line = f"{kind} {label} {node} {os.getpid()} {time.time():.6f}\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def work(label: str, log: str | None, seconds: float, nbytes: int, value: float, *deps: Any):
    """A task of known duration and size whose value depends on its inputs' values."""
    note(log, "start", label)
    time.sleep(seconds)
    total = value + sum(float(np.asarray(d).flat[0]) for d in deps)
    out = np.full(max(1, nbytes // 8), total)
    note(log, "end", label)
    return out


class T(NamedTuple):
    """One task of a test graph: how long it sleeps, how big its value is, what it reads."""

    seconds: float
    nbytes: int
    value: float
    deps: tuple = ()


Spec = Mapping[str, T]


def build(spec: Spec, log: str | None, fast: bool = False) -> dict:
    """The dask graph of ``spec``: keys are the labels the tasks note."""
    return {
        k: Task(
            k, work, k, log, 0.0 if fast else t.seconds, t.nbytes, t.value, *map(TaskRef, t.deps)
        )
        for k, t in spec.items()
    }


def expected_values(spec: Spec, outputs: list) -> list:
    """What dask's sync scheduler gives for the outputs (the same graph, no sleeps)."""
    return dask.get(build(spec, None, fast=True), outputs)


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)


@dataclass
class Run:
    """One execution of a task, from its notes; ``end`` is None if it never finished."""

    label: str
    node: str
    pid: int
    start: float
    end: float | None = None


def runs(log: str, since: float = 0.0) -> list[Run]:
    """The task runs noted in ``log`` that started at or after ``since``."""
    out: list[Run] = []
    open_runs: dict[tuple[str, int], Run] = {}
    if not os.path.exists(log):
        return out
    with open(log) as f:
        for line in f:
            if not line.endswith("\n"):  # a note being written as we read: next time
                break
            kind, label, node, pid, t = line.split()
            if kind == "start":
                r = Run(label, node, int(pid), float(t))
                open_runs[(label, r.pid)] = r
                out.append(r)
            elif kind == "end":
                open_runs.pop((label, int(pid))).end = float(t)
    return [r for r in out if r.start >= since]


def completions(log: str, since: float = 0.0) -> Counter:
    return Counter(r.label for r in runs(log, since) if r.end is not None)


def duplicates() -> Counter:
    """The copies speculation added in the last compute, by key."""
    import raydag

    run = raydag.last_run()
    if run is None:
        return Counter()
    ev = run.events
    return Counter(ev[ev.event == "duplicated"].key)


def less_duplicates(got: Counter, expected: Mapping[str, int]) -> Counter:
    """``got`` with each key's runs past ``expected`` forgiven, up to the duplicates
    speculation made of it: a copy of a short task at the tail, started as the first
    ended, may finish too, and is no re-execution; a duplicate that was cancelled
    finished nothing, and forgives nothing."""
    dups = duplicates()
    out = Counter(got)
    for key, n in dups.items():
        extra = out[key] - expected.get(key, 0)
        if extra > 0:
            out[key] -= min(n, extra)
    return +out


def spare_copy(r: Run, done: list[Run], dups: Counter) -> bool:
    """Was ``r`` (a run killed with its node) a copy speculation made of a key another
    run made? Then it needs no rerun: the driver cancels or drops it."""
    return dups[r.label] > 0 and any(
        x.label == r.label and x.end is not None and x is not r for x in done
    )


@dataclass
class Death:
    node: str
    t_kill: float  # the kill began: runs started later cannot have read its values
    t_dead: float  # the kill was done: results made later cannot have been there
    t_seen: float | None = None  # when raydag's driver noticed (its log), if it did
    # Tasks whose last run on the dead node noted its end, but whose result never
    # reached the driver (it retried them as running): they count as cut, not made.
    cut: set = field(default_factory=set)


class Wave(NamedTuple):
    number: int
    lost: int
    recompute: int
    reason: str
    t: float


WAVE_RE = re.compile(r"recovery wave (\d+): (\d+) lost results, (\d+) tasks to recompute \((.*)\)$")


DIED_RE = re.compile(r"raydag: node (\w+) died")
KEYS_RE = re.compile(r"raydag: (wave \d+ lost|kept, read by running tasks) ")


RETRY_RE = re.compile(
    r"raydag: (?:the node running '([^']+)' died|'([^']+)' lost its worker process)"
    r"(?:.* \(with (.+) in its Ray task\))?"
)


class RaydagLog(logging.Handler):
    """raydag's driver log: its recovery waves and the node deaths it noticed.

    raydag reports a wave only as a log line; a structured hook (a callback or run
    record receiving each ``Recover`` instruction with its keys) would make this exact.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.getMessage()))

    def clear(self) -> None:
        self.records.clear()

    def waves(self) -> list[Wave]:
        out = []
        for t, msg in self.records:
            m = WAVE_RE.search(msg)
            if m:
                out.append(Wave(int(m[1]), int(m[2]), int(m[3]), m[4], t))
        return out

    def judged(self) -> list[str]:
        """raydag's own debug lines naming the values each wave lost or kept."""
        return [msg for _, msg in self.records if KEYS_RE.search(msg)]

    def cut(self, after: float, before: float = math.inf) -> set[str]:
        """Tasks the driver saw die with their node from ``after`` to ``before``: their
        results had not reached it, even if the task noted its end just before the kill.
        A group's other tasks, which the driver names with its root, too: they run again
        with it (a member that noted its end in the group's task made no value)."""
        out: set[str] = set()
        for t, msg in self.records:
            if after <= t < before and (m := RETRY_RE.search(msg)):
                out.add(m[1] or m[2])
                out.update(re.findall(r"'([^']+)'", m[3] or ""))
        return out

    def note_cuts(self, deaths: Iterable[Death]) -> None:
        """Each death's ``cut``: the retries logged from its kill to the next death's.

        Not every retry logged after the kill: a task retried at a later death, matched
        to an older run of it on this node (a run whose result did reach the driver),
        would count that run as cut, and a completion as owed that never was.
        """
        order = sorted(deaths, key=lambda d: d.t_kill)
        for i, d in enumerate(order):
            d.cut |= self.cut(d.t_kill, order[i + 1].t_kill if i + 1 < len(order) else math.inf)

    def seen(self, death: Death) -> float | None:
        """When the driver noticed ``death``: it logs the death, then recovers."""
        for t, msg in self.records:
            m = DIED_RE.search(msg)
            if m and death.node.startswith(m[1]) and t >= death.t_kill:
                return t
        return None


@dataclass
class Expected:
    lost: list[set] = field(default_factory=list)  # per death: lost values still needed
    recompute: list[set] = field(default_factory=list)  # per death: those and their inputs
    running: list[list[Run]] = field(default_factory=list)  # per death: runs it killed
    # Runs on a dying node that noted their end, but whose result never reached the
    # driver (Ray failed the task with its node): each must run again, like ``running``.
    cut: list[Run] = field(default_factory=list)
    completions: Counter = field(default_factory=Counter)

    @property
    def waves(self) -> int:
        return sum(bool(lost) for lost in self.lost)


def expected_recovery(
    spec: Spec,
    outputs: Iterable[str],
    done: list[Run],
    deaths: list[Death],
    given: Mapping[str, str] | None = None,
) -> Expected:
    """What raydag must run again after ``deaths``, worked out from the task runs alone.

    At the moment the driver notices a death, a value is *lost* if the last run that
    made it was on the dead node, it is bigger than Ray inlines, no consumer still
    running on another alive node pins a copy (it started after the value was made,
    and had not ended when the driver noticed; a consumer that also
    reads a lost value is cancelled, and pins nothing), and it is still *needed*: an
    output, or read by a task not finished yet. What gets
    recomputed is the lost values and, transitively, the inputs they read that were
    released (all their consumers had finished) or lost too. ``given`` maps the keys
    of values given to the compute (``raydag.persist``) to the node holding each.

    One race the runs cannot settle: a task on the dead node may note its end and die
    before its result reaches the driver. ``death.cut`` names the tasks the driver
    retried as running when that node died (from its log, ``RaydagLog.note_cuts``).
    The run the driver was waiting for is the latest to start on that node before the
    node was dead and after the latest wave that reset the task (the result of a run
    before that wave had reached the driver, or nothing would have reset it); if that
    run noted its end, it counts as cut: it ran to its end, and then ran again.
    """
    done = list(done)
    replay = _Replay(spec, set(outputs), done, dict(given or {}))
    exp = Expected(completions=replay.first_runs())
    for death in sorted(deaths, key=lambda d: d.t_kill):
        for label in sorted(death.cut):  # a result cut off on its way to the driver
            there = [
                r
                for r in done
                if r.label == label
                and r.node == death.node
                and replay.since[label] < r.start < death.t_dead
            ]
            r = max(there, key=lambda r: r.start, default=None)
            if r is not None and r.end is not None and r.end < death.t_dead:
                exp.cut.append(r)
                exp.completions[label] += 1
                done[done.index(r)] = Run(r.label, r.node, r.pid, r.start, None)
        if death.t_seen is None:  # the compute never noticed: nothing to expect
            continue
        lost, recompute = replay.death(death)
        exp.lost.append(lost)
        exp.recompute.append(recompute)
        exp.running.append(
            [r for r in done if r.node == death.node and r.end is None and r.start < death.t_dead]
        )
        exp.completions.update(recompute)
    return exp


class _Replay:
    """The state of every value as deaths happen, for ``expected_recovery``."""

    def __init__(self, spec: Spec, outputs: set, done: list[Run], given: dict[str, str]):
        self.spec, self.outputs, self.done, self.given = spec, outputs, done, given
        self.dependents: dict[str, set] = {k: set() for k in spec}
        for k, t in spec.items():
            for d in t.deps:
                self.dependents[d].add(k)
        self.since = dict.fromkeys(spec, -math.inf)  # when a wave last reset each key
        self.dead: set = set()

    def first_runs(self) -> Counter:
        """Keys that run once without failures: what the outputs need, short of given values."""
        needed: set = set()
        stack = list(self.outputs)
        while stack:
            k = stack.pop()
            if k not in needed:
                needed.add(k)
                if k not in self.given:
                    stack.extend(self.spec[k].deps)
        return Counter({k: 1 for k in needed if k not in self.given})

    def made(self, k: str, before: float) -> list[Run]:
        return [
            r
            for r in self.done
            if r.label == k and r.end is not None and self.since[k] < r.end < before
        ]

    def given_now(self, k: str) -> bool:
        return k in self.given and self.since[k] == -math.inf

    def holder(self, k: str, t_dead: float) -> tuple[str | None, float]:
        made = self.made(k, t_dead)
        if made:
            r = max(made, key=lambda r: r.end)
            return r.node, r.end
        if self.given_now(k):
            return self.given[k], -math.inf
        return None, math.inf

    def in_memory(self, k: str, seen: float) -> bool:
        if not (self.given_now(k) or self.made(k, seen)):
            return False
        return k in self.outputs or any(not self.made(d, seen) for d in self.dependents[k])

    def readers(self, k: str, after: float, death: Death) -> list[Run]:
        """Runs of ``k``'s consumers on other alive nodes that started before the driver
        noticed the death and still ran then: their pinned copies keep ``k``.

        Not only those that started before the kill: a task starts once its inputs are
        fetched, and a fetch may end as the node is being killed (the kill takes about
        0.1 s, from ``t_kill`` to ``t_dead``), or come from a copy on another node."""
        seen = death.t_seen
        assert seen is not None
        return [
            r
            for r in self.done
            if r.label in self.dependents[k]
            and r.node != death.node
            and r.node not in self.dead
            and after < r.start < seen
            and (r.end is None or r.end > seen)
        ]

    def death(self, death: Death) -> tuple[set, set]:
        seen = death.t_seen
        assert seen is not None
        lost = set()
        spared: dict[str, list[Run]] = {}
        for k in self.spec:
            node, t_made = self.holder(k, death.t_dead)
            if node != death.node or self.spec[k].nbytes < INLINE_BYTES:
                continue
            if not self.in_memory(k, seen):
                continue
            readers = self.readers(k, t_made, death)
            if readers:
                spared[k] = readers
            else:
                lost.add(k)
        # A reader that also reads a lost value is cancelled: its copies go with it.
        changed = True
        while changed:
            changed = False
            for k, readers in list(spared.items()):
                if all(set(self.spec[r.label].deps) & lost for r in readers):
                    lost.add(k)
                    del spared[k]
                    changed = True
        recompute: set = set()
        stack = list(lost)
        while stack:
            k = stack.pop()
            if k in recompute:
                continue
            recompute.add(k)
            for d in self.spec[k].deps:
                if d in lost or (d not in self.given and not self.in_memory(d, seen)):
                    stack.append(d)
        for k in recompute:
            self.since[k] = seen
        self.dead.add(death.node)
        return lost, recompute


class Clusters:
    """One cluster at a time for the module; a test that needs other Ray settings restarts it."""

    def __init__(self, **cluster: Any) -> None:
        self.cluster = cluster  # MultiNodeCluster's settings: cpus, store_bytes...
        self.current: MultiNodeCluster | None = None
        self.config: dict | None = None
        self.old_path: str | None = None

    def get(self, system_config: dict | None = None, **sizes: Any) -> MultiNodeCluster:
        """``sizes``: MultiNodeCluster's (nodes, cpus, store_bytes, head_store_bytes)."""
        wanted = (system_config, sizes) if sizes else system_config
        if self.current is not None and self.config == wanted:
            return self.current
        self.close()
        # Ray workers inherit their raylet's environment, raylets the driver's when they
        # start (nodes added later too): let them import this module.
        self.old_path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, self.old_path) if p)
        self.current = MultiNodeCluster(
            system_config=system_config, **{**self.cluster, **sizes}
        ).__enter__()
        self.config = wanted
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.__exit__(None, None, None)
            self.current = None
            if self.old_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = self.old_path


def store_objects() -> int:
    return sum(s.num_objects for s in store_stats().values())


def assert_stores_empty(timeout: float = 5.0, orphan_timeout: float = 30.0) -> None:
    """No object left in any alive node's store (the raylets free in batches: poll).

    After node deaths and spilling, Ray may keep a copy it fetched or restored as an
    unreferenced cache (no primary copy, evicted when room is needed): after the
    timeout, such copies pass. A primary copy that some process still references
    never passes. A primary copy that no process references is kept by a raylet on
    its own (seen now and then in the shuffle fault tests, on clusters that had lost
    nodes): raydag holds no ref that could free it, so it is waited for, reported,
    and not counted again by later checks.
    """
    deadline = time.monotonic() + timeout
    while (n := store_objects()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not n or not (pinned := _new_pinned()):
        return
    held = references()
    assert not held, (
        f"{n} objects ({pinned} pinned bytes) left in the stores after {timeout} s, "
        f"referenced by: {held}; held in this process by: {holders(held)}"
    )
    t0, orphans = time.monotonic(), pinned
    while (pinned := _new_pinned()) and time.monotonic() < t0 + orphan_timeout:
        time.sleep(0.5)
    if pinned:
        _orphans.update(store_stats())
    logging.getLogger(__name__).warning(
        "%d bytes were pinned in the object stores with no reference in any process; "
        "%s after %.1f s more",
        orphans,
        f"{pinned} still pinned" if pinned else "freed",
        time.monotonic() - t0,
    )


# node -> its store when a raylet was found keeping copies with no reference anywhere
# (see assert_stores_empty): those copies are not counted again
_orphans: dict[str, StoreStats] = {}


def _new_pinned() -> int:
    """Pinned bytes in the stores, beyond the raylets' own unreferenced copies."""
    return _beyond_orphans("primary_bytes")


def primary_objects() -> int:
    """Primary copies in the stores (what some owner pins, not the evictable caches a
    node keeps of objects it fetched), beyond the raylets' own unreferenced copies."""
    return _beyond_orphans("primary_objects")


def _beyond_orphans(field: str) -> int:
    none = StoreStats(0, 0, 0, 0)
    stats = store_stats().items()
    return sum(max(0, getattr(s, field) - getattr(_orphans.get(n, none), field)) for n, s in stats)


def references() -> list[dict]:
    """Every object reference any driver or worker holds, but actor handles: ``ray
    memory``'s rows (pid, kind of process, reference type, size, object id)."""
    from google.protobuf.json_format import MessageToDict
    from ray._private.internal_api import node_stats
    from ray.dashboard.memory_utils import construct_memory_table

    stats = []
    for node in ray.nodes():
        if node["Alive"]:
            reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"])
            stats += [MessageToDict(w) for w in reply.core_workers_stats]
    entries = (e.as_dict() for e in construct_memory_table(stats).table)
    keep = ("pid", "type", "reference_type", "object_size", "object_ref")
    return [{k: e[k] for k in keep} for e in entries if e["reference_type"] != "ACTOR_HANDLE"]


def holders(held: list[dict]) -> dict[str, list[str]]:
    """Where this process keeps the refs of ``held`` with a size (values made): for each,
    the containers holding it and what holds those (type names, a frame's function),
    for a failure's message."""
    sized = {h["object_ref"] for h in held if h["pid"] == os.getpid() and h["object_size"] >= 0}
    out: dict[str, list[str]] = {}

    def name(o: object) -> str:
        if hasattr(o, "f_code"):
            return f"frame {o.f_code.co_name} ({o.f_code.co_filename}:{o.f_lineno})"
        return type(o).__qualname__

    for c in gc.get_objects():
        items = c.values() if isinstance(c, dict) else c if isinstance(c, list | tuple) else ()
        for x in items:
            if isinstance(x, ray.ObjectRef) and x.hex() in sized:
                up = [name(r) for r in gc.get_referrers(c)][:5]
                out.setdefault(x.hex(), []).append(f"{type(c).__name__} in {up}")
    return out


def ensure_nodes(c: MultiNodeCluster, n: int = 3) -> None:
    """Exactly ``n`` alive worker nodes, none busy, stores empty: each test's starting point."""
    while len(c.alive) > n:
        extra = c.alive[-1]
        c.kill(extra)
        c.wait_dead(extra)
    while len(c.alive) < n:
        c.add_node()
    gc.collect()  # ray_dask_get leaves objects behind in a reference cycle (ray#36653)
    deadline = time.monotonic() + 10
    while store_objects() and time.monotonic() < deadline:
        time.sleep(0.1)


class Background:
    """A compute in a daemon thread, so that the test can kill nodes meanwhile."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def result(self, timeout: float = 120.0) -> Any:
        if not self.done.wait(timeout):
            self.interrupt()
            raise TimeoutError(f"the compute did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        # Hand the value over: arrays read from the object store pin their objects.
        value, self.value = self.value, None
        return value

    def outcome(self, timeout: float = 120.0) -> tuple[str, Any]:
        """('ok', value) or (the error's type names, None), for a contender that may fail."""
        try:
            return "ok", self.result(timeout)
        except TimeoutError:
            return "hung", None
        except Exception as e:
            print(f"{describe_error(e)}: {str(e)[:600]}")
            return describe_error(e), None

    def interrupt(self) -> None:
        """Ctrl-C the compute (raydag aborts and frees) so it stops using the cluster."""
        if self.thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread.ident), ctypes.py_object(KeyboardInterrupt)
            )
            self.done.wait(10)


def describe_error(e: BaseException) -> str:
    names = [type(e).__name__]
    cause = getattr(e, "cause", None) or e.__cause__
    if cause is not None and type(cause).__name__ not in names:
        names.append(type(cause).__name__)
    return "/".join(names)


def wait_until(
    pred: Callable[[], Any], what: str, bg: Background | None = None, timeout: float = 60
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if bg is not None and bg.done.is_set():
            bg.result(0)  # raises the compute's error, if any
            raise AssertionError(f"the compute finished before {what}")
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout} s for {what}")


def kill(c: MultiNodeCluster, node_id: str) -> Death:
    """SIGKILL a node, wait until the cluster marks it dead."""
    node = c.by_id(node_id)
    t = time.time()
    c.kill(node)
    t_dead = time.time()
    c.wait_dead(node)
    return Death(node_id, t, t_dead)


def busiest(c: MultiNodeCluster, log: str, labels: Callable[[str], bool], exclude=()) -> str:
    """The alive node that finished the most runs of matching tasks."""
    alive = {n.node_id for n in c.alive} - set(exclude)
    count = Counter(r.node for r in runs(log) if r.end is not None and labels(r.label))
    return max(alive, key=lambda n: count.get(n, 0))
