"""raydag gives what dask's sync scheduler gives, for every kind of collection and graph.

Chunks and partitions are sized above Ray's 100 KiB inlining threshold so that
intermediates really go through the object store, which each test then finds empty.
raydag copies results out of the store (``test_result_is_writeable_and_frees_the_store``).
"""

from __future__ import annotations

import os
import time
import warnings
from operator import add

import dask
import dask.array as da
import dask.bag as db
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import ray
from dask._task_spec import Alias, DataNode, Dict, List, Task, TaskRef

import raydag

pytestmark = pytest.mark.usefixtures("ray_cluster")


def inc(x):
    return x + 1


def compute_both(*collections):
    """(raydag's results, sync's results) of the same collections."""
    expected = dask.compute(*collections, scheduler="sync")
    got = dask.compute(*collections, scheduler=raydag.ray_get)
    return got, expected


def assert_same(got, expected):
    assert type(got) is type(expected)
    if isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(got, expected)
    elif isinstance(expected, pd.Series):
        pd.testing.assert_series_equal(got, expected)
    else:
        assert got == expected


def in_worker():
    """The pid that ran this: not the driver's when raydag ran it on a Ray worker."""
    return os.getpid()


# ---- dask.array -----------------------------------------------------------------


def _read(i):
    # long beside its consumers even on a loaded machine: they join while they take
    # at most half its runtime (a histogram of 200k values takes 2-5 ms, 10x that at
    # load 30 on 2 cores)
    time.sleep(0.1)
    return np.full(200_000, float(i))  # 1.6 MB: through the object store if it leaves


def _write(x, i):
    return f"part-{i}: {x.size}"


def test_producer_with_cheap_consumers_keeps_its_value_in_its_task(assert_store_empty):
    """A skim's shape: each read feeds only a write and a histogram fill, which dask.order
    runs last and first. Once measured, they run in the read's Ray task: the read's
    value never reaches the object store, nor is held until the writes run."""
    parts = 12
    reads = [dask.delayed(_read)(i, dask_key_name=("read", i)) for i in range(parts)]
    hists = [dask.delayed(np.histogram)(r, bins=4, range=(0, parts)) for r in reads]
    writes = [dask.delayed(_write)(r, i, dask_key_name=("write", i)) for i, r in enumerate(reads)]
    total = dask.delayed(lambda hs: sum(h[0] for h in hs))(hists)
    got, expected = compute_both(total, writes)
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1] == expected[1]
    t = raydag.last_run().tasks
    reads_run = t[t.category == "read"]
    together = t[t.group.isin(reads_run.group)].groupby("group").category.agg(frozenset)
    joined = together[together.map(lambda c: {"read", "write", "histogram"} <= c)]
    assert len(reads_run) == parts
    # the first reads are each category's probes; a read refused them runs apart
    assert len(joined) >= parts - 4, together.value_counts()
    assert (t[t.category == "read"].nbytes.isna()).sum() >= len(joined)  # never stored
    assert_store_empty()


def _x():
    # 1000x1000 float64 in 250x250 chunks: 500 kB each, stored in plasma, not inlined.
    return da.random.default_rng(42).random((1000, 1000), chunks=250)


ARRAYS = {
    "elementwise": lambda x: (x + 1) * 2 - np.sin(x) ** 2,
    "sum": lambda x: x.sum(),
    "mean-axis0": lambda x: x.mean(axis=0),
    "std": lambda x: x.std(),
    "argmax-axis1": lambda x: x.argmax(axis=1),
    "x+x.T": lambda x: x + x.T,
    "slicing": lambda x: x[::3, 100:700][5:-5, ::2],
    "boolean-index": lambda x: x[x[:, 0] > 0.5, :10],
    "rechunk": lambda x: x.rechunk((400, 100)),
    "rechunk-then-reduce": lambda x: x.rechunk((1000, 50)).sum(axis=0),
}


@pytest.mark.parametrize("build", ARRAYS.values(), ids=ARRAYS.keys())
def test_array(build, assert_store_empty):
    (got,), (expected,) = compute_both(build(_x()))
    assert_same(got, expected)
    del got, expected
    assert_store_empty()


