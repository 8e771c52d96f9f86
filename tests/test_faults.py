"""Recovery on a real multi-node Ray cluster: nodes SIGKILLed mid-run, workers killed, lineage capped.

Every task here notes each of its runs (start and end, node, pid, time) in a file under
/tmp, which all nodes share (each node has its own TMPDIR, so not there). raydag's
recovery waves come from its log. From the runs alone, ``expected_recovery`` works out
what a dead node took that was still needed, so each test checks, independently of
raydag's own bookkeeping:

- the result equals dask's sync scheduler's on the same graph (with no sleeps);
- the object stores end empty;
- one recovery wave per node death that lost needed results, and none otherwise;
- the tasks run again are exactly the lost results still needed, plus the released
  inputs those need; tasks killed while running on the dead node are counted apart.

One cluster (a head without CPUs and 3 one-CPU nodes) serves the module: starting it
costs about 20 s here. Each test starts with 3 alive nodes; a test that kills one adds
a fresh one. The lineage-cap test, last, needs other Ray settings and restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import dask
import numpy as np
import pytest
import ray
from chaos import (
    Background,
    Death,
    Expected,
    MiB,
    RaydagLog,
    Spec,
    T,
    assert_same,
    assert_stores_empty,
    build,
    busiest,
    completions,
    duplicates,
    ensure_nodes,
    expected_recovery,
    expected_values,
    kill,
    less_duplicates,
    note,
    runs,
    spare_copy,
    store_objects,
    wait_until,
    work,
)
from dask.delayed import Delayed
from harness import MultiNodeCluster

import raydag

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

# ray_dask_get runs tasks with Ray's default max_retries=3: four deaths exhaust them.
RAY_DEFAULT_RETRIES = 3


def _import_ray_dask_get() -> Callable:
    """Ray's incumbent scheduler, without the patch its package applies on import: it
    makes every ``dask.persist`` pass ``ray_persist=True``, which raydag.persist (and so
    other test modules of the session) would then warn about."""
    persist, mixin = dask.persist, dask.base.DaskMethodsMixin.persist
    from ray.util.dask import ray_dask_get

    dask.persist, dask.base.DaskMethodsMixin.persist = persist, mixin
    return ray_dask_get


ray_dask_get = _import_ray_dask_get()


# ---- what runs on the workers -------------------------------------------------------


def fragile(label: str, log: str | None, marker: str | None, die: int, fail: int) -> np.ndarray:
    """Kill its own worker (SIGKILL, like the OOM killer) on the first ``die`` attempts,
    then raise on the next ``fail``, then succeed. Attempts are counted in ``marker``."""
    note(log, "start", label)
    attempt = 0
    if marker is not None:
        fd = os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, b"x")
        os.close(fd)
        attempt = os.path.getsize(marker) - 1
    if attempt < die:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt < die + fail:
        raise ValueError(f"{label}: attempt {attempt} fails")
    out = np.full(MiB // 8, float(len(label)))
    note(log, "end", label)
    return out


# ---- graphs -------------------------------------------------------------------------


def fan_in(n: int, seconds: float, nbytes: int = MiB) -> Spec:
    """``n`` parts read by one final task: the shape of a skim's final merge."""
    spec = {f"part-{i}": T(seconds, nbytes, float(i)) for i in range(n)}
    spec["fanin"] = T(0.2, 8, 0.5, tuple(spec))
    return spec


# ---- what happened: task runs, raydag's log, deaths ---------------------------------


# ---- the expectation ------------------------------------------------------------------


