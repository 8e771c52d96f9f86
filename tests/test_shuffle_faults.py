"""raydag's dataframe shuffle on a real multi-node Ray cluster, with nodes SIGKILLed.

The cluster (tests/harness.py via the chaos kit: a head without CPUs, 3 one-CPU
nodes, each with its own TMPDIR) is shared by the module. Partitions are made on the
nodes (``dd.from_map``) and sized so that every piece (a map's share for one reducer)
is far above Ray's 100 KiB inlining threshold: pieces live in the nodes' object
stores and die with them. Each test checks, against pandas, that no row is lost or
duplicated; from raydag's run record, which values a death lost and which were
recomputed (only the lost pieces, by rerunning the maps that made them); and that
the object stores end empty with no file left in the nodes' temp directories.
"""

from __future__ import annotations

import ast
import functools
import gc
import os
import threading
import time
from collections import Counter

import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
import pytest
from chaos import (
    Background,
    assert_stores_empty,
    ensure_nodes,
    kill,
    note,
    primary_objects,
    runs,
    wait_until,
)

import raydag
import raydag.shuffle
from raydag.runtime.stores import store_stats
from raydag.shuffle import MAP, PIECE

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(400)]

ROWS = 40_000  # x 5 columns of 8 bytes: 1.6 MB per partition; pieces of 200-400 kB


# ---- what runs on the nodes -------------------------------------------------------------


def make_part(i: int, rows: int, seconds: float, log: str | None) -> pd.DataFrame:
    """Input partition ``i``: unique ids ``i * rows + n``, keys with repeats."""
    note(log, "start", f"in-{i}")
    time.sleep(seconds)
    rng = np.random.default_rng(i)
    df = pd.DataFrame(
        {
            "id": np.arange(i * rows, (i + 1) * rows),
            "k": rng.integers(0, 1000, rows),
            "x": rng.normal(size=rows),
            "y": rng.normal(size=rows),
            "z": rng.normal(size=rows),
        }
    )
    note(log, "end", f"in-{i}")
    return df


def slow_out(df: pd.DataFrame, seconds: float, log: str | None, partition_info=None):
    label = f"out-{partition_info['number'] if partition_info else '?'}"
    note(log, "start", label)
    time.sleep(seconds)
    note(log, "end", label)
    return df


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """One row per partition: enough to prove no row lost or duplicated."""
    return pd.DataFrame(
        {
            "rows": [len(df)],
            "unique": [df["id"].nunique()],
            "sum": [int(df["id"].sum())],
            "keys_sum": [int(df["k"].sum())],
        }
    )


# ---- building and checking ----------------------------------------------------------------


def source(n: int, log: str | None, seconds: float = 0.0, rows: int = ROWS) -> dd.DataFrame:
    meta = make_part(0, 0, 0.0, None)
    func = functools.partial(make_part, rows=rows, seconds=seconds, log=log)
    return dd.from_map(func, range(n), meta=meta, enforce_metadata=False)


def expected(n: int, rows: int = ROWS) -> pd.DataFrame:
    return pd.concat([make_part(i, rows, 0.0, None) for i in range(n)], ignore_index=True)


def assert_rows(got: pd.DataFrame, n: int, rows: int = ROWS) -> None:
    """Exactly the input rows, each once, values intact."""
    got = got.sort_values("id").reset_index(drop=True)
    assert len(got) == n * rows, f"{len(got) - n * rows:+d} rows"
    assert got["id"].is_unique
    pd.testing.assert_frame_equal(got[["id", "k", "x", "y", "z"]], expected(n, rows))


def parse(key: str):
    try:
        return ast.literal_eval(key)
    except (ValueError, SyntaxError):
        return key


def is_piece(k) -> bool:
    return isinstance(k, tuple) and str(k[0]).startswith(PIECE)


def is_map(k) -> bool:
    return isinstance(k, tuple) and str(k[0]).startswith(MAP)


def map_of(piece: tuple) -> tuple:
    return (MAP + piece[0][len(PIECE) :], piece[2])


