"""raydag's dataframe shuffle on one local Ray: every shuffling operation equals pandas.

Each operation is built with ``raydag.shuffle.enable()`` on, computed by raydag and by
dask's sync scheduler (the same graph), and compared with pandas. Partitions are sized
so that pieces (a map's share for one reducer) exceed Ray's 100 KiB inlining threshold
in the larger tests and really go through the object store, which ends empty.
"""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import raydag
import raydag.runtime
import raydag.shuffle
import raydag.shuffle.tasks
from raydag.shuffle import MAP, PIECE, IncompatiblePartitionError

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(autouse=True)
def shuffle_on():
    # object columns stay object (dask would turn them into pyarrow strings): the
    # comparisons with pandas are then exact, dtypes included
    with raydag.shuffle.enable(), dask.config.set({"dataframe.convert-string": False}):
        yield


def frame(n: int = 4000, seed: int = 0, nkeys: int = 50) -> pd.DataFrame:
    """Keys with repeats, nulls in floats and objects, strings, categoricals, a row id."""
    rng = np.random.default_rng(seed)
    k = rng.integers(0, nkeys, n)
    x = rng.normal(size=n)
    x[rng.random(n) < 0.1] = np.nan
    s = np.array([f"s{v % 13}" for v in k], dtype=object)
    s[rng.random(n) < 0.1] = None
    return pd.DataFrame(
        {
            "i": np.arange(n),
            "u": rng.permutation(n),
            "k": k,
            "x": x,
            "s": s,
            "t": pd.array([f"t{v % 5}" for v in k], dtype="string"),
            "c": pd.Categorical([f"c{v % 4}" for v in k], categories=["c0", "c1", "c2", "c3"]),
        }
    )


def uses_raydag_shuffle(collection) -> bool:
    keys = collection.__dask_graph__().keys()
    names = {k[0] for k in keys if isinstance(k, tuple) and isinstance(k[0], str)}
    return any(n.startswith(MAP) for n in names) and not any(
        n.startswith(("split-", "group-", "shuffle-partition-")) for n in names
    )


def by(df: pd.DataFrame, cols: list) -> pd.DataFrame:
    return df.sort_values(cols, kind="stable").reset_index(drop=True)


def group_size(g: pd.DataFrame) -> pd.DataFrame:
    return g.assign(n=len(g), first=g["i"].iloc[0] if len(g) else -1)


# Each: (build the dask result from ddf, the pandas result from pdf, normalise both)
OPERATIONS = {
    "shuffle": (
        lambda d: d.shuffle("k"),
        lambda p: p,
        lambda r: by(r, ["i"]),
    ),
    "set_index": (
        lambda d: d.set_index("k"),
        lambda p: p.set_index("k"),
        lambda r: by(r.reset_index(), ["k", "i"]),
    ),
    "sort_values": (
        lambda d: d.sort_values("x"),
        lambda p: p.sort_values("x"),
        lambda r: by(r, ["x", "i"]),
    ),
    "merge": (
        lambda d: d.merge(dd.from_pandas(frame(600, 1), npartitions=3), on="k"),
        lambda p: p.merge(frame(600, 1), on="k"),
        lambda r: by(r, ["i_x", "i_y"]),
    ),
    "join": (
        lambda d: d.set_index("u").join(
            dd.from_pandas(frame(3000, 2), npartitions=4).set_index("u"), rsuffix="_r"
        ),
        lambda p: p.set_index("u").join(frame(3000, 2).set_index("u"), suffixes=("", "_r")),
        lambda r: r.sort_index(),
    ),
    "groupby-apply": (
        lambda d: d.groupby("k").apply(group_size, meta=group_size(d._meta.drop(columns="k"))),
        lambda p: p.groupby("k").apply(group_size),
        lambda r: by(r.reset_index(drop=True), ["i"]),
    ),
    "groupby-transform": (
        lambda d: d.groupby("k").x.transform("cumsum", meta=("x", "f8")),
        lambda p: p.groupby("k").x.transform("cumsum"),
        lambda r: r.sort_index(),
    ),
    "groupby-shift": (
        lambda d: d.groupby("k").x.shift(1, meta=("x", "f8")),
        lambda p: p.groupby("k").x.shift(1),
        lambda r: r.sort_index(),
    ),
    "groupby-split_out": (
        lambda d: d.groupby("k").agg({"x": "sum", "i": "max"}, split_out=4),
        lambda p: p.groupby("k").agg({"x": "sum", "i": "max"}),
        lambda r: r.sort_index(),
    ),
    "drop_duplicates-first": (
        lambda d: d.drop_duplicates(subset=["k"], keep="first", split_out=4),
        lambda p: p.drop_duplicates(subset=["k"], keep="first"),
        lambda r: by(r, ["k"]),
    ),
    "drop_duplicates-last": (
        lambda d: d.drop_duplicates(subset=["s"], keep="last", split_out=3),
        lambda p: p.drop_duplicates(subset=["s"], keep="last"),
        lambda r: by(r, ["i"]),
    ),
    "unique": (
        lambda d: d.s.unique(split_out=4),
        lambda p: pd.Series(p.s.unique(), name="s"),
        lambda r: pd.Series(sorted(r, key=str), name="s"),
    ),
}