def check_recovery(
    spec: Spec,
    outputs: Iterable[str],
    log: str,
    rlog: RaydagLog,
    deaths: list[Death],
    given: Mapping[str, str] | None = None,
    since: float = 0.0,
) -> Expected:
    """Assert waves and re-executions against ``expected_recovery``; return it for more."""
    for d in deaths:
        if d.t_seen is None:
            d.t_seen = rlog.seen(d)
    rlog.note_cuts(deaths)
    done = runs(log, since)
    exp = expected_recovery(spec, outputs, done, deaths, given)
    waves = rlog.waves()
    got = less_duplicates(completions(log, since), exp.completions)
    killed = [r.label for rs in exp.running for r in rs]
    t0 = min((r.start for r in done), default=0.0)
    odd = sorted(set(got - exp.completions) | set(exp.completions - got))
    # The runs of the odd keys, and of the lost ones and their readers: who held what.
    lost = set().union(*exp.lost)
    readers = {k for k, t in spec.items() if lost.intersection(t.deps)}
    shown = [*odd, *sorted((lost | readers) - set(odd))]
    details = "".join(
        f"\n  {k}: "
        + ", ".join(
            f"{r.node[:8]} {r.start - t0:.2f}-{'' if r.end is None else f'{r.end - t0:.2f}'}"
            for r in done
            if r.label == k
        )
        for k in shown
    )
    summary = (
        f"deaths (node, killed, noticed): "
        f"{[(d.node[:8], round(d.t_kill - t0, 2), round((d.t_seen or 0) - t0, 2)) for d in deaths]}\n"
        f"waves: {waves}\n"
        f"expected lost: {[sorted(x) for x in exp.lost]}\n"
        f"expected recompute: {[sorted(x) for x in exp.recompute]}\n"
        f"killed while running on the dead node: {killed}\n"
        f"raydag judged: {rlog.judged()}\n"
        f"completions - expected: {dict(got - exp.completions)}, "
        f"expected - completions: {dict(exp.completions - got)}"
        f"{details}"
    )
    print(summary)
    assert len(waves) == exp.waves, (
        f"one recovery wave per death that lost needed results\n{summary}"
    )
    assert not odd, (  # not got == exp.completions: pytest's diff would hide the summary
        f"re-executed tasks are not the lost ones still needed\n{summary}"
    )
    # Every run killed with its node finished later, once, elsewhere; a speculative copy
    # of a key another run made needs no rerun (the driver cancels or drops it).
    dups = duplicates()
    for r in (r for rs in exp.running for r in rs):
        assert spare_copy(r, done, dups) or any(
            x.label == r.label and x.end is not None and x.start > r.start for x in done
        ), r
    # raydag's own counts agree, wave by wave, with the deaths that lost something.
    lossy = [i for i, lost in enumerate(exp.lost) if lost]
    for w, i in zip(waves, lossy, strict=False):
        assert (w.lost, w.recompute) == (len(exp.lost[i]), len(exp.recompute[i])), summary
    return exp


# ---- the cluster and the chaos ----------------------------------------------------------


