"""dask-awkward graphs, as coffea analyses build them, give sync's results on raydag."""

from __future__ import annotations

import warnings

import dask
import numpy as np
import pytest

import raydag

dak = pytest.importorskip("dask_awkward")
ak = pytest.importorskip("awkward")

pytestmark = [pytest.mark.hep, pytest.mark.usefixtures("ray_cluster")]


def _events(n=3000):
    """Jagged records like a NanoAOD slice; big enough that partitions go through plasma."""
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 5, n)
    events = []
    for i, c in enumerate(counts):
        events.append(
            {
                "run": int(i // 1000),
                "met": float(rng.exponential(30.0)),
                "muons": [
                    {"pt": float(rng.exponential(20.0)), "eta": float(rng.normal(0, 1.5))}
                    for _ in range(c)
                ],
            }
        )
    return ak.Array(events)


@pytest.fixture(scope="module")
def events():
    return dak.from_awkward(_events(), npartitions=3)


def leading_pt(part):
    """A per-partition function, as coffea processors use map_partitions."""
    pt = ak.sort(part.muons.pt, axis=1, ascending=False)
    return ak.fill_none(ak.firsts(pt), 0.0) + part.met * 0


def assert_same(got, expected):
    if isinstance(expected, ak.Array):
        assert ak.to_list(got) == ak.to_list(expected)
    else:
        np.testing.assert_allclose(got, expected)


SELECTIONS = {
    "met-cut": lambda ev: ev[ev.met > 20],
    "muon-cut": lambda ev: ev.muons[(ev.muons.pt > 10) & (abs(ev.muons.eta) < 2.4)],
    "num": lambda ev: ak.num(ev.muons, axis=1),
    "sum-axis1": lambda ev: ak.sum(ev.muons.pt, axis=1),
    "sum-all": lambda ev: ak.sum(ev.muons.pt, axis=None),
    "count-selected": lambda ev: ak.sum(ak.num(ev.muons[ev.muons.pt > 15], axis=1) >= 2),
    "map_partitions": lambda ev: dak.map_partitions(leading_pt, ev),
    "method-map_partitions": lambda ev: ev.map_partitions(leading_pt),
}


@pytest.mark.parametrize("build", SELECTIONS.values(), ids=SELECTIONS.keys())
def test_dask_awkward(build, events, assert_store_empty):
    coll = build(events)
    expected = coll.compute(scheduler="sync")
    got = coll.compute(scheduler=raydag.ray_get)
    assert_same(got, expected)
    del got, expected
    assert_store_empty()


def test_several_outputs_one_compute(events, assert_store_empty):
    selected = events[events.met > 25]
    colls = (ak.num(selected.muons, axis=1), ak.sum(selected.muons.pt, axis=1), selected.met)
    expected = dask.compute(*colls, scheduler="sync")
    got = dask.compute(*colls, scheduler=raydag.ray_get)
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    del got, expected, g, e
    assert_store_empty()


def test_to_parquet_under_config_scheduler(tmp_path, events, assert_store_empty):
    """``dak.to_parquet(compute=True)`` computes with the configured scheduler: raydag."""
    calls = []

    def spy(dsk, keys, **kwargs):
        calls.append(keys)
        return raydag.ray_get(dsk, keys, **kwargs)

    selected = events[events.met > 10]
    with dask.config.set(scheduler=spy), warnings.catch_warnings():
        # dask-awkward's writers carry its own ``ak_output`` annotation: no warning
        warnings.simplefilter("error", raydag.api.UnknownAnnotationWarning)
        dak.to_parquet(selected, str(tmp_path), compute=True)
    assert calls, "to_parquet did not compute through raydag"
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.is_file()) == [".parquet"] * 3

    back = ak.from_parquet(str(tmp_path))
    expected = selected.compute(scheduler="sync")
    assert len(back) == len(expected) > 0
    assert ak.to_list(back) == ak.to_list(expected)
    assert_store_empty()