@pytest.mark.parametrize("per_map", [1, 4], ids=["1-input-per-map", "4-inputs-per-map"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_operation_equals_pandas(name, per_map, assert_store_empty):
    """Also with maps reading 4 inputs each: of 6 partitions, a map of 4 and one of 2."""
    build, expect, norm = OPERATIONS[name]
    pdf = frame()
    ddf = dd.from_pandas(pdf, npartitions=6)
    with dask.config.set({"raydag.shuffle.inputs-per-map": per_map}):
        result = build(ddf)
        result.__dask_graph__()  # lowered now, under the setting
    assert uses_raydag_shuffle(result), "the operation did not use raydag's shuffle"
    expected = norm(expect(pdf))
    got = result.compute(scheduler=raydag.ray_get)
    if isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(norm(got), expected)
    else:
        pd.testing.assert_series_equal(norm(got), expected)
    assert_store_empty()
    # the same graph under dask's sync scheduler
    synced = result.compute(scheduler="sync")
    if isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(norm(synced), expected)
    else:
        pd.testing.assert_series_equal(norm(synced), expected)


def ray_tasks() -> int:
    """Ray tasks the last compute submitted (one per group, retries included)."""
    ev = raydag.last_run().events
    return ev[ev.event == "submitted"].group.nunique()


def test_map_and_its_pieces_are_one_ray_task_each_piece_an_object(assert_store_empty):
    """N maps + M reducers Ray tasks (and the input partitions), not N x M; no piece is
    fused with its reducer; the store ends empty."""
    n, m = 12, 10
    pdf = frame(60_000, nkeys=5000)
    x = dd.from_pandas(pdf, npartitions=n).shuffle("k", npartitions=m)
    graph = dict(x.__dask_graph__())
    maps = [k for k in graph if isinstance(k, tuple) and k[0].startswith(MAP)]
    pieces = [k for k in graph if isinstance(k, tuple) and k[0].startswith(PIECE)]
    assert (len(maps), len(pieces)) == (n, n * m)
    got = x.compute(scheduler=raydag.ray_get)
    pd.testing.assert_frame_equal(by(got, ["i"]), pdf)
    # inputs and their partitioning column, maps, reducers, the projection after them
    # (dask's tasks; raydag fuses cheap ones once it has measured them)
    assert ray_tasks() <= 3 * n + 2 * m + 1 < n * m, ray_tasks()
    ev = raydag.last_run().events
    submitted = ev[ev.event == "submitted"]
    with_map = submitted[submitted.key.str.contains("raydag-shuffle-map-")].group
    bundle = submitted[submitted.group.isin(with_map)]
    assert bundle.groupby("group").size().eq(1 + m).all(), "a map runs with all its pieces"
    assert_store_empty()


def test_maps_read_consecutive_inputs_when_pieces_would_be_many(assert_store_empty):
    """k inputs per map: ceil(N/k) maps of M pieces each; rows keep their input order."""
    n, m, k = 8, 5, 3
    pdf = frame(6000, nkeys=40)
    ddf = dd.from_pandas(pdf, npartitions=n)
    with dask.config.set({"raydag.shuffle.inputs-per-map": k}):
        x = ddf.shuffle("k", npartitions=m)
        graph = dict(x.__dask_graph__())
    maps = [g for g in graph if isinstance(g, tuple) and g[0].startswith(MAP)]
    pieces = [g for g in graph if isinstance(g, tuple) and g[0].startswith(PIECE)]
    assert (len(maps), len(pieces)) == (3, 3 * m)
    got = x.compute(scheduler=raydag.ray_get)
    pd.testing.assert_frame_equal(by(got, ["i"]), pdf)
    for part in x.to_delayed():  # within a key, rows in input (row id) order
        p = part.compute(scheduler=raydag.ray_get)
        assert p.groupby("k").i.apply(lambda s: s.is_monotonic_increasing).all()
    assert_store_empty()


def test_inputs_per_map_auto(monkeypatch):
    """auto: one input per map until maps x outputs pass max-pieces, then as few more
    as keep them under it, with at least two maps per cluster CPU."""
    from raydag.shuffle import inputs_per_map

    for cpus, nin, nout, want in [
        (0, 12, 10, 1),  # 120 pieces: one input per map
        (0, 64, 64, 4),  # 4,096 pieces: 16 maps, 1,024 pieces
        (2, 64, 64, 4),
        (16, 64, 64, 2),  # 32 maps at least
        (64, 64, 64, 1),
        (0, 100, 100, 10),
        (0, 3, 5000, 3),  # never more than the inputs
    ]:
        monkeypatch.setattr(raydag.shuffle.tasks, "_cluster_cpus", lambda c=cpus: c)
        assert inputs_per_map(nin, nout) == want, (cpus, nin, nout)
    with dask.config.set({"raydag.shuffle.max-pieces": 100}):
        assert inputs_per_map(12, 10) == 2
    with dask.config.set({"raydag.shuffle.inputs-per-map": 5}):
        assert inputs_per_map(64, 64) == 5
        assert inputs_per_map(3, 64) == 3
    with dask.config.set({"raydag.shuffle.inputs-per-map": "7"}):  # from YAML or env
        assert inputs_per_map(64, 64) == 7
    for key, bad in [("inputs-per-map", 0), ("inputs-per-map", "many"), ("max-pieces", -5)]:
        with (
            dask.config.set({f"raydag.shuffle.{key}": bad}),
            pytest.raises(ValueError, match=f"raydag.shuffle.{key} must be .*positive integer"),
        ):
            inputs_per_map(64, 64)


def test_partitions_differ_in_and_out_and_empty_partitions():
    """More inputs than outputs, fewer, and inputs that are empty after a filter."""
    pdf = frame(3000)
    ddf = dd.from_pandas(pdf, npartitions=8)
    for nout in (3, 11):
        got = ddf.shuffle("k", npartitions=nout).compute(scheduler=raydag.ray_get)
        pd.testing.assert_frame_equal(by(got, ["i"]), pdf)
    only = ddf[ddf.i < 300]  # most partitions empty
    got = only.shuffle("s", npartitions=5).compute(scheduler=raydag.ray_get)
    pd.testing.assert_frame_equal(by(got, ["i"]), pdf[pdf.i < 300])
    empty = ddf[ddf.i < 0]
    got = empty.set_index("k").compute(scheduler=raydag.ray_get)
    assert len(got) == 0 and list(got.columns) == [c for c in pdf.columns if c != "k"]


def test_drop_duplicates_keeps_the_first_and_last_row_of_each_key_in_order():
    """Which duplicate is kept depends on row order across partitions: the reducers
    concatenate pieces in input order, as pandas sees the rows."""
    n = 5000
    pdf = pd.DataFrame({"k": np.arange(n) % 7, "i": np.arange(n)})
    ddf = dd.from_pandas(pdf, npartitions=9)
    for keep in ("first", "last"):
        got = ddf.drop_duplicates(subset=["k"], keep=keep, split_out=3)
        got = got.compute(scheduler=raydag.ray_get)
        pd.testing.assert_frame_equal(
            by(got, ["k"]), by(pdf.drop_duplicates("k", keep=keep), ["k"])
        )


def test_divisions_pass_of_set_index_runs_on_ray(monkeypatch):
    calls = []
    run = raydag.runtime.run

    def counting(dsk, keys, *args, **kwargs):
        calls.append(len(dsk) if hasattr(dsk, "__len__") else 0)
        return run(dsk, keys, *args, **kwargs)

    monkeypatch.setattr(raydag.runtime, "run", counting)
    pdf = frame(2000)
    x = dd.from_pandas(pdf, npartitions=5).set_index("x")
    x.optimize()  # dask computes the divisions while optimising
    assert len(calls) >= 1, "the divisions were not computed by raydag"
    got = x.compute()  # raydag is dask's scheduler now
    assert len(calls) >= 2
    pd.testing.assert_frame_equal(got.sort_index(), pdf.set_index("x").sort_index())


def test_two_shuffles_in_one_compute_and_the_same_shuffle_twice(assert_store_empty):
    left, right = frame(1500, 3), frame(1000, 4)
    a = dd.from_pandas(left, npartitions=5)
    b = dd.from_pandas(right, npartitions=4)
    merged = a.merge(b, on="s", how="inner")
    names = {k[0] for k in merged.__dask_graph__() if isinstance(k, tuple)}
    assert len({n for n in names if n.startswith(MAP)}) == 2, "two shuffles, one per side"
    expected = by(left.merge(right, on="s"), ["i_x", "i_y"])
    for _ in range(2):
        got = merged.compute(scheduler=raydag.ray_get)
        pd.testing.assert_frame_equal(by(got, ["i_x", "i_y"]), expected)
    assert_store_empty()


def test_half_persisted_then_all(assert_store_empty):
    """Persisting half of the outputs, then computing all: both right, and independent
    (dropping the persisted half frees it without touching the other compute)."""
    pdf = frame(20_000)
    x = dd.from_pandas(pdf, npartitions=6).shuffle("k", npartitions=8)
    (half,) = raydag.persist(x.partitions[:4])
    full = x.compute(scheduler=raydag.ray_get)
    pd.testing.assert_frame_equal(by(full, ["i"]), pdf)
    got_half = half.compute(scheduler=raydag.ray_get)
    expected_half = x.partitions[:4].compute(scheduler="sync")
    pd.testing.assert_frame_equal(by(got_half, ["i"]), by(expected_half, ["i"]))
    del half
    assert_store_empty()


class Boom(Exception):
    pass


def explode(g: pd.DataFrame) -> pd.DataFrame:
    if (g["i"] == 3).any():
        raise Boom("key 3 is cursed")
    return g


def test_user_exception_surfaces_unchanged_without_retries(assert_store_empty):
    ddf = dd.from_pandas(frame(), npartitions=6)
    x = ddf.groupby("k").apply(explode, meta=ddf._meta.drop(columns="k"))
    with pytest.raises(Boom, match="key 3 is cursed"):
        x.compute(scheduler=raydag.ray_get)
    summary = raydag.last_run().summary()
    assert summary["retries"] == 0 and summary["failures"] == 1, summary
    assert_store_empty()


def unhashable(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(s=[[v] for v in df["s"]])


def test_error_inside_the_map_surfaces_unchanged(assert_store_empty):
    """Hashing an unhashable key fails in the shuffle itself: pandas' own error."""
    ddf = dd.from_pandas(frame(), npartitions=4)
    x = ddf.map_partitions(unhashable, meta=ddf._meta).shuffle("s")
    with pytest.raises(TypeError, match="unhashable"):
        x.compute(scheduler=raydag.ray_get)
    assert raydag.last_run().summary()["retries"] == 0
    assert_store_empty()


def wrong_columns(df: pd.DataFrame) -> pd.DataFrame:
    return df.rename(columns={"x": "y"})


def test_incompatible_partitions_give_a_clear_error(assert_store_empty):
    ddf = dd.from_pandas(frame(), npartitions=4)
    x = ddf.map_partitions(wrong_columns, meta=ddf._meta, enforce_metadata=False).shuffle("k")
    with pytest.raises(IncompatiblePartitionError, match=r"missing \['x'\], unexpected \['y'\]"):
        x.compute(scheduler=raydag.ray_get)
    assert_store_empty()


def test_other_methods_are_left_to_dask():
    pdf = frame(1000)
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        x = dd.from_pandas(pdf, npartitions=4).shuffle("k")
        assert not uses_raydag_shuffle(x)
        pd.testing.assert_frame_equal(by(x.compute(scheduler=raydag.ray_get), ["i"]), pdf)