@pytest.fixture(scope="module")
def logdir():
    path = tempfile.mkdtemp(prefix="rdg-faults-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def logs(logdir, request):
    """A fresh note file per phase of a test: ``logs("compute")`` gives its path."""

    def path(phase: str = "compute") -> str:
        return os.path.join(logdir, f"{request.node.name}-{phase}.log".replace("/", "_"))

    return path


@pytest.fixture
def rlog():
    handler = RaydagLog()
    logger = logging.getLogger("raydag.runtime")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # the keys each wave lost or kept are debug lines
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def cluster(clusters):
    c = clusters.get()
    ensure_nodes(c)
    return c


# ---- node deaths ------------------------------------------------------------------------


def test_node_killed_during_map_stage(cluster, logs, rlog):
    """Lost map outputs (needed: they are the outputs) rerun with the loads they read."""
    c, log = cluster, logs()
    spec: dict[str, T] = {}
    for i in range(24):
        spec[f"load-{i}"] = T(0.25, MiB, float(i))
        spec[f"map-{i}"] = T(0.25, MiB, 100.0, (f"load-{i}",))
    outputs = [f"map-{i}" for i in range(24)]

    bg = Background(lambda: raydag.ray_get(build(spec, log), outputs))
    wait_until(lambda: sum(completions(log)[k] for k in outputs) >= 8, "8 maps", bg)
    death = kill(c, busiest(c, log, lambda k: k.startswith("map-")))
    c.add_node()
    got = bg.result()

    assert_same(got, expected_values(spec, outputs))
    exp = check_recovery(spec, outputs, log, rlog, [death])
    assert exp.waves == 1, "the dead node held finished maps: the test needs a loss"
    del got
    assert_stores_empty()


def test_node_killed_during_fan_in_of_120(cluster, logs, rlog):
    """120 parts of 1 MiB read by one task: only the dead node's parts rerun, in one wave."""
    c, log = cluster, logs()
    spec = fan_in(120, 0.1)
    outputs = ["fanin"]

    bg = Background(lambda: raydag.ray_get(build(spec, log), outputs))
    wait_until(lambda: sum(completions(log).values()) >= 60, "60 parts", bg)
    death = kill(c, busiest(c, log, lambda k: k.startswith("part-")))
    c.add_node()
    got = bg.result()

    assert_same(got, expected_values(spec, outputs))
    exp = check_recovery(spec, outputs, log, rlog, [death])
    assert exp.waves == 1 and len(exp.lost[0]) >= 5
    del got
    assert_stores_empty()


def test_node_killed_after_persist(cluster, logs, rlog):
    """Only the dead node's persisted pieces rerun (with their inputs), in one wave; the
    persisted collection is healed in place: computing it again reruns nothing."""
    c, log = cluster, logs()  # one note file: recomputed pieces note where they first did
    n = 12
    spec: dict[str, T] = {}
    for i in range(n):
        spec[f"pload-{i}"] = T(0.2, MiB, float(i))
        spec[f"pmap-{i}"] = T(0.2, MiB, 10.0, (f"pload-{i}",))
    persisted_keys = [f"pmap-{i}" for i in range(n)]
    dsk = build(spec, log)
    persisted = raydag.persist(*[Delayed(k, dsk) for k in persisted_keys])
    holder = {r.label: r.node for r in runs(log) if r.end is not None}
    assert store_objects() >= n

    victim = busiest(c, log, lambda k: k.startswith("pmap-"))
    death = kill(c, victim)
    c.add_node()
    on_dead = {k for k in persisted_keys if holder[k] == victim}
    assert on_dead, "the killed node held no persisted piece"

    # A later compute reads the persisted pieces, one consumer each, then sums them.
    full = dict(spec)
    for i in range(n):
        full[f"post-{i}"] = T(0.1, 8, 1.0, (f"pmap-{i}",))
    full["sum"] = T(0.1, 8, 0.0, tuple(f"post-{i}" for i in range(n)))
    expected = expected_values(full, ["sum"])

    def later(p: tuple) -> Any:
        posts = [
            dask.delayed(partial(work, f"post-{i}"))(
                log, 0.1, 8, 1.0, p[i], dask_key_name=f"post-{i}"
            )
            for i in range(n)
        ]
        total = dask.delayed(partial(work, "sum"))(log, 0.1, 8, 0.0, *posts, dask_key_name="sum")
        return Background(lambda: dask.compute(total, scheduler=raydag.ray_get)[0]).result(60)

    rlog.clear()
    t1 = time.time()
    got = later(persisted)
    assert_same([got], expected)
    # The node died between computes: raydag notices when the compute starts.
    death.t_seen = min((w.t for w in rlog.waves()), default=t1)
    given = {k: holder[k] for k in persisted_keys}
    exp = check_recovery(full, ["sum"], log, rlog, [death], given=given, since=t1)
    assert exp.lost == [on_dead]

    rlog.clear()
    t2 = time.time()
    got = later(persisted)
    assert_same([got], expected)
    assert not rlog.waves()
    assert completions(log, since=t2) == Counter({f"post-{i}": 1 for i in range(n)} | {"sum": 1}), (
        "the healed collection must not rerun anything"
    )

    del persisted, got
    assert_stores_empty()


def test_node_killed_while_a_merge_fetches_its_inputs(cluster, logs, rlog):
    """Groups of parts, each merged: the node holding most of a group dies just as the
    group's merge is submitted. Ray turns the lost parts into errors, which the merge's
    node fetches; the lost parts must still all be recomputed in the one wave.

    A race: it shows raydag's bug (one wave per lost part) in about 2 runs out of 3 here.
    """
    c, log = cluster, logs()
    spec: dict[str, T] = {}
    for g in range(3):
        for i in range(16):
            spec[f"part-{g}-{i}"] = T(0.15, 4 * MiB, float(i))
        spec[f"merge-{g}"] = T(0.2, MiB, 0.0, tuple(f"part-{g}-{i}" for i in range(16)))
    spec["final"] = T(0.1, 8, 0.0, tuple(f"merge-{g}" for g in range(3)))
    outputs = ["final"]

    def group_done(g: int) -> bool:
        done = completions(log)
        return all(done[f"part-{g}-{i}"] for i in range(16))

    def go() -> Any:
        # Any poll interval must do; a slower one widens the race.
        with dask.config.set({"raydag.scheduling.cluster-poll-interval": "1s"}):
            return raydag.ray_get(build(spec, log), outputs)

    bg = Background(go)
    # dask.order finishes one group before the next: kill when the first group is done
    (first, *_) = wait_until(lambda: [g for g in range(3) if group_done(g)], "a group", bg)
    death = kill(c, busiest(c, log, lambda k: k.startswith(f"part-{first}-")))
    c.add_node()
    got = bg.result()

    assert_same(got, expected_values(spec, outputs))
    # The merge may have fetched some parts before the kill, unseen by the notes: so
    # only "every rerun part was made on the dead node", not exactly which ones.
    reran = {k for k, n in completions(log).items() if n > 1}
    on_dead = {r.label for r in runs(log) if r.node == death.node and r.end is not None}
    # A part that noted its end on the dead node just before the kill, but whose result
    # never reached the driver, is retried as running there: not a recomputation.
    cut = rlog.cut(death.t_kill)
    waves = rlog.waves()
    print(f"waves: {waves}\nreran: {sorted(reran)}\ncut: {sorted(cut)}")
    assert reran <= on_dead
    recomputed = reran - cut
    assert len(waves) == (1 if recomputed else 0), f"one wave for one death: {waves}"
    del got
    assert_stores_empty()


def test_two_nodes_killed_in_succession(cluster, logs, rlog):
    """Two deaths, then two new nodes: two waves, each rerunning what that death lost.

    The new nodes join after the second death, not one between them: starting a node
    took 33 s once on a loaded machine (Ray's deadline missed, the harness retrying),
    and the compute had ended before the second kill, which it never saw.
    """
    c, log = cluster, logs()
    spec = fan_in(90, 0.15)
    outputs = ["fanin"]

    bg = Background(lambda: raydag.ray_get(build(spec, log), outputs))
    wait_until(lambda: sum(completions(log).values()) >= 25, "25 parts", bg)
    first = kill(c, busiest(c, log, lambda k: k.startswith("part-")))
    wait_until(lambda: sum(completions(log).values()) >= 55, "55 parts", bg)
    second = kill(c, busiest(c, log, lambda k: k.startswith("part-")))
    c.add_node()
    c.add_node()
    got = bg.result()

    assert_same(got, expected_values(spec, outputs))
    exp = check_recovery(spec, outputs, log, rlog, [first, second])
    assert exp.waves == 2
    del got
    assert_stores_empty()


def _dead_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if not n["Alive"]}