def test_array_several_outputs_share_intermediates(assert_store_empty):
    """Two outputs of one compute read the same intermediate; both must come out right."""
    y = _x() + 1
    got, expected = compute_both(y.sum(), y.T[:10], y.max(axis=0))
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    del got, expected, g, e
    assert_store_empty()


def _probe_result(scheduler, store_count):
    """Compute, then describe the result; the array itself never reaches a failing frame."""
    # A delayed result: dask.array's finalize copies in the driver on some dask versions.
    got = dask.delayed(np.arange)(200_000.0).compute(scheduler=scheduler)
    writeable, owndata = got.flags.writeable, got.flags.owndata or got.base is None
    time.sleep(0.2)  # well past the 20 ms free-objects period
    return writeable, owndata, store_count()


def test_result_is_writeable_and_frees_the_store(store_count):
    """sync returns a writeable array that owns its memory; so should raydag."""
    expected = _probe_result("sync", store_count)
    got = _probe_result(raydag.ray_get, store_count)
    assert got == expected == (True, True, 0)


# ---- dask.dataframe -------------------------------------------------------------


def _ddf(npartitions=4):
    rng = np.random.default_rng(0)
    n = 40_000
    pdf = pd.DataFrame(
        {
            "k": rng.integers(0, 50, n),
            "v": rng.permutation(n).astype("float64"),
            "w": rng.random(n),
        }
    )
    return dd.from_pandas(pdf, npartitions=npartitions)


def test_dataframe_groupby_agg(assert_store_empty):
    ddf = _ddf()
    result = ddf.groupby("k").agg({"v": ["sum", "mean"], "w": "max"})
    (got,), (expected,) = compute_both(result)
    assert_same(got.sort_index(), expected.sort_index())
    del got, expected
    assert_store_empty()


def test_dataframe_set_index_task_shuffle(assert_store_empty):
    ddf = _ddf()
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        result = ddf.set_index("v")
        (got,), (expected,) = compute_both(result)
    assert got.index.is_monotonic_increasing
    assert_same(got, expected)
    del got, expected
    assert_store_empty()


def test_dataframe_merge_task_shuffle(assert_store_empty):
    left = _ddf(4)
    right = dd.from_pandas(
        pd.DataFrame({"k": np.arange(0, 60, 2), "name": [f"n{i}" for i in range(30)]}),
        npartitions=3,
    )
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        result = left.merge(right, on="k", how="inner", shuffle_method="tasks")
        (got,), (expected,) = compute_both(result)
    order = ["k", "v"]
    got = got.sort_values(order).reset_index(drop=True)
    expected = expected.sort_values(order).reset_index(drop=True)
    assert len(got) > 0
    assert_same(got, expected)
    del got, expected
    assert_store_empty()


def test_dataframe_repartition(assert_store_empty):
    ddf = _ddf(4).repartition(npartitions=7)
    assert ddf.npartitions == 7
    got, expected = compute_both(ddf, ddf.w.sum(), ddf.map_partitions(len))
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    del got, expected, g, e
    assert_store_empty()


# ---- dask.bag ----------------------------------------------------------------------


def is_even(x):
    return x % 2 == 0


def test_bag_map_filter_fold(assert_store_empty):
    b = db.from_sequence(range(10_000), npartitions=6)
    got, expected = compute_both(
        b.map(inc).filter(is_even).fold(add),
        b.map(inc).filter(is_even),
    )
    assert got[0] == sum(x + 1 for x in range(10_000) if (x + 1) % 2 == 0)
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    assert_store_empty()


def test_bag_frequencies(assert_store_empty):
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "the",
        "end",
    ] * 50
    b = db.from_sequence(words, npartitions=5)
    (got,), (expected,) = compute_both(b.frequencies(sort=True))
    assert got[0] == ("the", 150)
    assert_same(got, expected)
    assert_store_empty()


def count_up(n):
    yield from range(n)


def test_bag_partitions_that_are_generators(assert_store_empty):
    """A generator cannot be pickled into Ray's store; its values can (it was
    ``TypeError: cannot pickle 'generator' object`` where dask's schedulers pass)."""
    b = db.from_delayed([dask.delayed(count_up)(n) for n in (3, 0, 2)])
    got, expected = compute_both(b, b.map(inc).sum(), b.map_partitions(count_up_to_len))
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    assert got[0] == [0, 1, 2, 0, 1]
    assert got[2] == [0, 1, 2, 0, 1]
    assert_store_empty()


