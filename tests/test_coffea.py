"""coffea on raydag: ``RayExecutor`` for ``processor.Runner``, and the dask path of a skim."""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("coffea")
pytest.importorskip("dask_histogram")

from coffea import processor  # noqa: E402

import raydag  # noqa: E402
from raydag.api import IgnoredArgumentsWarning  # noqa: E402
from raydag.coffea import RayExecutor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hep_skim  # noqa: E402

pytestmark = [pytest.mark.hep, pytest.mark.usefixtures("ray_cluster")]

N = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    hep_skim.ship_by_value()  # Ray workers cannot import examples/
    return hep_skim.make_dataset(tmp_path_factory.mktemp("nano"), files=3, events=3000)


# ---- the executor on its own: items, function, accumulator --------------------------


class MergeLog:
    """An accumulator that remembers in which processes it was merged, and how often."""

    def __init__(self, pids=frozenset(), merges=0):
        self.pids = frozenset(pids)
        self.merges = merges

    def __add__(self, other):
        return MergeLog(self.pids | other.pids | {os.getpid()}, self.merges + other.merges + 1)


def one(item):
    return {"n": 1, "sum": item, "log": MergeLog()}


def fail_last(item):
    if item == N - 1:
        time.sleep(1.0)  # the others (submitted before it) finish meanwhile
        raise ValueError(f"bad item {item}")
    return one(item)


class KillOnce:
    """Kills its worker process the first time it sees ``victim``: a lost worker."""

    def __init__(self, marker, victim):
        self.marker, self.victim = str(marker), victim

    def __call__(self, item):
        if item == self.victim and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return one(item)


@pytest.mark.parametrize("compression", [1, None])
def test_tree_reduction_on_cluster(compression, assert_store_empty):
    ex = RayExecutor(status=False, compression=compression, treereduction=4)
    out, error = ex(list(range(N)), one, None)
    assert error == 0
    assert out["n"] == N and out["sum"] == sum(range(N))
    # N partial outputs make one by N - 1 pairwise additions, none of them here
    assert out["log"].merges == N - 1
    assert out["log"].pids and os.getpid() not in out["log"].pids
    del out
    assert_store_empty()


def test_accumulator_added_on_the_driver():
    out, error = RayExecutor(status=False)(list(range(5)), one, {"n": 10})
    assert error == 0 and out["n"] == 15


def test_failure_raises_the_original_exception(assert_store_empty):
    with pytest.raises(ValueError, match=f"bad item {N - 1}"):
        RayExecutor(status=False)(list(range(N)), fail_last, None)
    assert_store_empty()


def test_recoverable_returns_what_finished(assert_store_empty):
    out, error = RayExecutor(status=False, recoverable=True)(list(range(N)), fail_last, None)
    assert isinstance(error, ValueError) and f"bad item {N - 1}" in str(error)
    assert out["n"] == N - 1 and out["sum"] == sum(range(N - 1))
    del out
    assert_store_empty()


def test_lost_worker_is_retried(tmp_path):
    out, error = RayExecutor(status=False)(list(range(N)), KillOnce(tmp_path / "killed", 5), None)
    assert (tmp_path / "killed").exists(), "the worker was never killed"
    assert error == 0 and out["n"] == N and out["sum"] == sum(range(N))


# ---- through processor.Runner, on NanoAOD files ----------------------------------------


def run(files, out_dir, executor, chunksize=1000):
    return hep_skim.run_runner(files, chunksize, out_dir, executor)


def test_runner_equals_iterative(files, tmp_path, assert_store_empty):
    want = run(files, tmp_path / "iterative", processor.IterativeExecutor(status=False))
    got = run(files, tmp_path / "ray", RayExecutor(status=False, treereduction=3))
    assert want["rows"] > 0 and want["hist"].sum() == want["rows"]
    assert got["rows"] == want["rows"]
    np.testing.assert_array_equal(got["hist"], want["hist"])
    assert hep_skim.parquet_rows(tmp_path / "ray") == want["rows"]
    assert len(list((tmp_path / "ray").glob("*.parquet"))) == 9  # 3 files x 3 chunks
    assert_store_empty()


class FailingSkim(hep_skim.SkimProcessor):
    def process(self, events):
        if events.metadata["entrystart"] == 1000 and events.metadata["filename"].endswith(
            "_1.root"
        ):
            raise RuntimeError("corrupt chunk")
        return super().process(events)


def test_runner_recoverable_partial_output(files, tmp_path):
    (tmp_path / "out").mkdir()
    runner = processor.Runner(
        executor=RayExecutor(status=False, recoverable=True, retries=0),
        schema=hep_skim.SyntheticNanoSchema,
        chunksize=1000,
    )
    with pytest.raises(Exception, match="corrupt chunk") as info:
        runner({"synthetic": files}, FailingSkim(str(tmp_path / "out")), treename="Events")
    partial = info.value.partial_output
    written = hep_skim.parquet_rows(tmp_path / "out")
    assert 0 < partial["events"] < 9000 and partial["rows"] <= written
    assert partial["hist"].sum() == partial["rows"]


# ---- the dask path, with the keyword arguments another backend's get takes ----------


def test_dask_skim_with_foreign_kwargs(files, tmp_path, assert_store_empty):
    want = hep_skim.run_dask(files, 2, tmp_path / "sync", "sync")
    write, h = hep_skim.dask_skim(files, 2, tmp_path / "raydag")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, h = raydag_compute(write, h, **hep_skim.FOREIGN_KWARGS)
    ignored = [w for w in caught if issubclass(w.category, IgnoredArgumentsWarning)]
    assert len(ignored) == 1, [str(w.message) for w in caught]
    assert "not known" not in str(ignored[0].message)
    assert hep_skim.parquet_rows(tmp_path / "raydag") == want["rows"] > 0
    np.testing.assert_array_equal(h.values(), want["hist"])
    assert_store_empty()


def raydag_compute(*colls, **kwargs):
    import dask

    return dask.compute(*colls, scheduler=raydag.ray_get, **kwargs)
