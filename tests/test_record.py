"""The run record: the transcript replayed into tables, written as parquet, read back.

The first tests drive the real state machine on a simulated cluster (``simrun``),
so faults happen at known times; the rest record real computes on the shared
local Ray.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import dask
import dask.array as da
import pandas as pd
import pytest
from dask.diagnostics import ProgressBar
from simrun import NODE_A, NODE_B, WALL0, Sim

import raydag
from raydag.observe import record
from raydag.observe.record import EVENT_COLUMNS, STORE_COLUMNS, RunRecord

# ---- a simulated run with faults ------------------------------------------------------


@pytest.fixture(scope="module")
def simulated() -> RunRecord:
    return Sim().run()


def test_every_task_finishes_once_per_execution(simulated):
    ev = simulated.events
    assert list(ev.columns) == [c for c, _, _ in EVENT_COLUMNS]
    finished = ev[ev.event == "finished"]
    assert set(finished.key) == {str(k) for k in Sim().state.tasks}
    # each execution has a start row, on the same worker, before its finish
    started = ev[ev.event == "started"].set_index(["group", "attempt", "key"])
    for _, row in finished.iterrows():
        s = started.loc[(row.group, row.attempt, row.key)]
        assert s.worker == row.worker and s.node == row.node
        assert s.time == pytest.approx(row.time - row.duration)
    assert (finished.duration > 0).all()
    assert finished.category.isin(["load", "clean", "combine", "flaky", "total"]).all()


def test_node_loss_and_recovery_are_recorded(simulated):
    ev = simulated.events
    lost_node = ev[ev.event == "node-lost"]
    assert list(lost_node.node) == [NODE_B]
    t_lost = float(lost_node.time.iloc[0])
    assert t_lost == pytest.approx(1.0)
    # in-flight tasks on the dead node are retried without counting as attempts
    retried = ev[(ev.event == "retried") & ev.reason.str.startswith("node lost")]
    assert len(retried) == 2 and (retried.attempt == 0).all()
    # its values are lost and recomputed, in one wave, with what they need
    lost = ev[ev.event == "lost"]
    recovery = ev[ev.event == "recovery"]
    assert len(lost) and (lost.wave == 1).all() and (lost.time == t_lost).all()
    assert set(lost.key) <= set(recovery.key)
    assert (recovery.wave == 1).all()
    # ran on the dead node first, then again on the survivor, in wave 1
    redone = ev[(ev.event == "finished") & (ev.wave == 1)]
    assert set(redone.key) == set(recovery.key)
    assert (redone.node == NODE_A).all() and (redone.time > t_lost).all()
    before = ev[(ev.event == "finished") & ev.key.isin(lost.key) & (ev.time < t_lost)]
    assert (before.node == NODE_B).all() and set(before.key) == set(lost.key)
    # nothing runs on the dead node afterwards
    assert not ((ev.event == "started") & (ev.node == NODE_B) & (ev.time > t_lost)).any()
    assert list(ev[ev.event == "capacity"].slots) == [2.0]


def test_retry_duplicate_and_cancel(simulated):
    ev = simulated.events
    flaky = ev[ev.key == "flaky-0"].sort_values("seq", kind="stable")
    assert list(flaky.event) == [
        "submitted",
        "retried",
        "submitted",
        "started",
        "finished",
        "released",
    ]
    assert list(flaky.attempt[:5]) == [0, 1, 1, 1, 1]
    assert "worker died" in flaky[flaky.event == "retried"].reason.iloc[0]
    c2 = ev[ev.key == "('combine', 2)"]
    assert sorted(c2.event) == sorted(
        ["submitted", "duplicated", "started", "finished", "cancelled", "released"]
    )
    won = c2[c2.event == "finished"]
    assert won.duplicate.all() and won.group.iloc[0] == 10_000
    cancelled = c2[c2.event == "cancelled"]  # the original, once the copy won
    assert not cancelled.duplicate.any() and cancelled.group.iloc[0] != 10_000
    summary = simulated.summary()
    assert summary["duplicates"] == summary["duplicates_won"] == 1
    assert summary["retries"] == 3 and summary["recovery_waves"] == 1
    assert summary["nodes_lost"] == 1 and summary["status"] == "ok"


def test_bytes_add_up(simulated):
    ev = simulated.events
    finished = ev[ev.event == "finished"]
    assert (finished.nbytes == 8 * 2**20).all()
    total = finished[finished.key == "total"].iloc[0]
    # total reads combine-1..5 and flaky-0: six 8 MiB values
    assert total.input_bytes == 6 * 8 * 2**20
    loads = finished[finished.category == "load"]
    assert (loads.input_bytes == 0).all()
    assert simulated.summary()["bytes_made"] == int(finished.nbytes.sum())


def test_failed_run(tmp_path):
    rec = Sim(fail=True, kill_at=None, duplicate=False).run()
    assert rec.meta["status"] == "failed"
    ev = rec.events
    failed = ev[ev.event == "failed"]
    assert list(failed.key) == ["flaky-0"] and "bad input" in failed.reason.iloc[0]
    # the failure cancels what still runs and releases what is held
    assert (ev.event == "cancelled").any()
    path = rec.write(tmp_path / "run")
    assert json.loads((path / "run.json").read_text())["status"] == "failed"


def test_write_and_load(simulated, tmp_path):
    path = simulated.write(tmp_path / "run")
    assert sorted(p.name for p in path.iterdir()) == [
        "events.parquet",
        "run.json",
        "stores.parquet",
    ]
    ev = pd.read_parquet(path / "events.parquet")  # one line of pandas
    assert list(ev.columns) == [c for c, _, _ in EVENT_COLUMNS]
    assert len(ev) == len(simulated.events)
    st = pd.read_parquet(path / "stores.parquet")
    assert list(st.columns) == [c for c, _, _ in STORE_COLUMNS]
    assert set(st.node) == {NODE_A, NODE_B} and (st.capacity_bytes > 0).all()
    meta = json.loads((path / "run.json").read_text())
    assert meta["summary"]["recomputed"] == simulated.summary()["recomputed"]
    again = RunRecord.load(path)
    pd.testing.assert_frame_equal(again.events, simulated.events)
    assert again.summary() == simulated.summary()


def test_merge_keeps_runs_apart(simulated):
    later = Sim(kill_at=None, duplicate=False, wall=WALL0 + 10)
    merged = RunRecord.merge([simulated, later.run()])
    ev = merged.events
    assert set(ev.run) == {0, 1}
    assert ev[ev.run == 1].time.min() >= 10
    assert merged.summary()["computes"] == 2


# ---- real computes -------------------------------------------------------------------


def _array():
    return da.arange(400, chunks=20).reshape(20, 20).rechunk(5).sum()


@pytest.mark.usefixtures("ray_cluster")
def test_record_of_a_real_run(tmp_path):
    x = _array()
    with dask.config.set({"raydag.record.directory": str(tmp_path)}):
        (value,) = dask.compute(x, scheduler=raydag.ray_get)
    assert value == sum(range(400))
    record.flush()  # written after the compute returned, by a thread of its own
    (run_dir,) = tmp_path.iterdir()
    rec = raydag.last_run()
    assert rec is not None and rec.meta["directory"] == str(run_dir)
    ev = pd.read_parquet(run_dir / "events.parquet")
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "ok" and meta["stores_sampled"]
    finished = ev[ev.event == "finished"]
    # one finished row per task of the graph, fused or not
    assert finished.key.is_unique and len(finished) == meta["graph"]["tasks"]
    assert (ev[ev.event == "submitted"].key.value_counts() == 1).all()
    # times: inside the run; work done fits in the CPUs' time
    wall = meta["wall_seconds"]
    assert (finished.time - finished.duration >= -0.05).all() and (
        finished.time <= wall + 0.05
    ).all()
    assert finished.duration.sum() <= 2 * wall
    assert finished.node.notna().all() and (finished.worker > 0).all()
    # every released key was made first; only the output is left
    released = set(ev[ev.event == "released"].key)
    roots = set(finished.dropna(subset=["nbytes"]).key)
    assert released <= roots and len(roots - released) == 1
    # sizes: each group's input bytes are the sizes of values made earlier
    sizes = finished.dropna(subset=["nbytes"]).set_index("key").nbytes
    assert sizes.sum() == meta["summary"]["bytes_made"] > 0
    assert finished.input_bytes.dropna().max() <= sizes.sum()
    st = pd.read_parquet(run_dir / "stores.parquet")
    assert len(st) >= 2 and (st.capacity_bytes > 0).all() and (st.time >= 0).all()


@pytest.mark.usefixtures("ray_cluster")
def test_last_run_is_kept_in_memory_and_nothing_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dask.compute(_array(), scheduler=raydag.ray_get)
    rec = raydag.last_run()
    assert rec is not None and rec.meta["status"] == "ok"
    assert (rec.events.event == "finished").sum() == rec.meta["graph"]["tasks"]
    assert not rec.meta["stores_sampled"]  # sampled only when written or shown
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("ray_cluster")
def test_record_off_and_too_big(tmp_path):
    with dask.config.set({"raydag.record.enabled": False}):
        dask.compute(_array(), scheduler=raydag.ray_get)
    assert raydag.last_run() is None
    with dask.config.set({"raydag.record.max-tasks": 5}):
        dask.compute(_array(), scheduler=raydag.ray_get)
    assert raydag.last_run() is None
    # a directory asks for the record whatever its size
    with dask.config.set({"raydag.record.max-tasks": 5, "raydag.record.directory": str(tmp_path)}):
        dask.compute(_array(), scheduler=raydag.ray_get)
    record.flush()
    assert raydag.last_run() is not None and len(list(tmp_path.iterdir())) == 1


def boom(x):
    raise ValueError(f"boom {x}")


@pytest.mark.usefixtures("ray_cluster")
def test_a_failed_compute_is_recorded():
    x = dask.delayed(boom)(dask.delayed(sum)([1, 2]))
    with pytest.raises(ValueError, match="boom 3"):
        dask.compute(x, scheduler=raydag.ray_get)
    rec = raydag.last_run()
    assert rec.meta["status"] == "failed" and "boom 3" in rec.meta["error"]
    failed = rec.events[rec.events.event == "failed"]
    assert len(failed) == 1 and failed.category.iloc[0] == "boom"


@pytest.mark.usefixtures("ray_cluster")
def test_progress_beside_dask_progressbar(capsys):
    x = _array()
    with dask.config.set({"raydag.progress.enabled": True}), ProgressBar(width=20):
        (value,) = dask.compute(x, scheduler=raydag.ray_get)
    assert value == sum(range(400))
    out, err = capsys.readouterr()
    assert "100%" in out  # dask's ProgressBar, on stdout
    n = raydag.last_run().meta["graph"]["tasks"]
    assert "raydag" in err and f"{n}/{n}" in err  # raydag's, on stderr, from real completions
    assert "running" in err and "stores" in err


@pytest.mark.usefixtures("ray_cluster")
def test_progress_is_off_when_not_interactive(capsys):
    dask.compute(_array(), scheduler=raydag.ray_get)  # pytest's stderr is no terminal
    assert "raydag" not in capsys.readouterr().err


@pytest.mark.usefixtures("ray_cluster")
def test_performance_report(tmp_path):
    path = tmp_path / "report.html"
    with raydag.performance_report(path) as runs:
        dask.compute(_array(), scheduler=raydag.ray_get)
        dask.compute(_array() + 1, scheduler=raydag.ray_get)
    assert len(runs) == 2 and all(r.meta["stores_sampled"] for r in runs)
    text = path.read_text()
    assert "raydag performance report" in text and "Bokeh" in text
    assert "<script src=" not in text and 'rel="stylesheet" href="http' not in text  # offline


@pytest.mark.usefixtures("ray_cluster")
def test_performance_report_written_when_the_block_raises(tmp_path):
    path = tmp_path / "report.html"
    with pytest.raises(ValueError), raydag.performance_report(path):
        dask.compute(dask.delayed(boom)(1), scheduler=raydag.ray_get)
    assert path.exists() and "failed" in path.read_text()


@pytest.mark.core_only  # the dask version plays no part: once, in the tests session
def test_cli_report(simulated, tmp_path):
    import subprocess
    import sys

    run_dir = simulated.write(tmp_path / "run")
    out = tmp_path / "r.html"
    env = {**os.environ, "PYTHONPATH": str(Path(record.__file__).parents[1])}
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "raydag", "report", str(run_dir), "-o", str(out)],
        check=True,
        env=env,
        capture_output=True,
    )
    assert out.stat().st_size > 100_000 and time.monotonic() - t0 < 60
    bad = subprocess.run(
        [sys.executable, "-m", "raydag", "report", str(tmp_path / "nothing"), "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a raydag run record" in bad.stderr