def count_up_to_len(partition):
    """Reads its partition as an iterator, the way a generator would be read."""
    return count_up(sum(1 for _ in partition))


def part_frame(i):
    return pd.DataFrame({"a": [i, i + 1]}, index=[2 * i, 2 * i + 1])


def test_from_delayed_without_meta_check_compared_with_itself(assert_store_empty):
    """``assert_eq(c, c)`` of ``dd.from_delayed(..., verify_meta=False)``: its graph stores
    an Alias named after its container under each partition's key, which raydag ran
    under the node's name (``RuntimeError: Not enough arguments provided``)."""
    from dask.dataframe.utils import assert_eq

    c = dd.from_delayed([dask.delayed(part_frame)(i) for i in range(3)], verify_meta=False)
    assert_eq(c, c, scheduler=raydag.ray_get)
    assert_eq(c, pd.concat([part_frame(i) for i in range(3)]), scheduler=raydag.ray_get)
    assert_store_empty()


# ---- dask.delayed ------------------------------------------------------------------


def make_list(n):
    return [np.full(20_000, i, dtype="float64") for i in range(n)]


def total(arrays):
    return float(sum(a.sum() for a in arrays))


def test_delayed_nested_structures(assert_store_empty):
    d = dask.delayed
    a, b, c = d(inc)(1), d(inc)(2), d(add)(3, 4)
    nested = {"x": [a, (b, c)], "y": {"z": d(add)(a, c)}, "pid": d(in_worker)()}
    inner = d(lambda s: {k: v for k, v in s.items() if k != "pid"})(nested)
    got, expected = compute_both(nested, inner, [a, [b, [c]]])
    assert got[0]["pid"] != os.getpid()  # ran on a Ray worker
    got[0].pop("pid"), expected[0].pop("pid")
    assert got == expected
    assert got[1] == {"x": [2, (3, 7)], "y": {"z": 9}}
    assert_store_empty()


def test_delayed_task_returning_a_list(assert_store_empty):
    lst = dask.delayed(make_list)(8)
    got, expected = compute_both(dask.delayed(total)(lst), dask.delayed(len)(lst), lst)
    assert got[:2] == expected[:2] == (float(20_000 * sum(range(8))), 8)
    assert len(got[2]) == 8
    for g, e in zip(got[2], expected[2], strict=True):
        assert_same(g, e)
    del got, expected, g, e
    assert_store_empty()


# ---- raw graphs -----------------------------------------------------------------------


def as_lists(x):
    """dask.local returns tuples where the keys had lists; raydag keeps the lists."""
    return [as_lists(v) for v in x] if isinstance(x, tuple) else x


LEGACY = {"a": 1, "b": (inc, "a"), "c": (add, "a", "b")}


@pytest.mark.parametrize(
    "keys",
    ["c", ["c"], ["a", "b", "c"], [["a", "b"], ["c"]], [[["c"]], [], ["a", ["b"]]]],
    ids=repr,
)
def test_legacy_graph_keys_keep_their_nesting(keys, assert_store_empty):
    expected = as_lists(dask.get(LEGACY, keys))
    got = raydag.ray_get(LEGACY, keys)
    assert got == expected
    assert_store_empty()


def test_nested_keys_literal():
    """The nesting of the keys is the nesting of the result, spelled out."""
    assert raydag.ray_get(LEGACY, [["a", "b"], ["c"]]) == [[1, 2], [3]]
    assert raydag.ray_get(LEGACY, "c") == 3


def test_legacy_graph_with_nested_tuples_and_tuple_keys(assert_store_empty):
    dsk = {
        ("x", 0): (np.arange, 100_000),
        ("x", 1): (np.ones, 100_000),
        "s": (sum, [(np.sum, ("x", 0)), (np.sum, ("x", 1))]),
        "d": (dict, [["total", "s"], ["first", ("x", 0)]]),
    }
    keys = ["s", ["d"]]
    expected = dask.get(dsk, keys)
    got = raydag.ray_get(dsk, keys)
    assert got[0] == expected[0]
    assert got[1][0]["total"] == expected[1][0]["total"]
    np.testing.assert_array_equal(got[1][0]["first"], expected[1][0]["first"])
    del got, expected
    assert_store_empty()