class Recovery:
    """What the last compute's record says a death lost and what it ran again."""

    def __init__(self) -> None:
        rec = raydag.last_run()
        assert rec is not None
        ev = rec.events
        self.waves = int(ev[ev.event == "recovery"].wave.nunique())
        self.lost = {parse(k) for k in ev[ev.event == "lost"].key}
        self.recompute = {parse(k) for k in ev[ev.event == "recovery"].key}
        done = rec.tasks
        self.made_on: dict = {}  # where each value was first made
        for k, n in zip(done.sort_values("end").key, done.sort_values("end").node, strict=True):
            self.made_on.setdefault(parse(k), n)
        # each map bundle run: the pieces it kept
        sub = ev[ev.event == "submitted"]
        self.bundles = [
            {parse(k) for k in g.key if is_piece(parse(k))}
            for _, g in sub.groupby("group")
            if any(is_map(parse(k)) for k in g.key)
        ]

    @property
    def lost_pieces(self) -> set:
        return {k for k in self.lost if is_piece(k)}

    @property
    def recomputed_pieces(self) -> set:
        return {k for k in self.recompute if is_piece(k)}

    @property
    def recomputed_maps(self) -> set:
        return {k for k in self.recompute if is_map(k)}

    def check_only_lost_pieces_rerun(self) -> None:
        """Pieces recomputed are exactly the lost ones still needed, and the maps rerun
        are exactly those that had made them."""
        assert self.recomputed_pieces >= self.lost_pieces
        needed = self.recomputed_pieces - self.lost_pieces
        # any other piece rerun feeds a lost reducer output (its reducer is rerun too)
        reducers = {k for k in self.recompute if not is_piece(k) and not is_map(k)}
        assert all(
            any(isinstance(r, tuple) and len(r) == 2 and r[1] == p[1] for r in reducers)
            for p in needed
        ), (needed, reducers)
        assert self.recomputed_maps == {map_of(p) for p in self.recomputed_pieces}


def node_files(c) -> dict:
    """Files in each alive worker node's TMPDIR (where dask's disk shuffle puts partd)."""
    out = {}
    for n in c.alive:
        for root, _dirs, files in os.walk(n.tmpdir):
            for f in files:
                out[os.path.join(root, f)] = n.name
    return out


# ---- fixtures -------------------------------------------------------------------------


@pytest.fixture
def cluster(clusters):
    c = clusters.get()
    ensure_nodes(c)
    with raydag.shuffle.enable(scheduler=False):
        yield c