def test_node_added_mid_run(cluster, logs, rlog):
    """A node joining mid-run gets work: more tasks run at once; nothing reruns."""
    c, log = cluster, logs()
    spec = fan_in(120, 0.4)  # 16 s on 3 CPUs: a node takes 3-10 s to start here
    outputs = ["fanin"]
    dead_before = _dead_nodes()

    bg = Background(lambda: raydag.ray_get(build(spec, log), outputs))
    wait_until(lambda: sum(completions(log).values()) >= 3, "3 parts", bg)
    new = c.add_node()
    got = bg.result()

    assert_same(got, expected_values(spec, outputs))
    done = runs(log)
    on_new = [r.label for r in done if r.node == new.node_id and r.label.startswith("part-")]
    assert on_new, "no part ran on the node added mid-run"
    # Added capacity, not a swap: raydag's decision is the number of Ray tasks it keeps
    # in flight, which must grow to the new node's CPUs as well (counted in the record,
    # transition by transition). Where Ray then puts them is Ray's: on a loaded machine
    # it has stacked two on one node while another idled for a moment, so the runs need
    # only show the new node working beside the others, not beside every one at once.
    died = _dead_nodes() - dead_before
    alive_cpus = 4 - len(died)
    ev = raydag.last_run().events
    capacity = ev[ev.event == "capacity"]
    assert len(capacity) and capacity.slots.iloc[-1] >= alive_cpus, capacity
    first = ev[ev.event == "submitted"].groupby("group").seq.min()
    ends = ["finished", "superseded", "retried", "failed", "cancelled"]
    ended = ev[ev.event.isin(ends)].groupby("group").seq.min()
    steps = sorted([(s, 1) for s in first] + [(s, -1) for s in ended])
    after = capacity[capacity.slots >= alive_cpus].seq.iloc[0]
    level, widest = 0, 0
    for seq, step in steps:
        level += step
        if seq >= after:
            widest = max(widest, level)
    assert widest >= alive_cpus, f"at most {widest} Ray tasks in flight after the node joined"
    width = max(
        len(
            {
                s.node
                for s in done
                if s.start < (r.end or math.inf) and (s.end or math.inf) > r.start
            }
        )
        for r in done
        if r.node == new.node_id
    )
    assert width >= 2, "the new node's parts ran alone, after the others"
    # The harness's health checks notice a crash in about 1.5 s, so a loaded machine
    # can get a live node declared dead (seen once: a node that had just joined and
    # taken part-80 was marked dead and its raylet ended). Then only the tasks that
    # ran on such nodes may run again, in at most one wave per death.
    made = completions(log)
    if died:
        logging.getLogger(__name__).warning("nodes died during the test: %s", died)
        again = {r.label for r in done if r.node in died}
        assert len(rlog.waves()) <= len(died), (rlog.waves(), died)
        assert set(made) == set(spec), made
        assert all(n == 1 or k in again for k, n in made.items()), (made, again)
    else:
        assert not rlog.waves()
        assert made == Counter(dict.fromkeys(spec, 1))
    del got
    assert_stores_empty()