def pack(**kwargs):
    return kwargs


def test_task_spec_graph(assert_store_empty):
    dsk = {
        "a": DataNode("a", 1),
        "arr": DataNode("arr", np.arange(50_000.0)),
        "b": Task("b", inc, TaskRef("a")),
        "c": Alias("c", "b"),
        "d": Task("d", sum, List(TaskRef("a"), TaskRef("c"), 10)),
        "e": Task("e", pack, x=TaskRef("d"), y=List(TaskRef("b"), 2)),
        "f": Task("f", dict, Dict({"sum": Task(None, np.sum, TaskRef("arr")), "d": TaskRef("d")})),
    }
    keys = [["a", "b", "c"], ["d", "e"], "f"]
    expected = as_lists(dask.get(dsk, keys))
    got = raydag.ray_get(dsk, keys)
    assert got == expected
    assert got[0] == [1, 2, 2] and got[1][0] == 13
    assert got[1][1] == {"x": 13, "y": [2, 2]}
    assert got[2] == {"sum": np.arange(50_000.0).sum(), "d": 13}
    assert_store_empty()


def test_single_key_of_a_collection(assert_store_empty):
    x = _x()
    dsk = x.__dask_graph__()
    key = (x.name, 1, 2)
    np.testing.assert_array_equal(raydag.ray_get(dsk, key), dask.get(dict(dsk), key))
    assert_store_empty()


# ---- ways to choose the scheduler ---------------------------------------------------


def _dask_lets_the_scheduler_persist() -> bool:
    """Does this dask hand ``persist`` to a scheduler's own ``persist`` (dask 2026.x does,
    2025.3.x does not: there only a distributed Client's)?"""

    def get(dsk, keys, **kwargs):
        raise AssertionError("computed instead of persisted")

    get.persist = lambda collections, **kwargs: list(collections)
    x = dask.delayed(inc)(1)
    try:
        (y,) = dask.persist(x, scheduler=get)
    except AssertionError:
        return False
    return y is x


PERSIST_HOOK = _dask_lets_the_scheduler_persist()
PERSIST_WAYS = {
    "dask.persist": lambda y: dask.persist(y, scheduler=raydag.ray_get)[0],
    "x.persist": lambda y: y.persist(scheduler=raydag.ray_get),
    "raydag.persist": lambda y: raydag.persist(y)[0],
}


@pytest.mark.parametrize("way", PERSIST_WAYS.values(), ids=PERSIST_WAYS.keys())
def test_persist_with_ray_get_keeps_the_results_in_ray(way, store_count, assert_store_empty):
    """With the hook (dask 2026.x), ``dask.persist(x, scheduler=raydag.ray_get)`` and
    ``x.persist(scheduler=raydag.ray_get)`` are ``raydag.persist``: the chunks stay in
    Ray; without it (2025.3.x) dask brings them to the driver."""
    x = _x()
    y = x + x.T
    p = way(y)
    refs = len(_refs_in(p.__dask_graph__()))
    kept_in_ray = PERSIST_HOOK or way is PERSIST_WAYS["raydag.persist"]
    assert refs == (y.npartitions if kept_in_ray else 0)
    if kept_in_ray:
        assert store_count() >= y.npartitions
    got = p.sum().compute(scheduler=raydag.ray_get)
    np.testing.assert_allclose(got, y.sum().compute(scheduler="sync"))
    del p
    assert_store_empty()


def test_raydag_persist_returns_a_tuple_as_dask_persist_does(assert_store_empty):
    x = dask.delayed(inc)(1)
    assert isinstance(raydag.persist(x), tuple) and len(raydag.persist(x)) == 1
    p, q = raydag.persist(x, dask.delayed(inc)(2))
    assert dask.compute(p, q, scheduler=raydag.ray_get) == (2, 3)
    del p, q
    assert_store_empty()


def test_config_scheduler(assert_store_empty):
    x = _x()
    with dask.config.set(scheduler=raydag.ray_get):
        pid = dask.delayed(in_worker)().compute()
        got = (x + 1).sum().compute()
    assert pid != os.getpid()
    assert got == (x + 1).sum().compute(scheduler="sync")
    assert_store_empty()


