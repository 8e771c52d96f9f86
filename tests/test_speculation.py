"""Speculative duplicates on a real multi-node Ray cluster: a slowed node, a killed node.

One cluster serves the module: a head without CPUs and 3 one-CPU nodes, the third
started with ``RAYDAG_TEST_SLOWDOWN=5``: tasks built with ``slow=True`` sleep 5 times
longer there (a test hook in the task below, not in raydag). Every task notes each of
its runs (start, end, node) in a file under /tmp, so the tests see what ran where,
independently of raydag's own record.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from typing import Any

import dask
import numpy as np
import pytest
import ray
from chaos import Background, Clusters, assert_same, assert_stores_empty, ensure_nodes
from dask._task_spec import Task, TaskRef

import raydag

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SLOWDOWN = 5.0
SLOWED: list[str] = []  # the slowed node's id
NBYTES = 256 * 1024  # above what Ray inlines: values live in the nodes' object stores

SETTINGS = {
    "raydag.speculation.enabled": True,
    "raydag.speculation.quantile": None,
    "raydag.speculation.long-task": "1s",
    "raydag.speculation.min-runtime": "0.5s",
    "raydag.record.enabled": True,
}


HANG = 45.0  # what a task "hanging" on a slowed node sleeps (then it ends: no leftovers)


def spin(label: str, log: str | None, seconds: float, slow: bool | float, *deps: Any) -> np.ndarray:
    """Sleep ``seconds``, times ``RAYDAG_TEST_SLOWDOWN`` on a slowed node when ``slow`` is
    True; when ``slow`` is a number, that many times on a node with the variable set
    (``math.inf``: hang there, ``HANG`` seconds)."""
    node = ray.get_runtime_context().get_node_id() if log else ""
    if log:
        _note(log, "start", label, node)
    slowed = "RAYDAG_TEST_SLOWDOWN" in os.environ
    if slow is True:
        factor = float(os.environ.get("RAYDAG_TEST_SLOWDOWN", "1"))
    else:
        factor = float(slow) if slow and slowed else 1.0
    time.sleep(HANG if factor == float("inf") else seconds * factor)
    out = np.full(NBYTES // 8, float(len(label)) + sum(float(d[0]) for d in deps))
    if log:
        _note(log, "end", label, node)
    return out


def _note(log: str, kind: str, label: str, node: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{kind} {label} {node} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


def runs(log: str) -> list[tuple[str, str, str, float]]:
    """(kind, label, node, time) per line of the log."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(k, lab, n, float(t)) for k, lab, n, t in (line.split() for line in f)]


def graph(spec: dict[str, tuple], log: str | None, fast: bool = False) -> dict:
    """``spec``: label -> (seconds, slow, deps)."""
    return {
        k: Task(k, spin, k, log, 0.0 if fast else s, slow, *map(TaskRef, deps))
        for k, (s, slow, deps) in spec.items()
    }


def expected(spec: dict[str, tuple], outputs: list) -> list:
    return dask.get(graph(spec, None, fast=True), outputs)


@pytest.fixture(scope="module")
def cluster():
    clusters = Clusters()  # the workers import this module's task function
    try:
        c = clusters.get()
        ensure_nodes(c, 2)  # and a third, slowed
        slowed = c.add_node(env_vars={"RAYDAG_TEST_SLOWDOWN": str(SLOWDOWN)})
        SLOWED.append(slowed.node_id)
        with dask.config.set(SETTINGS):
            yield c
    finally:
        clusters.close()


@pytest.fixture
def log():
    fd, path = tempfile.mkstemp(prefix="rdg-spec-", suffix=".log", dir="/tmp")
    os.close(fd)
    os.unlink(path)
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_slowed_node_is_overtaken_by_a_duplicate(cluster, log):
    """Three 3 s tasks, one per node; on the slowed node it would take 15 s."""
    slow = SLOWED[-1]
    spec = {f"long-{i}": (3.0, True, ()) for i in range(3)}
    outputs = list(spec)
    t0 = time.monotonic()
    got = raydag.ray_get(graph(spec, log), outputs)
    took = time.monotonic() - t0
    assert_same(got, expected(spec, outputs))
    del got
    rs = runs(log)
    on_slow = [lab for k, lab, n, _ in rs if k == "start" and n == slow]
    assert len(on_slow) == 1, rs  # Ray spread the three over the three nodes
    (label,) = on_slow
    starts = [(n, t) for k, lab, n, t in rs if k == "start" and lab == label]
    ends = [(n, t) for k, lab, n, t in rs if k == "end" and lab == label]
    assert len(starts) == 2 and starts[1][0] != slow, starts  # a copy on another node
    assert [n for n, _ in ends] == [starts[1][0]], ends  # it won; the slow copy was stopped
    # from the first task's start (a fresh cluster takes seconds to start workers)
    span = max(t for *_, t in rs) - min(t for *_, t in rs)
    assert span < 3.0 * SLOWDOWN - 3.0, (span, took, rs)
    ev = raydag.last_run().events
    won = ev[ev.event == "won"]
    assert list(won.key) == [label] and won.duration.iloc[0] >= 0
    cancelled = ev[(ev.event == "cancelled") & (ev.key == label)]
    assert list(cancelled.reason) == ["superseded"] and not cancelled.duplicate.any()
    assert raydag.last_run().summary()["duplicates_won"] == 1
    assert_stores_empty()


