"""dask.dataframe shuffles: raydag's shuffle against the "tasks" method under raydag,
dask's threads scheduler and distributed's p2p on a LocalCluster, in one run.

Two workloads on ``--rows`` rows (10M by default) in ``--partitions`` partitions (64),
made on the workers (``dd.from_map``), each ending in a per-partition checksum so that
no contender ships the data to the driver and all must agree:

- **set_index**: ``df.set_index("k")`` on a random int64 key (its divisions pass
  included: dask computes quantiles first);
- **merge**: ``df.merge(other, on="k")``, a hash join with ``other`` a fifth of the
  rows in as many partitions, keys drawn so that each row matches about one.

Contenders (each builds its collections under its own settings):

| contender            | scheduler          | shuffle method                              |
|----------------------|--------------------|---------------------------------------------|
| ``raydag``           | raydag.ray_get     | ``raydag`` (``raydag.shuffle.enable()``)    |
| ``raydag tasks``     | raydag.ray_get     | ``tasks``                                   |
| ``threads``          | dask threads       | dask's default without a Client: ``disk``   |
| ``distributed p2p``  | LocalCluster       | ``p2p`` (2 worker processes x 1 thread)     |
| ``no shuffle``       | raydag.ray_get     | none: a bound, see below                    |

``no shuffle`` is not a shuffle: it builds raydag's graph with each output partition
being input partition j passed through (no map, no pieces), every other task the same
(the divisions pass, the key column, the sort, the checksum). No rows move, so a merge
matches only the keys that happen to share a partition (fewer rows after it: less
work), and its checksums are not compared. Its time is what the rest of the workload
takes under raydag: no shuffle implementation can take less. ``tasks / no shuffle`` is
then the most that any shuffle could gain over the tasks method on this workload.

With ``--in-flight 2`` (the default), both raydag contenders also run with two Ray
tasks in flight per CPU instead of raydag's default one. With ``--inputs-per-map 1``
(the default), raydag's shuffle also runs with one input partition per map (as before
maps read several: 4,096 pieces at 64 partitions instead of 1,024).

Columns: wall seconds (median of ``--repeats``), tasks in the graph handed to the
scheduler (and Ray tasks submitted, for raydag), peak memory: the object stores'
total for the Ray contenders (sampled every 100 ms), the growth of the driver's and
its children's RSS for the others, and time over ``raydag``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
from _common import print_header, ray_settings, table, write_json

import raydag
import raydag.observe.record
import raydag.runtime
import raydag.shuffle
from raydag.runtime.stores import StoreSampler, shared_reader


def make_part(i: int, rows: int, keys: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed * 100_003 + i)
    return pd.DataFrame(
        {
            "k": rng.integers(0, keys, rows),
            "id": np.arange(i * rows, (i + 1) * rows),
            "x": rng.normal(size=rows),
            "y": rng.normal(size=rows),
        }
    )


def checksum(df: pd.DataFrame) -> pd.DataFrame:
    numeric = df.select_dtypes("number")
    row = {"rows": len(df), **{c: float(numeric[c].sum()) for c in numeric.columns}}
    if df.index.name == "k":
        row["index"] = float(df.index.to_numpy().sum())
        row["sorted"] = bool(df.index.is_monotonic_increasing)
    return pd.DataFrame([row])


def frame(rows: int, parts: int, keys: int, seed: int) -> dd.DataFrame:
    per = rows // parts
    fn = functools.partial(make_part, rows=per, keys=keys, seed=seed)
    return dd.from_map(fn, range(parts), meta=make_part(0, 0, keys, seed))


def workloads(rows: int, parts: int) -> dict[str, Callable[[], dd.DataFrame]]:
    def set_index() -> dd.DataFrame:
        x = frame(rows, parts, 2**62, 1).set_index("k")
        return x.map_partitions(checksum)

    def merge() -> dd.DataFrame:
        small = rows // 5
        left = frame(rows, parts, small, 2)
        right = frame(small, parts, small, 3).rename(columns={"id": "rid", "x": "rx", "y": "ry"})
        return left.merge(right, on="k").map_partitions(checksum)

    return {"set_index": set_index, "merge": merge}


# ---- contenders --------------------------------------------------------------------------


@contextlib.contextmanager
def raydag_shuffle(in_flight: float = 1.0, per_map: int | str = "auto") -> Iterator[dict]:
    with (
        raydag.shuffle.enable(),
        dask.config.set(
            {
                "raydag.scheduling.in-flight-per-cpu": in_flight,
                "raydag.shuffle.inputs-per-map": per_map,
            }
        ),
    ):
        yield {"scheduler": raydag.ray_get}


BOUND = "no shuffle"  # not a contender: a floor under any shuffle


def _pass(df: pd.DataFrame, ignore_index: bool) -> pd.DataFrame:
    return df.reset_index(drop=True) if ignore_index else df


@contextlib.contextmanager
def no_shuffle() -> Iterator[dict]:
    """raydag's shuffle with its maps and pieces taken out: output j is input j."""
    from dask._task_spec import Task, TaskRef

    from raydag.shuffle.expr import RaydagShuffle

    def layer(self: RaydagShuffle) -> dict:
        nin = self.frame.npartitions
        return {
            (self._name, out): Task(
                (self._name, out), _pass, TaskRef((self.frame._name, j % nin)), self.ignore_index
            )
            for out, j in enumerate(self._partitions)
        }

    original = RaydagShuffle._layer
    RaydagShuffle._layer = layer
    try:
        with raydag_shuffle() as opts:
            yield opts
    finally:
        RaydagShuffle._layer = original