def _settings():
    return {
        "scheduler": dask.config.get("scheduler", "<none>"),
        "dataframe.shuffle.method": dask.config.get("dataframe.shuffle.method", "<none>"),
    }


def test_enable_makes_raydag_the_scheduler_and_disable_puts_back_what_was_there(
    assert_store_empty,
):
    """``raydag.enable()``: compute and persist run on Ray, the shuffle is raydag's; then
    ``disable()`` gives back the values set before (not dask's defaults)."""
    import raydag.shuffle

    hook_before = raydag.shuffle.installed()
    with dask.config.set({"scheduler": "threads", "dataframe.shuffle.method": "tasks"}):
        before = _settings()
        try:
            handle = raydag.enable()
            assert dask.config.get("scheduler") is raydag.ray_get
            assert dask.config.get("dataframe.shuffle.method") == "raydag"
            assert raydag.shuffle.installed()
            assert dask.delayed(in_worker)().compute() != os.getpid()
            x = _x()
            p = (x + 1).persist()
            assert len(_refs_in(p.__dask_graph__())) == (x.npartitions if PERSIST_HOOK else 0)
            assert p.sum().compute() == (x + 1).sum().compute(scheduler="sync")
            del p
            ddf = _ddf(4)
            got = ddf.set_index("v").w.compute()  # raydag's shuffle, on Ray
            ran = set(raydag.last_run().tasks["category"])
            assert any(c.startswith(raydag.shuffle.MAP) for c in ran), ran
            assert_same(got, ddf.compute(scheduler="sync").set_index("v").w.sort_index())
        finally:
            raydag.disable()
        assert _settings() == before
        assert "undone" in repr(handle)
        assert raydag.shuffle.installed() == hook_before
        raydag.disable()  # again: nothing to undo
        assert _settings() == before
    assert_store_empty()


def test_enable_as_a_context_manager_and_settings_that_had_no_value():
    """No scheduler set before: none after. Twice enabled (a notebook cell run twice):
    one ``disable`` undoes both."""
    with dask.config.set({"scheduler": None}):
        dask.config.config.pop("scheduler")
        try:
            with raydag.enable() as handle:
                assert dask.config.get("scheduler") is raydag.ray_get
                assert dask.delayed(in_worker)().compute() != os.getpid()
            assert "scheduler" not in dask.config.config
            assert not handle.active
            raydag.enable()
            raydag.enable(shuffle=False)
            raydag.disable()
            assert "scheduler" not in dask.config.config
        finally:
            raydag.disable()


def test_disable_leaves_a_setting_changed_since_enable():
    with dask.config.set({"scheduler": "threads", "dataframe.shuffle.method": "tasks"}):
        try:
            raydag.enable()
            dask.config.set(scheduler="sync")  # the user's own, after enable
        finally:
            raydag.disable()
        assert _settings() == {"scheduler": "sync", "dataframe.shuffle.method": "tasks"}


def record_block(block, path):
    if block.size:  # not map_blocks' meta inference, which calls it in the driver
        with open(path, "a") as f:
            f.write("x\n")
    return block * 2


def _refs_in(graph):
    """The ObjectRefs a persisted collection's graph holds (bare, or in a ``Persisted``)."""
    refs = []
    for v in dict(graph).values():
        for candidate in (v, getattr(v, "value", None), getattr(v, "ref", None)):
            if isinstance(candidate, ray.ObjectRef):
                refs.append(candidate)
    return refs


def test_raydag_persist_array_keeps_refs_and_frees_them(tmp_path, store_count, assert_store_empty):
    """The persisted chunks stay in Ray, are read (not recomputed) later, and die with ``p``."""
    log = tmp_path / "calls.txt"
    data = np.random.default_rng(1).random((1000, 1000))
    x = da.from_array(data, chunks=250).map_blocks(record_block, str(log), dtype=float)
    nchunks = x.npartitions

    (p,) = raydag.persist(x)
    assert log.read_text().count("x") == nchunks
    refs = _refs_in(p.__dask_graph__())
    assert len(refs) == nchunks, "the persisted graph should hold one ObjectRef per chunk"
    del refs
    assert store_count() >= nchunks  # the chunks live in plasma while p does

    y = (p + 1).T.sum(axis=0)
    for optimize_graph in (True, False):
        got = y.compute(scheduler=raydag.ray_get, optimize_graph=optimize_graph)
        np.testing.assert_allclose(got, (data * 2 + 1).T.sum(axis=0))
    assert log.read_text().count("x") == nchunks, "computing p must not rerun its tasks"
    got = p.compute(scheduler=raydag.ray_get)  # the collection itself
    np.testing.assert_allclose(got, data * 2)
    del got
    assert log.read_text().count("x") == nchunks
    assert store_count() >= nchunks  # computing did not free what p still holds

    del p, y
    assert_store_empty()