def _two_copies(log: str, label: str, run: Background) -> list:
    """The starts of ``label``'s copies (node, time), once two run (the first, a
    duplicate) and the duplicate has had a second to read its inputs."""
    deadline = time.monotonic() + 60
    while (
        len(starts := [(n, t) for k, lab, n, t in runs(log) if lab == label and k == "start"]) < 2
    ):
        assert time.monotonic() < deadline and not run.done.is_set(), f"no duplicate of {label}"
        time.sleep(0.05)
    time.sleep(1.0)
    return starts


def test_original_node_killed_while_duplicate_runs_restarts_nothing(cluster, log):
    """The long task's first node dies after its duplicate started: the duplicate
    carries on and finishes; the task never starts a third time."""
    spec = {"short-0": (0.3, False, ()), "short-1": (0.3, False, ()), "long": (8.0, False, ())}
    spec["sum"] = (0.1, False, ("short-0", "short-1", "long"))
    outputs = ["sum"]
    run = Background(lambda: raydag.ray_get(graph(spec, log), outputs))
    starts = _two_copies(log, "long", run)
    t_kill = time.time()
    cluster.kill(cluster.by_id(starts[0][0]))
    assert_same(run.result(120), expected(spec, outputs))
    rs = runs(log)
    long_starts = [(n, t) for k, lab, n, t in rs if k == "start" and lab == "long"]
    long_ends = [(n, t) for k, lab, n, t in rs if k == "end" and lab == "long"]
    # no restart from scratch: one first copy; a later start is a duplicate of the
    # survivor (tail speculation on the CPUs the death left idle), which it outran
    ev = raydag.last_run().events
    assert not ((ev.event == "retried") & (ev.key == "long")).any(), long_starts
    assert len(long_starts) >= 2, long_starts
    assert long_ends and long_ends[0][0] == starts[1][0], long_ends
    # it ended a full run after the duplicate began, well before a restart could have
    assert long_ends[0][1] < t_kill + 8.0 - 0.5, (long_ends, t_kill)
    won = raydag.last_run().events.query("event == 'won'")
    assert list(won.key) == ["long"] and won.duration.iloc[0] > 0.5
    assert_stores_empty()
    cluster.add_node()


def test_no_duplicate_while_every_cpu_is_busy(cluster, log):
    """Three tasks on three CPUs: while all run, no CPU is idle, so no copy starts."""
    spec = {f"busy-{i}": (2.5, False, ()) for i in range(3)}
    outputs = list(spec)
    got = raydag.ray_get(graph(spec, log), outputs)
    assert_same(got, expected(spec, outputs))
    del got
    ev = raydag.last_run().events
    first_end = ev[ev.event == "finished"].time.min()
    early = ev[(ev.event == "duplicated") & (ev.time < first_end)]
    assert early.empty, early
    starts = [lab for k, lab, _, _ in runs(log) if k == "start"]
    # a copy may start in the tail, once a CPU is free, but none while all were busy
    assert sorted(set(starts)) == sorted(spec)
    assert_stores_empty()


def test_speculation_off_switch(cluster, log):
    spec = {f"long-{i}": (3.0, True, ()) for i in range(3)}
    outputs = list(spec)
    with dask.config.set({"raydag.speculation.enabled": False}):
        got = raydag.ray_get(graph(spec, log), outputs)
    assert_same(got, expected(spec, outputs))
    del got
    starts = [lab for k, lab, _, _ in runs(log) if k == "start"]
    assert sorted(starts) == sorted(spec)  # each once: no duplicate
    assert raydag.last_run().events.query("event == 'duplicated'").empty
    assert_stores_empty()


DEFAULTS = {  # raydag.yaml's: as a new user runs it
    "raydag.speculation.quantile": 0.95,
    "raydag.speculation.long-task": "10 minutes",
    "raydag.speculation.min-runtime": "10s",
}


def _first_copies_on(rs: list, node: str) -> set[str]:
    """Labels whose first run started on ``node``."""
    first: dict[str, str] = {}
    for k, lab, n, _ in sorted(rs, key=lambda r: r[3]):
        if k == "start":
            first.setdefault(lab, n)
    return {lab for lab, n in first.items() if n == node}


def _overtaken(rs: list, node: str) -> set[str]:
    """Labels first run on ``node`` whose result came from another node, per the
    record: a duplicate won, and the copy on ``node`` was cancelled as superseded."""
    ev = raydag.last_run().events
    won = set(ev[ev.event == "won"].key)
    cancelled = set(ev[(ev.event == "cancelled") & (ev.reason == "superseded")].key)
    ended_elsewhere = {lab for k, lab, n, _ in rs if k == "end" and n != node}
    return _first_copies_on(rs, node) & won & cancelled & ended_elsewhere