def repeated_deaths(c: MultiNodeCluster, log: str, bg: Background, deaths: int) -> list[Death]:
    """Kill the node running ``long`` each time it starts anew, ``deaths`` times.

    The replacements are added before the compute: a node takes 3-10 s to start here,
    long enough for ``long`` to finish on another node meanwhile.
    """
    assert len(c.alive) > deaths
    out: list[Death] = []
    seen_pids: set = set()
    for _ in range(deaths):

        def fresh_start():
            alive = {n.node_id for n in c.alive}  # the replacements too
            return next(
                (
                    r
                    for r in runs(log)
                    if r.label == "long"
                    and r.pid not in seen_pids
                    and r.end is None
                    and r.node in alive
                ),
                None,
            )

        r = wait_until(fresh_start, "long to start again", bg)
        seen_pids.add(r.pid)
        time.sleep(0.3)
        out.append(kill(c, r.node))
    return out


def long_spec() -> Spec:
    spec = {f"side-{i}": T(0.2, MiB, float(i)) for i in range(6)}
    spec["long"] = T(3.0, MiB, 1000.0)
    spec["final"] = T(0.1, 8, 0.0, ("long", *(f"side-{i}" for i in range(6))))
    return spec


def test_repeated_deaths_of_the_nodes_running_one_task(cluster, logs, rlog):
    """A node's death is not the task's fault: four deaths under ``long`` do not use up its
    retries (3)."""
    c = cluster
    spec, outputs = long_spec(), ["final"]
    n_deaths = RAY_DEFAULT_RETRIES + 1

    log = logs("raydag")
    ensure_nodes(c, 3 + n_deaths)
    bg = Background(lambda: raydag.ray_get(build(spec, log), outputs))
    deaths = repeated_deaths(c, log, bg, n_deaths)
    got = bg.result()
    assert_same(got, expected_values(spec, outputs))
    # a copy after each death; tail speculation may add duplicates beside them
    ev = raydag.last_run().events
    duplicates = ((ev.event == "duplicated") & (ev.key == "long")).sum()
    ran = sum(r.label == "long" for r in runs(log))
    assert n_deaths + 1 <= ran <= n_deaths + 1 + duplicates, (ran, duplicates)
    check_recovery(spec, outputs, log, rlog, deaths)
    del got
    assert_stores_empty()