def test_raydag_persist_dataframe_and_delayed(store_count, assert_store_empty):
    ddf = _ddf(4)
    lst = dask.delayed(make_list)(3)
    (pdf,) = raydag.persist(ddf[ddf.w > 0.5])  # apart: dask warns about mixing expressions
    (plst,) = raydag.persist(lst)
    assert len(_refs_in(pdf.__dask_graph__())) == 4
    assert len(_refs_in(plst.__dask_graph__())) == 1
    assert store_count() >= 5
    got = [
        pdf.groupby("k").v.sum().compute(scheduler=raydag.ray_get),
        dask.delayed(total)(plst).compute(scheduler=raydag.ray_get),
    ]
    assert_same(got[0], ddf[ddf.w > 0.5].groupby("k").v.sum().compute(scheduler="sync"))
    assert got[1] == total(make_list(3))
    assert store_count() >= 5  # still held by pdf and plst
    del pdf, plst, got
    assert_store_empty()


def _compute_persisted(kind):
    """Persist with raydag, compute a derived collection; return (result, expected) or an error."""
    if kind == "array":
        data = np.arange(1_000_000.0).reshape(1000, 1000)
        (p,) = raydag.persist(da.from_array(data, chunks=500) * 2)
        y, expected = (p + 1).sum(), float((data * 2 + 1).sum())
    else:
        (p,) = raydag.persist(db.from_sequence(range(100), npartitions=4).map(inc))
        y, expected = p.map(inc).sum(), sum(range(2, 102))
    try:
        return float(y.compute(scheduler=raydag.ray_get)), float(expected)
    except Exception as e:  # return a string: no frame holding p may outlive this test
        return f"{type(e).__name__}: {e}", float(expected)


@pytest.mark.parametrize("kind", ["array", "bag"])
def test_raydag_persist_then_optimized_compute(kind, assert_store_empty):
    """dask's fuse_roots inlines root layers into fused tasks: persisted refs must survive it."""
    got, expected = _compute_persisted(kind)
    assert got == expected
    assert_store_empty()


def test_raydag_persist_twice_then_drop_one(assert_store_empty):
    """Persisting a collection twice gives the same keys: dropping either copy keeps the other."""
    data = np.arange(1_000_000.0).reshape(1000, 1000)
    x = da.from_array(data, chunks=500) * 2
    for drop_first in (False, True):
        (p1,) = raydag.persist(x)
        (p2,) = raydag.persist(x)
        if drop_first:
            p1, p2 = p2, p1
        del p2
        got = (p1 + 1).sum().compute(scheduler=raydag.ray_get)
        assert got == (data * 2 + 1).sum()
        del p1
        assert_store_empty()


# ---- annotations --------------------------------------------------------------------


def assigned_cpus():
    return ray.get_runtime_context().get_assigned_resources().get("CPU")