def test_slowed_node_at_the_defaults(cluster, log):
    """Six 1.5-s tasks of one category on three nodes, one 5x slower, at raydag.yaml's
    settings: the slowed node's first task would take 7.5 s alone; at the tail (about
    3 s in) it is overdue, duplicated on an idle CPU, and the compute, its last task too,
    ends before that first copy would have (a loaded machine stretches the rounds of
    1.5 s before the tail, about 5 s here: the margin is the slowdown's, not theirs)."""
    slow = SLOWED[-1]
    spec = {f"work-{i}": (1.5, True, ()) for i in range(6)}
    spec["total"] = (0.05, False, tuple(spec))
    with dask.config.set(DEFAULTS):
        got = raydag.ray_get(graph(spec, log), ["total"])
    assert_same(got, expected(spec, ["total"]))
    del got
    rs = runs(log)
    assert _first_copies_on(rs, slow), rs  # Ray spread the first three over the nodes
    slowed_start = min(t for k, _, n, t in rs if k == "start" and n == slow)
    ended = max(t for k, lab, _, t in rs if k == "end" and lab == "total")
    assert ended - slowed_start < 1.5 * SLOWDOWN, (ended - slowed_start, rs)
    assert _overtaken(rs, slow), (rs, raydag.last_run().events)
    s = raydag.last_run().summary()
    assert s["duplicates"] >= 1 and s["duplicates_won"] >= 1, s
    assert_stores_empty()


def test_hung_node_never_hangs_the_compute(cluster, log):
    """Every task hangs on the slowed node (for HANG s): its copy is duplicated
    elsewhere, the compute ends long before the hung task would, and the hung copy is
    cancelled: the node's CPU is free again at once (no worker left sleeping on it),
    and nothing stays in the stores."""
    slow = SLOWED[-1]
    spec = {f"work-{i}": (0.5, math.inf, ()) for i in range(6)}
    spec["total"] = (0.05, math.inf, tuple(spec))
    t0 = time.monotonic()
    with dask.config.set(DEFAULTS):
        got = raydag.ray_get(graph(spec, log), ["total"])
    took = time.monotonic() - t0
    assert_same(got, expected(spec, ["total"]))
    del got
    rs = runs(log)
    assert not [lab for k, lab, n, _ in rs if k == "end" and n == slow], rs
    assert took < HANG / 2, (took, rs)
    hung = _first_copies_on(rs, slow)
    assert hung and _overtaken(rs, slow) == hung, (hung, rs)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 3, ray.available_resources()
    assert_stores_empty()


def test_insured_again_though_its_input_went_with_the_first_copys_node(cluster, log):
    """``long`` reads ``load`` (in the object store) and runs first where ``load`` was
    made; its duplicate starts on a second node. The first node dies, and ``load``'s
    only stored copy with it, but the duplicate has read it: Ray makes that copy the
    new primary, so the state machine keeps ``load`` and insures the duplicate again,
    on the third node, which fetches ``load`` from the second (Ray's pull of it,
    begun while the dead node was its location, retries about 10 s later: ``long`` runs
    20 s). Nothing is recomputed, no recovery wave runs, ``long`` never starts from
    scratch. Skipped when Ray ran the first copy away from ``load``: alone it ran
    there in each of 5 runs, after the module's other tests in fewer than half of
    this session's. (Last in the module: the node it kills may be the slowed one.)"""
    spec = {"short-0": (0.3, False, ()), "short-1": (0.3, False, ()), "load": (0.3, False, ())}
    spec["long"] = (20.0, False, ("load",))
    spec["sum"] = (0.1, False, ("short-0", "short-1", "long", "load"))  # load is kept
    run = Background(lambda: raydag.ray_get(graph(spec, log), ["sum"]))
    starts = _two_copies(log, "long", run)
    (made_on,) = [n for k, lab, n, _ in runs(log) if lab == "load" and k == "end"]
    first, survivor = starts[0][0], starts[1][0]
    if first != made_on:  # Ray ran the first copy elsewhere: nothing to test
        run.result(120)
        pytest.skip(f"long's first copy ran away from load ({starts}, {made_on})")
    t_kill = time.time()
    cluster.kill(cluster.by_id(first))
    assert_same(run.result(120), expected(spec, ["sum"]))
    rs = runs(log)
    assert [lab for k, lab, _, _ in rs if k == "start"].count("load") == 1, rs  # not made again
    later = [(n, t) for k, lab, n, t in rs if lab == "long" and k == "start" and t > t_kill]
    assert later and later[0][0] not in (first, survivor), (later, starts)  # it read load
    ends = [n for k, lab, n, _ in rs if lab == "long" and k == "end"]
    assert ends[:1] == [survivor], (ends, survivor)  # the duplicate ran on and won
    ev = raydag.last_run().events
    assert not ((ev.event == "retried") & (ev.key == "long")).any(), ev
    assert raydag.last_run().summary()["recovery_waves"] == 0, raydag.last_run().summary()
    assert_stores_empty()
    cluster.add_node()