@pytest.fixture
def log(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("notes", numbered=True)
    # under /tmp: every node can write there (each has its own TMPDIR, not this)
    return str(d / f"{request.node.name}.log")


def busiest(c, log: str, prefix: str) -> str:
    """The alive worker node that finished the most runs of ``prefix`` tasks."""
    alive = {n.node_id for n in c.alive}
    count = Counter(r.node for r in runs(log) if r.end is not None and r.label.startswith(prefix))
    return max(alive, key=lambda n: count.get(n, 0))


# ---- node deaths ------------------------------------------------------------------------


def test_node_dies_during_the_map_stage(cluster, log):
    """Maps that finished on the dead node lost their pieces: those maps run again,
    keeping only the lost pieces; every row arrives once."""
    c, n, m = cluster, 12, 6
    x = source(n, log, seconds=0.4).shuffle("k", npartitions=m)
    bg = Background(lambda: x.compute(scheduler=raydag.ray_get))
    wait_until(lambda: sum(r.end is not None for r in runs(log)) >= 5, "5 inputs", bg)
    death = kill(c, busiest(c, log, "in-"))
    c.add_node()
    got = bg.result(240)
    assert_rows(got, n)
    r = Recovery()
    assert r.waves >= 1 and r.lost_pieces, "the dead node held no piece: the test needs one"
    assert all(r.made_on.get(k) == death.node for k in r.lost_pieces)
    r.check_only_lost_pieces_rerun()
    del got
    assert_stores_empty()


def test_node_dies_during_the_reduce_stage(cluster, log):
    """Reducers run (slowly) while pieces wait for the others: the dead node's pieces
    still needed are remade by their maps alone; finished reducers are not rerun."""
    c, n, m = cluster, 9, 8
    # The node that ran the most inputs may hold no piece still needed (seen once on a
    # slow host): then the scenario did not arise, and it is tried once more.
    for attempt in (1, 2):
        notes = f"{log}.{attempt}"
        x = source(n, notes).shuffle("k", npartitions=m)
        y = x.map_partitions(slow_out, 0.8, notes, meta=x._meta)
        bg = Background(lambda y=y: y.compute(scheduler=raydag.ray_get))
        started = lambda notes=notes: sum(r.label.startswith("out-") for r in runs(notes))  # noqa: E731
        wait_until(lambda started=started: started() >= 2, "2 reducers", bg)
        kill(c, busiest(c, notes, "in-"))
        c.add_node()
        got = bg.result(240)
        assert_rows(got, n)
        del got
        r = Recovery()
        assert r.waves >= 1
        if r.lost_pieces:
            break
    assert r.lost_pieces, "the dead node held no piece, twice: the test needs one"
    r.check_only_lost_pieces_rerun()
    assert all(len(b) <= m for b in r.bundles)
    assert_stores_empty()


def test_node_dies_after_the_result_was_persisted(cluster, log):
    """The persisted outputs on the dead node are remade from piece j of every map:
    each map reruns keeping only the pieces of lost outputs."""
    c, n, m = cluster, 8, 6
    x = source(n, log).shuffle("k", npartitions=m)
    (p,) = raydag.persist(x)
    held = {k: v.node for k, v in dict(p.__dask_graph__()).items() if hasattr(v, "node")}
    assert len(held) == m
    victim = Counter(held.values()).most_common(1)[0][0]
    on_dead = {k for k, node in held.items() if node == victim}
    kill(c, victim)
    c.add_node()
    got = p.compute(scheduler=raydag.ray_get)
    assert_rows(got, n)
    r = Recovery()
    assert r.waves == 1 and r.lost == on_dead, (r.lost, on_dead)
    lost_j = {k[1] for k in on_dead}
    assert {k[1] for k in r.recomputed_pieces} == lost_j
    assert all({k[1] for k in b} == lost_j for b in r.bundles), r.bundles
    # healed in place: computing it again reruns nothing
    got = p.compute(scheduler=raydag.ray_get)
    assert_rows(got, n)
    assert Recovery().waves == 0
    del got, p
    assert_stores_empty()


def test_node_holding_no_shuffle_data_dies(cluster, log):
    """A node with no CPUs runs nothing and holds nothing: its death changes nothing."""
    c, n = cluster, 8
    idle = c.add_node(cpus=0)
    x = source(n, log, seconds=0.3).shuffle("k", npartitions=5)
    bg = Background(lambda: x.compute(scheduler=raydag.ray_get))
    wait_until(lambda: sum(r.end is not None for r in runs(log)) >= 3, "3 inputs", bg)
    kill(c, idle.node_id)
    got = bg.result(240)
    assert_rows(got, n)
    r = Recovery()
    assert r.waves == 0 and not r.lost and not r.recompute
    del got
    assert_stores_empty()


def test_half_persisted_then_all_then_deleted_mid_shuffle(cluster, log):
    """Half of the outputs persisted, then all computed: both right and independent.
    Then a shuffle of the persisted half is stopped (Ctrl-C) mid-reduce and the
    persisted half dropped: every piece is freed, the stores are back to empty, and
    no file is left in any node's temp directory."""
    c, n, m = cluster, 8, 6
    files = node_files(c)
    x = source(n, log).shuffle("k", npartitions=m)
    (half,) = raydag.persist(x.partitions[: m // 2])
    # The persisted outputs, one primary copy each (raylets free in batches). Nodes may
    # still cache copies they fetched in earlier tests: those are not counted.
    baseline = m // 2
    wait_until(lambda: primary_objects() == baseline, "only the persisted half held", timeout=10)
    full = x.compute(scheduler=raydag.ray_get)
    assert_rows(full, n)
    # raylets free in batches: poll
    wait_until(
        lambda: primary_objects() == baseline, "the full compute's objects freed", timeout=10
    )
    got_half = half.compute(scheduler=raydag.ray_get)
    sync_half = x.partitions[: m // 2].compute(scheduler="sync")
    pd.testing.assert_frame_equal(
        got_half.sort_values("id").reset_index(drop=True),
        sync_half.sort_values("id").reset_index(drop=True),
    )
    del full, got_half, sync_half

    again = half.shuffle("id", npartitions=5)
    y = again.map_partitions(slow_out, 1.0, log, meta=again._meta)
    bg = Background(functools.partial(y.compute, scheduler=raydag.ray_get))
    wait_until(lambda: any(r.label.startswith("out-") for r in runs(log)), "a reducer", bg)
    assert primary_objects() > baseline, "pieces of the second shuffle are held"
    bg.interrupt()
    assert bg.done.is_set()
    with pytest.raises(KeyboardInterrupt):
        bg.result(0)
    del half, again, y, bg
    # The interrupted compute's traceback (kept by the Background thread's error, in a
    # cycle with its frame) still reaches the graph and its persisted inputs: only a
    # collection frees it. raydag itself holds nothing.
    gc.collect()
    assert_stores_empty(timeout=10)
    assert node_files(c) == files, "files left in the nodes' temp directories"


def test_user_exception_surfaces_unchanged_on_the_cluster(cluster, log):
    """An error in a reducer's consumer is raised as it was, once: no retry storm."""
    x = source(6, log).shuffle("k", npartitions=4)
    y = x.map_partitions(explode, meta=x._meta)
    with pytest.raises(ZeroDivisionError, match="partition with key 7"):
        y.compute(scheduler=raydag.ray_get)
    s = raydag.last_run().summary()
    assert s["retries"] == 0 and s["failures"] == 1 and s["recovery_waves"] == 0, s
    assert_stores_empty()


def rename_x(df: pd.DataFrame) -> pd.DataFrame:
    return df.rename(columns={"x": "w"})


def test_two_shuffles_in_one_compute_twice_and_incompatible_partitions(cluster, log):
    """A merge (a shuffle of each side) computed twice on the nodes: right both times,
    nothing left; partitions with other columns than their metadata: a clear error."""
    n = 6
    left = source(n, log)
    right = source(4, None, rows=ROWS // 4).rename(columns={"id": "rid", "x": "rx"})
    right = right[["k", "rid", "rx"]]
    merged = left.merge(right, on="k")
    names = {k[0] for k in merged.__dask_graph__() if isinstance(k, tuple)}
    assert len({x for x in names if x.startswith(MAP)}) == 2
    r = pd.concat([make_part(i, ROWS // 4, 0.0, None) for i in range(4)], ignore_index=True)
    r = r.rename(columns={"id": "rid", "x": "rx"})[["k", "rid", "rx"]]
    want = expected(n).merge(r, on="k").sort_values(["id", "rid"]).reset_index(drop=True)
    for _ in range(2):
        got = merged.compute(scheduler=raydag.ray_get)
        got = got.sort_values(["id", "rid"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(got[list(want.columns)], want)
        del got
        assert_stores_empty()
    bad = left.map_partitions(rename_x, meta=left._meta, enforce_metadata=False).shuffle("k")
    with pytest.raises(raydag.shuffle.IncompatiblePartitionError, match=r"missing \['x'\]"):
        bad.compute(scheduler=raydag.ray_get)
    assert raydag.last_run().summary()["retries"] == 0
    assert_stores_empty()


def explode(df: pd.DataFrame) -> pd.DataFrame:
    if (df["k"] == 7).any():
        raise ZeroDivisionError("partition with key 7")
    return df


# ---- larger than the cluster's object stores ------------------------------------------------


def test_shuffle_larger_than_the_object_stores_spills(clusters, log):
    """~360 MB shuffled through 3 x 80 MB stores (and the head's 80 MB): Ray spills,
    the shuffle completes, every row once; the driver's memory stays bounded (it
    holds refs and per-partition summaries, never the data)."""
    mib = 2**20
    c = clusters.get(store_bytes=80 * mib, head_store_bytes=80 * mib)
    ensure_nodes(c)
    n = m = 10
    rows = 900_000  # x 5 columns of 8 bytes: 36 MB a partition, 360 MB in all
    total_store = 3 * 80 * mib + 80 * mib
    assert n * rows * 40 > total_store
    with raydag.shuffle.enable(scheduler=False):
        x = source(n, None, rows=rows).shuffle("k", npartitions=m)
        y = x.map_partitions(summarise, meta=summarise(x._meta))
        spilled_before = sum(s.spilled_bytes for s in store_stats().values())
        proc = psutil.Process()
        base = proc.memory_info().rss
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.05)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            got = y.compute(scheduler=raydag.ray_get)
        finally:
            stop.set()
            t.join()
    assert got["rows"].sum() == n * rows and got["unique"].sum() == n * rows
    ids = n * rows
    assert got["sum"].sum() == ids * (ids - 1) // 2
    assert got["keys_sum"].sum() == sum(
        int(make_part(i, rows, 0, None)["k"].sum()) for i in range(n)
    )
    spilled = sum(s.spilled_bytes for s in store_stats().values()) - spilled_before
    grown = (peak[0] - base) / mib
    print(f"spilled {spilled / mib:.0f} MiB; driver RSS grew by {grown:.0f} MiB")
    assert spilled > 0, "nothing was spilled: the shuffle fitted in the stores"
    assert grown < 150, f"the driver's memory grew by {grown:.0f} MiB"
    del got, x, y
    gc.collect()
    # Every object freed: no primary copy is left anywhere. Copies restored from
    # spill files may stay a while as evictable secondary copies (no owner refers to
    # them): Ray drops those when it needs the room.
    wait_until(
        lambda: sum(s.primary_bytes for s in store_stats().values()) == 0,
        "every primary copy freed",
        timeout=60,
    )
    clusters.close()