@pytest.mark.parametrize("consumer_bytes", [MiB, 8], ids=["in-store", "inlined"])
def test_consumed_results_lost_are_not_rerun(cluster, logs, rlog, consumer_bytes):
    """A dead node holding only values that nothing needs any more costs nothing: no wave,
    no rerun. Still-needed values that survive (a copy on the node reading them, or small
    enough to live in the driver's memory) are not lost either."""
    c, log = cluster, logs()
    spec: dict[str, T] = {}
    for i in range(9):
        spec[f"a-{i}"] = T(0.2, MiB, float(i))
        spec[f"s-{i}"] = T(0.1, consumer_bytes, 0.0, (f"a-{i}",))
    # Long enough for the driver to notice the death before it ends, even on a busy machine.
    spec["tail"] = T(6.0, 8, 0.0, tuple(f"s-{i}" for i in range(9)))
    outputs = ["tail"]

    bg = Background(lambda: raydag.ray_get(build(spec, log), outputs))
    tail = wait_until(
        lambda: next((r for r in runs(log) if r.label == "tail"), None), "tail to start", bg
    )
    time.sleep(0.2)
    death = kill(c, busiest(c, log, lambda k: k.startswith("a-"), exclude=[tail.node]))
    c.add_node()
    got = bg.result()

    assert_same(got, expected_values(spec, outputs))
    exp = check_recovery(spec, outputs, log, rlog, [death])
    assert death.t_seen is not None, "the compute ended before the driver saw the death"
    dups, done = duplicates(), runs(log)
    assert exp.waves == 0 and not [r for r in exp.running[0] if not spare_copy(r, done, dups)]
    once = Counter(dict.fromkeys(spec, 1))
    assert less_duplicates(completions(log), once) == once
    del got
    assert_stores_empty()


# ---- worker processes killed, user errors ------------------------------------------------


def fragile_task(logdir: str, label: str, die: int, fail: int, log: str | None = None):
    marker = os.path.join(logdir, f"{label}.attempts")
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker)
    # The label rides in a partial: dask before 2025.4 reads a string argument equal to
    # a key as a reference to it, here a cycle.
    return dask.delayed(partial(fragile, label))(log, marker, die, fail, dask_key_name=label)


def attempts(logdir: str, label: str) -> int:
    path = os.path.join(logdir, f"{label}.attempts")
    return os.path.getsize(path) if os.path.exists(path) else 0


def test_worker_killed_once_is_retried(cluster, logdir, rlog):
    """SIGKILL of the worker (as the OOM killer does) on the first attempt: the retry succeeds."""
    x = fragile_task(logdir, "fragile-1", die=1, fail=0)
    (got,) = dask.compute(x, scheduler=raydag.ray_get)
    (expected,) = dask.compute(
        dask.delayed(fragile)("fragile-1", None, None, 0, 0), scheduler="sync"
    )
    np.testing.assert_array_equal(got, expected)
    assert attempts(logdir, "fragile-1") == 2
    assert not rlog.waves()
    del got
    assert_stores_empty()