@contextlib.contextmanager
def raydag_tasks(in_flight: float = 1.0) -> Iterator[dict]:
    with dask.config.set(
        {
            "dataframe.shuffle.method": "tasks",
            "scheduler": raydag.ray_get,
            "raydag.scheduling.in-flight-per-cpu": in_flight,
        }
    ):
        yield {"scheduler": raydag.ray_get}


@contextlib.contextmanager
def threads() -> Iterator[dict]:
    with dask.config.set({"scheduler": "threads"}):
        yield {"scheduler": "threads"}


@contextlib.contextmanager
def p2p(workers: int) -> Iterator[dict]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
        dask.config.set({"dataframe.shuffle.method": "p2p"}),
    ):
        yield {"scheduler": client.get}


class RSSPeak:
    """Peak growth of this process's and its children's resident memory."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self._total()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _total(self) -> int:
        total = self.proc.memory_info().rss
        for c in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += c.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._total())
            time.sleep(0.1)

    def __enter__(self) -> RSSPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    @property
    def grown(self) -> int:
        return self.peak - self.base


def _forget_divisions() -> None:
    """Empty dask's cache of computed divisions (dask-expr's ``divisions_lru``)."""
    with contextlib.suppress(ImportError):
        from dask.dataframe.dask_expr._shuffle import divisions_lru

        divisions_lru.data.clear()


def run_one(name: str, build: Callable[[], dd.DataFrame], ctx: Any, on_ray: bool) -> dict:
    with ctx as opts:
        x = build()
        # Timed from the collection: dask computes set_index's divisions when it first
        # lowers the expression (``compute`` or ``__dask_graph__``), with the scheduler
        # of the moment, and keeps them for the same input: forgotten here, so that
        # every contender pays that pass, inside its timed part.
        _forget_divisions()
        t0 = time.perf_counter()
        if on_ray:
            with (
                StoreSampler(0.1, reader=shared_reader()) as sampler,
                raydag.observe.record.collecting() as runs,
            ):
                result = x.compute(**opts)
            peak = sampler.peak_total_used
            # Ray tasks and the tasks' own execution time over every compute in the
            # timed part (set_index's divisions pass is one of its own): over the
            # CPUs, a floor under any schedule of them.
            ray_tasks = sum(
                int(r.events[r.events.event == "submitted"].group.nunique()) for r in runs
            )
            work = sum(float(r.tasks.duration.sum()) for r in runs)
        else:
            with RSSPeak() as rss:
                result = x.compute(**opts)
            peak, ray_tasks, work = rss.grown, None, None
        seconds = time.perf_counter() - t0
        # the tasks in the graph the scheduler got (without the divisions pass's)
        tasks = len(dict(x.__dask_graph__()))
    total = result.drop(columns=["sorted"], errors="ignore").sum()
    if "sorted" in result:
        assert result["sorted"].all(), f"{name}: a partition is not sorted"
    return {
        "seconds": seconds,
        "tasks": tasks,
        "ray_tasks": ray_tasks,
        "work": work,
        "peak": peak,
        "sums": total,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--partitions", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workers", type=int, default=2, help="distributed worker processes")
    p.add_argument("--only", nargs="*", default=None, help="contenders to run")
    p.add_argument(
        "--in-flight",
        nargs="*",
        type=float,
        default=[2.0],
        help="also run both raydag contenders with these raydag.scheduling.in-flight-per-cpu",
    )
    p.add_argument(
        "--inputs-per-map",
        nargs="*",
        type=int,
        default=[1],
        help="also run raydag's shuffle with this raydag.shuffle.inputs-per-map (1: the "
        "shuffle before maps read several inputs)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()

    raydag.connect()
    meta = print_header(
        "dask.dataframe shuffles",
        {
            "ray": ray_settings(),
            "workload": f"{args.rows:,} rows, {args.partitions} partitions, "
            f"{args.repeats} timed run(s) after a warm-up at 1/20 the rows",
        },
    )
    contenders: dict[str, tuple[Callable[[], Any], bool]] = {
        "raydag": (raydag_shuffle, True),
        "raydag tasks": (raydag_tasks, True),
        "threads": (threads, False),
        "distributed p2p": (lambda: p2p(args.workers), False),
        BOUND: (no_shuffle, True),
    }
    for f in args.in_flight:  # raydag's Ray tasks in flight per CPU (default 1)
        contenders[f"raydag, {f:g} per CPU"] = (functools.partial(raydag_shuffle, f), True)
        contenders[f"raydag tasks, {f:g} per CPU"] = (functools.partial(raydag_tasks, f), True)
    for k in args.inputs_per_map:
        label = f"raydag, {k} input{'s' if k > 1 else ''} per map"
        contenders[label] = (functools.partial(raydag_shuffle, 1.0, k), True)
    if args.only:
        contenders = {k: v for k, v in contenders.items() if k in args.only}
    small = workloads(args.rows // 20, args.partitions)
    full = workloads(args.rows, args.partitions)
    results: dict = {}
    for wname in full:
        for cname, (ctx, on_ray) in contenders.items():
            run_one(cname, small[wname], ctx(), on_ray)  # warm-up: workers, imports
            runs = [run_one(cname, full[wname], ctx(), on_ray) for _ in range(args.repeats)]
            results[(wname, cname)] = runs
            r = runs[-1]
            print(
                f"  {wname:9} {cname:16} {statistics.median(x['seconds'] for x in runs):8.1f} s"
                f"  tasks {r['tasks']}  peak {r['peak'] / 2**20:,.0f} MiB",
                flush=True,
            )
    rows = []
    for wname in full:
        ref = statistics.median(x["seconds"] for x in results.get((wname, "raydag"), [{}]) or [0])
        sums = None
        for cname in contenders:
            runs = results[(wname, cname)]
            sec = statistics.median(x["seconds"] for x in runs)
            r = runs[-1]
            if cname != BOUND and sums is None:
                sums = r["sums"]
            elif cname != BOUND:  # every contender computes the same rows and sums
                pd.testing.assert_series_equal(r["sums"], sums, rtol=1e-6)
            rows.append(
                [
                    wname,
                    cname,
                    sec,
                    r["tasks"],
                    r["ray_tasks"],
                    r["work"],
                    f"{r['peak'] / 2**20:,.0f} MiB ({'stores' if r['ray_tasks'] is not None else 'RSS'})",
                    sec / ref if ref else None,
                ]
            )
    print()
    print(
        table(
            [
                "workload",
                "contender",
                "seconds",
                "graph tasks",
                "Ray tasks",
                "task work s",
                "peak",
                "x raydag",
            ],
            rows,
        )
    )
    print(f"all contenders computed the same rows and checksums ({BOUND!r} aside)")
    bounds = {}
    for wname in full:
        med = {
            c: statistics.median(x["seconds"] for x in results[(wname, c)])
            for c in ("raydag", "raydag tasks", BOUND)
            if (wname, c) in results
        }
        if len(med) == 3:
            bounds[wname] = {
                "tasks / raydag": med["raydag tasks"] / med["raydag"],
                "tasks / no shuffle": med["raydag tasks"] / med[BOUND],
            }
            print(
                f"{wname}: the tasks method took {bounds[wname]['tasks / raydag']:.2f}x "
                f"raydag's shuffle; {bounds[wname]['tasks / no shuffle']:.2f}x the workload "
                "without a shuffle, the most any shuffle could gain over it here"
            )
    print(
        "task work s: the Ray tasks' own execution time in the timed computes (raydag's "
        "records; set_index's divisions pass included); over the CPUs, a floor under any "
        "schedule of those tasks"
    )
    if args.json:
        write_json(
            args.json,
            {
                **meta,
                "bounds": bounds,
                "results": {
                    f"{w}/{c}": [{k: v for k, v in x.items() if k != "sums"} for x in runs]
                    for (w, c), runs in results.items()
                },
            },
        )


if __name__ == "__main__":
    main()