def fail_once(marker):
    """Fail on the first call, succeed on the second: only retries make it pass."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first attempt fails")
    return "second attempt"


def test_annotations_resources_and_retries(tmp_path, assert_store_empty):
    with dask.annotate(resources={"CPU": 1}, retries=1):
        cpus = dask.delayed(assigned_cpus)()
        flaky = dask.delayed(fail_once)(str(tmp_path / "marker"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # annotations are not foreign keyword arguments
        got = dask.compute(cpus, flaky, scheduler=raydag.ray_get)
    assert got == (1.0, "second attempt")
    assert_store_empty()


def test_annotations_dask_sets_are_accepted_without_a_warning(assert_store_empty):
    with dask.annotate(priority=10, workers=["w1"], allow_other_workers=True):
        x = dask.delayed(inc)(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dask.compute(x, scheduler=raydag.ray_get) == (2,)
    assert_store_empty()


def test_an_unknown_annotation_is_warned_about_once_per_compute(assert_store_empty):
    with dask.annotate(retires=2):  # a typo of retries
        xs = [dask.delayed(inc)(i) for i in range(3)]
    with dask.annotate(colour="red"):
        y = dask.delayed(sum)(xs)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dask.compute(y, scheduler=raydag.ray_get) == (6,)
        ours = [w for w in caught if issubclass(w.category, raydag.api.UnknownAnnotationWarning)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        assert issubclass(ours[0].category, UserWarning)
        message = str(ours[0].message)
        assert "retires" in message and "colour" in message, message
    assert_store_empty()


def test_without_retries_annotation_the_flaky_task_fails(tmp_path, assert_store_empty):
    """The control for the test above: retries=1 is what made it pass."""
    flaky = dask.delayed(fail_once)(str(tmp_path / "marker"))
    with pytest.raises(RuntimeError, match="first attempt fails"):
        dask.compute(flaky, scheduler=raydag.ray_get)
    assert_store_empty()


# ---- the driver's fixed costs (#19) ---------------------------------------------------


def test_a_shared_callable_pickled_by_value_is_shipped_once_per_compute():
    from raydag.runtime.worker import SHARED_PICKLE_BYTES, Shipper, _unpack

    class Skim:  # a local class: cloudpickle ships it by value, as a notebook's
        def __init__(self):
            self.columns = [f"column_{i}" for i in range(50)]

        def __call__(self, x):
            return x + len(self.columns)

    skim = Skim()
    assert len(ray.cloudpickle.dumps(skim)) > SHARED_PICKLE_BYTES
    shipper = Shipper()
    first = [Task("a", skim, 1)]
    assert shipper.pack(first) == (first, ())  # once: as it is (a one-task compute)
    second, shared = shipper.pack([Task("b", skim, 2), Task("c", inc, TaskRef("b"))])
    # the callable anywhere in the payload, not only as a task's own (a nested task's)
    fourth, _ = shipper.pack([Task("f", skim, Task("g", skim, 4))])
    third, shared_again = shipper.pack([Task("e", skim, 3)])
    assert isinstance(second, bytes) and len(shared) == 1
    assert shared_again == shared  # one ray.put for the compute, named by every payload
    assert len(third) < len(ray.cloudpickle.dumps(skim))  # the callable is not in it
    b, c = _unpack(second, shared)  # as a worker reads it: equal tasks, the callable's copy
    assert (type(b), b.key, b.args, type(c), c.key, c.func) == (Task, "b", (2,), Task, "c", inc)
    assert c.dependencies == {"b"} and type(b.func).__name__ == "Skim"
    (f,) = _unpack(fourth, shared)
    assert f(None) == 4 + 50 + 50 and f.func is b.func  # read once per worker process
    plain = [Task("d", inc, 1)]  # importable: pickled by reference, cheap, left alone
    assert shipper.pack(plain) == (plain, ())

    dsk = {("skim", i): (skim, i) for i in range(12)}
    dsk["total"] = (sum, list(dsk))
    assert raydag.ray_get(dsk, "total") == sum(i + 50 for i in range(12))


def test_a_shared_callable_raising_keeps_its_error_type():
    class Picky:
        def __init__(self):
            self.allowed = set(range(0, 100, 2))

        def __call__(self, x):
            if x not in self.allowed:
                raise KeyError(x)
            return x

    picky = Picky()
    dsk = {("p", i): (picky, i) for i in range(4)}
    with pytest.raises(KeyError):
        raydag.ray_get(dsk, list(dsk))


def test_back_to_back_computes_reuse_the_last_read_of_the_cluster():
    from raydag.runtime import cluster

    fresh = cluster.alive_nodes()
    when = cluster._last_read[0]
    assert cluster.alive_nodes(max_age=60.0) == fresh
    assert cluster._last_read[0] == when  # not read again
    assert cluster.alive_nodes() == fresh
    assert cluster._last_read[0] > when  # max_age 0: always read


def test_a_compute_starts_on_an_old_read_and_reads_again_while_its_tasks_run(caplog):
    """A compute starts on the session's last read of the nodes, however old; the driver
    loop reads them again right after its first submissions. Here the old read still
    lists a node that has died since: the compute finishes, and the node is reported
    dead as soon as the loop looks."""
    from raydag.runtime import cluster

    fresh = cluster.alive_nodes()
    gone = "f" * 56
    stale = time.monotonic() - 60.0
    cluster._last_read = (stale, cluster.session(), {**fresh, gone: 1.0})
    with caplog.at_level("WARNING", logger="raydag.runtime"):
        assert dask.compute(dask.delayed(sum)([1, 2]), scheduler=raydag.ray_get) == (3,)
    assert cluster._last_read[0] > stale  # read again
    assert cluster._last_read[2] == fresh
    assert any(f"node {gone[:12]} died" in r.getMessage() for r in caplog.records)
    run = raydag.last_run()
    assert run.meta["status"] == "ok"


def test_warm_up_imports_what_the_driver_has_in_a_worker_per_cpu():
    """The embedded Ray's workers are started with the driver's modules imported
    (``local-ray.warm-imports``), so a first compute does not pay for it; a module the
    driver never imported is not imported, and a missing one is skipped."""
    import xml.dom.minidom  # noqa: F401  (the driver has it: the worker imports it)

    from raydag.runtime.cluster import warm_up

    wanted = ["xml.dom.minidom", "xml.sax.saxutils", "no_such_module_raydag"]
    with dask.config.set({"raydag.local-ray.warm-imports": wanted}):
        import sys

        sys.modules.pop("xml.sax.saxutils", None)  # one the driver does not have
        sys.modules["no_such_module_raydag"] = sys.modules["xml"]  # "has" it, a worker cannot
        try:
            refs = warm_up()
        finally:
            del sys.modules["no_such_module_raydag"]
    assert len(refs) == int(ray.cluster_resources()["CPU"])
    assert ray.get(refs) == [["xml.dom.minidom"]] * len(refs)


def _sleepy_inc(x):
    time.sleep(0.002)
    return x + 1


def test_a_large_graph_starts_on_a_provisional_order_then_takes_dask_order(monkeypatch):
    """Above ``scheduling.order-later-above`` tasks the compute starts before dask.order
    has run; its priorities come as an ``Ordered`` event while the compute runs."""
    from raydag.core.events import Ordered
    from raydag.core.graph import Graph
    from raydag.core.state import State

    handled = []
    handle = State.handle
    monkeypatch.setattr(State, "handle", lambda s, ev: handled.append(type(ev)) or handle(s, ev))
    ordered = []
    order = Graph.order
    monkeypatch.setattr(Graph, "order", lambda g: ordered.append(len(g)) or order(g))
    parts = [dask.delayed(_sleepy_inc)(i) for i in range(300)]
    total = dask.delayed(sum)(parts)
    with dask.config.set({"raydag.scheduling.order-later-above": 100}):
        assert dask.compute(total, scheduler=raydag.ray_get) == (sum(range(1, 301)),)
    assert ordered == [301] and Ordered in handled
    with dask.config.set({"raydag.scheduling.order-later-above": None}):
        assert dask.compute(total, scheduler=raydag.ray_get) == (sum(range(1, 301)),)
    assert ordered == [301]  # ordered first, as always: no thread


def test_a_start_note_comes_only_from_a_task_still_running_after_its_delay():
    """A task not measured yet says where it started once it has run ``notify_after``
    (a note from every task cost a one-task compute an actor call); one that ends
    sooner says nothing; one asked at once (a known-long task, a duplicate) at once."""
    from raydag.runtime.inbox import inbox
    from raydag.runtime.worker import remote_group

    box, run = inbox(), -23  # a run id no compute uses
    for tag, seconds, after in (("short", 0.0, 0.5), ("long", 1.0, 0.2), ("at once", 0.0, 0.0)):
        _, meta = remote_group.remote([Task(tag, time.sleep, seconds)], (), (box, run, tag, after))
        ray.get(meta)
    notes: list = []
    deadline = time.monotonic() + 10
    while len(notes) < 2 and time.monotonic() < deadline:
        notes += ray.get(box.drain.remote(run, 1.0))
    notes += ray.get(box.drain.remote(run, 1.0))  # and nothing more comes
    assert sorted(tag for _, tag, _, _ in notes) == ["at once", "long"]
    assert {node for _, _, node, _ in notes} <= {n["NodeID"] for n in ray.nodes()}