def test_task_that_always_kills_its_worker_fails_clearly(cluster, logdir):
    """1 + raydag.retries attempts, then a WorkerDiedError naming the key and its
    category. Each death costs about 5 s here (Ray notices, a new worker starts), so
    the limit is 1, not the default 3; tests/test_state.py counts to any limit."""
    assert dask.config.get("raydag.retries") == 3  # the documented default
    x = fragile_task(logdir, "fragile-2", die=99, fail=0)
    with dask.config.set({"raydag.retries": 1}), pytest.raises(raydag.WorkerDiedError) as info:
        dask.compute(x, scheduler=raydag.ray_get)
    assert attempts(logdir, "fragile-2") == 1 + 1
    msg = str(info.value)
    assert "'fragile-2'" in msg and "category 'fragile'" in msg, msg
    assert_stores_empty()

    # The annotation raises one task's limit above the configured one.
    with dask.annotate(retries=2):
        x = fragile_task(logdir, "fragile-3", die=2, fail=0)
    with dask.config.set({"raydag.retries": 0}):
        (got,) = dask.compute(x, scheduler=raydag.ray_get)
    assert attempts(logdir, "fragile-3") == 3
    assert float(got[0]) == len("fragile-3")
    del got
    assert_stores_empty()


def test_user_exception_not_retried_unless_annotated(cluster, logdir):
    x = fragile_task(logdir, "flaky-1", die=0, fail=1)
    with pytest.raises(ValueError, match="attempt 0 fails"):
        dask.compute(x, scheduler=raydag.ray_get)
    assert attempts(logdir, "flaky-1") == 1

    with dask.annotate(retries=2):
        x = fragile_task(logdir, "flaky-1", die=0, fail=2)
    (got,) = dask.compute(x, scheduler=raydag.ray_get)
    assert attempts(logdir, "flaky-1") == 3
    assert float(got[0]) == len("flaky-1")
    del got
    assert_stores_empty()


# ---- lineage beyond Ray's cap (last: it restarts the cluster) ------------------------------

# Ray drops the lineage of objects beyond this many bytes of task specs per owner
# (RAY_max_lineage_bytes, 1 GB by default; 300k pickled dask tasks exceed it).
SMALL_LINEAGE = {"max_lineage_bytes": 10_000}


def test_lineage_beyond_rays_cap(clusters, logs, rlog):
    """With Ray's lineage cap hit, Ray cannot rebuild what a dead node took: ray_dask_get
    fails; raydag recomputes from its own graph, whether it owns recovery or lets Ray try
    first (``raydag.recovery.ray-first``) and steps in when Ray gives up."""
    c = clusters.get(SMALL_LINEAGE)
    spec, outputs = fan_in(30, 0.3), ["fanin"]
    expected = expected_values(spec, outputs)
    outcomes = {}
    for contender in ("ray_dask_get", "raydag", "raydag ray-first"):
        ensure_nodes(c)
        rlog.clear()
        log = logs(contender.replace(" ", "-"))
        if contender == "ray_dask_get":
            bg = Background(lambda log=log: ray_dask_get(build(spec, log), outputs))
        else:
            ray_first = contender.endswith("ray-first")

            def go(log=log, ray_first=ray_first):
                with dask.config.set({"raydag.recovery.ray-first": ray_first}):
                    return raydag.ray_get(build(spec, log), outputs)

            bg = Background(go)
        wait_until(lambda log=log: sum(completions(log).values()) >= 15, "15 parts", bg)
        death = kill(c, busiest(c, log, lambda k: k.startswith("part-")))
        c.add_node()
        outcomes[contender], got = bg.outcome()
        if got is not None:
            assert_same(got, expected)
            del got
        if contender == "raydag":
            exp = check_recovery(spec, outputs, log, rlog, [death])
            assert exp.waves == 1
        if contender != "ray_dask_get":
            assert_stores_empty()
        bg = None
        print(
            f"{contender}: {outcomes[contender]}, waves {rlog.waves()}, completions {sum(completions(log).values())}"
        )
    assert "ObjectReconstructionFailed" in outcomes["ray_dask_get"], outcomes
    assert outcomes["raydag"] == "ok" and outcomes["raydag ray-first"] == "ok", outcomes
