"""Scheduling overhead: dask tasks per second on graphs of tiny tasks.

Two graphs, each handed to five contenders on one embedded local Ray (started by
``raydag.connect()``, so raydag's Ray settings apply to all of them):

  chains  100 chains of 50 ``inc`` tasks and one final ``sum`` (dask.delayed, 5,001 tasks)
  array   ``da.ones(5000, chunks=1).sum()`` (5,000 leaf sums, a tree of partial sums)

  raydag            dask.compute(x, scheduler=raydag.ray_get)
  raydag no fusion  the same with raydag.fusion.enabled=False: one Ray task per dask task
  ray_dask_get      dask.compute(x, scheduler=ray.util.dask.ray_dask_get), Ray's incumbent
  raw Ray           the same number of @ray.remote calls with the same dependencies
                    (chains of calls passing ObjectRefs; for the array graph, one call
                    per task of the dask graph, wired as that graph): Ray's own floor
  dask threads      dask.compute(x, scheduler="threads"): no Ray at all

Tasks are counted in the graph dask hands to a scheduler's get (after dask's own
optimisation), the same count for every contender. Each contender runs once to warm
up, then ``--repeats`` times, contenders interleaved round by round so that load from
other users of the machine spreads over all of them; the table shows the median (and
the best). ``gc.collect()`` runs between timed runs, outside the timing.

    python bench/overhead.py [--repeats 3] [--json results.json]

With ``--small``, the latency of small computes instead (#19): the fixed cost of one
``compute()``, which a notebook session or dask's own test suite pays thousands of times.

  one        dask.delayed(inc)(1): one task
  ten        ten ``inc`` tasks and their sum (dask.delayed, 11 tasks)
  dataframe  a 4-partition pandas dataframe's column sum (dask.dataframe)

  raydag, ray_dask_get, raw Ray (one ``@ray.remote`` call and its ``ray.get``: Ray's
  floor for the one-task graph; for the others, as many calls as tasks, wired the
  same), dask sync, dask threads, and distributed (a ``LocalCluster`` in this process,
  ``processes=False``, 2 threads). Each runs ``--small-warmup`` times, then
  ``--small-repeats`` timed runs interleaved round by round; the median, in ms.
  ``--small-pause S`` sleeps S seconds before each timed run, outside the timing, as
  a notebook's cells are apart: what a scheduler keeps from the last compute is older.

    python bench/overhead.py --small [--small-repeats 200] [--small-pause 0.3] [--json results.json]
"""

from __future__ import annotations

import argparse
import gc
import graphlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import _common
import dask
import dask.array as da
import ray
from dask._task_spec import convert_legacy_graph
from dask.core import flatten
from ray.util.dask import ray_dask_get

import raydag

N_CHAINS = 100
CHAIN_LENGTH = 50
N_CHUNKS = 5000


def inc(x: int) -> int:
    return x + 1


def chains_collection() -> Any:
    d_inc = dask.delayed(inc, pure=False)
    ends = []
    for c in range(N_CHAINS):
        v = c
        for _ in range(CHAIN_LENGTH):
            v = d_inc(v)
        ends.append(v)
    return dask.delayed(sum, pure=False)(ends)


CHAINS_EXPECTED = sum(c + CHAIN_LENGTH for c in range(N_CHAINS))


def array_collection() -> Any:
    return da.ones(N_CHUNKS, chunks=1).sum()


# ---- what a scheduler receives ---------------------------------------------------


class _Captured(Exception):
    pass


@dataclass
class Received:
    """The graph dask hands to a scheduler's get: its dependencies, in topological order."""

    order: list[tuple[Hashable, tuple]]
    outputs: list

    def __len__(self) -> int:
        return len(self.order)


def received_graph(x: Any) -> Received:
    """What ``dask.compute(x, scheduler=...)`` passes to a get, without running it."""
    seen: dict[str, Received] = {}

    def capture(dsk: Any, keys: Any, **kwargs: Any) -> Any:
        if not isinstance(dsk, Mapping):
            dsk = dsk.__dask_graph__()
        tasks = convert_legacy_graph(dict(dsk))
        deps = {k: tuple(t.dependencies) for k, t in tasks.items()}
        order = list(graphlib.TopologicalSorter(deps).static_order())
        seen["g"] = Received([(k, deps[k]) for k in order], list(flatten(keys)))
        raise _Captured

    try:
        dask.compute(x, scheduler=capture)
    except _Captured:
        return seen["g"]
    raise RuntimeError("the scheduler was never called")


# ---- raw Ray ---------------------------------------------------------------------


@ray.remote
def r_inc(x: int) -> int:
    return x + 1


@ray.remote
def r_sum(*xs: Any) -> Any:
    return sum(xs)


@ray.remote
def r_node(*xs: float) -> float:
    """One task of the mirrored array graph: a leaf makes 1.0, the others add inputs."""
    return float(sum(xs)) if xs else 1.0


def raw_chains() -> int:
    """100 chains of 50 remote calls passing ObjectRefs, then one sum: 5,001 calls."""
    ends = []
    for c in range(N_CHAINS):
        v: Any = c
        for _ in range(CHAIN_LENGTH):
            v = r_inc.remote(v)
        ends.append(v)
    return ray.get(r_sum.remote(*ends))


def raw_mirror(g: Received) -> Callable[[], Any]:
    """One remote call per task of ``g``, each taking its dependencies' ObjectRefs."""

    def run() -> Any:
        refs: dict[Hashable, ray.ObjectRef] = {}
        for key, deps in g.order:
            refs[key] = r_node.remote(*[refs[d] for d in deps])
        return ray.get([refs[k] for k in g.outputs])

    return run


# ---- the runs ----------------------------------------------------------------------


@dataclass
class Result:
    graph: str
    contender: str
    tasks: int
    times: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


# ---- small computes (--small) ---------------------------------------------------------

N_TEN = 10
N_PARTITIONS = 4


def ten_collection() -> Any:
    d_inc = dask.delayed(inc, pure=False)
    return dask.delayed(sum, pure=False)([d_inc(i) for i in range(N_TEN)])


def dataframe_collection() -> Any:
    import dask.dataframe as dd
    import pandas as pd

    frame = pd.DataFrame({"x": range(400), "y": [1.5] * 400})
    return dd.from_pandas(frame, npartitions=N_PARTITIONS).x.sum()


def raw_ten() -> int:
    return ray.get(r_sum.remote(*[r_inc.remote(i) for i in range(N_TEN)]))


def small_graphs(client: Any) -> dict[str, tuple[int, Any, dict[str, Callable[[], Any]]]]:
    """name -> (tasks as handed to a get, expected value, contenders)."""

    def compute(x: Any, scheduler: Any) -> Callable[[], Any]:
        return lambda: dask.compute(x, scheduler=scheduler)[0]

    out = {}
    for name, x, raw in (
        ("one", dask.delayed(inc, pure=False)(1), lambda: ray.get(r_inc.remote(1))),
        ("ten", ten_collection(), raw_ten),
        ("dataframe", dataframe_collection(), None),
    ):
        g = received_graph(x)
        expected = dask.compute(x, scheduler="sync")[0]
        contenders = {
            "raydag": compute(x, raydag.ray_get),
            "ray_dask_get": compute(x, ray_dask_get),
            "dask sync": compute(x, "sync"),
            "dask threads": compute(x, "threads"),
            "distributed": compute(x, client.get),
        }
        if raw is not None:
            contenders["raw Ray"] = raw
        out[name] = (len(g), expected, contenders)
    return out


def small(args: argparse.Namespace) -> list[Result]:
    """Latency of small computes, each contender's median over many runs."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        graphs = small_graphs(client)
        print("tasks   : " + ", ".join(f"{n} {t}" for n, (t, _, _) in graphs.items()))
        print(
            f"timing  : {args.small_warmup} warm-ups, then the median of "
            f"{args.small_repeats} runs, contenders interleaved"
            + (f", {args.small_pause} s apart" if args.small_pause else "")
        )
        print()
        results: list[Result] = []
        for name, (n_tasks, expected, contenders) in graphs.items():
            times: dict[str, list[float]] = {c: [] for c in contenders}
            for round_ in range(args.small_warmup + args.small_repeats):
                for contender, fn in contenders.items():
                    if args.small_pause and round_ >= args.small_warmup:
                        time.sleep(args.small_pause)
                    t0 = time.perf_counter()
                    value = fn()
                    elapsed = time.perf_counter() - t0
                    if not value == expected:
                        raise AssertionError(f"{name}/{contender}: {value!r} != {expected!r}")
                    if round_ >= args.small_warmup:
                        times[contender].append(elapsed)
                if round_ % 20 == 0:
                    gc.collect()
            results += [Result(name, c, n_tasks, t) for c, t in times.items()]
    rows = []
    for r in results:
        base = {x.contender: x for x in results if x.graph == r.graph}
        rows.append(
            [
                r.graph,
                r.contender,
                f"{1000 * r.median:.2f}",
                f"{1000 * r.best:.2f}",
                f"{r.median / base['raydag'].median:.2f}",
                f"{r.median / base['ray_dask_get'].median:.2f}",
                f"{r.median / base['dask sync'].median:.2f}",
            ]
        )
    print(
        _common.table(
            ["graph", "contender", "median ms", "best ms", "/ raydag", "/ ray_dask_get", "/ sync"],
            rows,
        )
    )
    print()
    print("/ X: this contender's median over X's median (below 1: faster than X)")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per contender")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument(
        "--record",
        action="store_true",
        help="also run raydag with its run record off, and written to disk (#7)",
    )
    ap.add_argument("--small", action="store_true", help="latency of small computes instead")
    ap.add_argument("--small-repeats", type=int, default=200, help="timed runs, with --small")
    ap.add_argument("--small-warmup", type=int, default=10, help="warm-up runs, with --small")
    ap.add_argument(
        "--small-pause", type=float, default=0.0, help="seconds before each timed run, with --small"
    )
    args = ap.parse_args()

    _common.start_ray()  # one embedded Ray with raydag's settings, for every Ray contender
    info = _common.print_header(
        "overhead: latency of small computes"
        if args.small
        else "overhead: dask tasks per second on tiny tasks",
        {"ray": _common.ray_settings()},
    )
    if args.small:
        results = small(args)
        if args.json:
            info["results"] = [{**asdict(r), "median": r.median, "best": r.best} for r in results]
            _common.write_json(args.json, info)
        return

    chains, array = chains_collection(), array_collection()
    g_chains, g_array = received_graph(chains), received_graph(array)
    assert len(g_chains) == N_CHAINS * CHAIN_LENGTH + 1, len(g_chains)

    def dask_with(x: Any, scheduler: Any, **config: Any) -> Callable[[], Any]:
        def run() -> Any:
            with dask.config.set(config):
                return dask.compute(x, scheduler=scheduler)[0]

        return run

    no_fusion = {"raydag.fusion.enabled": False}

    graphs = {
        "chains": (
            len(g_chains),
            CHAINS_EXPECTED,
            {
                "raydag": dask_with(chains, raydag.ray_get),
                "raydag no fusion": dask_with(chains, raydag.ray_get, **no_fusion),
                "ray_dask_get": dask_with(chains, ray_dask_get),
                "raw Ray": raw_chains,
                "dask threads": dask_with(chains, "threads"),
            },
        ),
        "array": (
            len(g_array),
            float(N_CHUNKS),
            {
                "raydag": dask_with(array, raydag.ray_get),
                "raydag no fusion": dask_with(array, raydag.ray_get, **no_fusion),
                "ray_dask_get": dask_with(array, ray_dask_get),
                "raw Ray": lambda: raw_mirror(g_array)()[0],
                "dask threads": dask_with(array, "threads"),
            },
        ),
    }
    if args.record:  # raydag keeps the last run's record in memory by default
        record_dir = tempfile.mkdtemp(prefix="raydag-bench-runs-")
        for x, (_, _, contenders) in zip((chains, array), graphs.values(), strict=True):
            contenders["raydag record off"] = dask_with(
                x, raydag.ray_get, **{"raydag.record.enabled": False}
            )
            contenders["raydag record to disk"] = dask_with(
                x, raydag.ray_get, **{"raydag.record.directory": record_dir}
            )
    print(f"tasks   : chains {len(g_chains)}, array {len(g_array)} (as handed to a get)")
    print(f"timing  : 1 warm-up, then median of {args.repeats} runs (best also shown)")
    print()

    results: list[Result] = []
    for name, (n_tasks, expected, contenders) in graphs.items():
        times: dict[str, list[float]] = {c: [] for c in contenders}
        for round_ in range(args.repeats + 1):
            for contender, fn in contenders.items():
                gc.collect()
                t0 = time.perf_counter()
                value = fn()
                elapsed = time.perf_counter() - t0
                if value != expected:
                    raise AssertionError(f"{name}/{contender}: got {value!r}, not {expected!r}")
                if round_ > 0:  # round 0 is the warm-up
                    times[contender].append(elapsed)
        results += [Result(name, c, n_tasks, t) for c, t in times.items()]

    rows = []
    for r in results:
        base = {x.contender: x for x in results if x.graph == r.graph}
        rows.append(
            [
                r.graph,
                r.contender,
                f"{r.median:.3f}",
                f"{r.best:.3f}",
                f"{r.tasks / r.median:,.0f}",
                f"{base['ray_dask_get'].median / r.median:.2f}",
                f"{base['raw Ray'].median / r.median:.2f}",
            ]
        )
    print(
        _common.table(
            ["graph", "contender", "median s", "best s", "tasks/s", "x ray_dask_get", "x raw Ray"],
            rows,
        )
    )
    print()
    print("x ray_dask_get, x raw Ray: that contender's median seconds / this one's (>1: faster)")
    if args.record:
        raydag.observe.record.flush()
        shutil.rmtree(record_dir, ignore_errors=True)
        print()
        print("run record cost, median over 'raydag record off' (positive: slower):")
        for name in graphs:
            by = {r.contender: r for r in results if r.graph == name}
            off = by["raydag record off"].median
            for c, what in (
                ("raydag", "in memory (default)"),
                ("raydag record to disk", "to disk"),
            ):
                print(f"  {name:7} {what:20} {100 * (by[c].median / off - 1):+6.1f} %")

    if args.json:
        info["results"] = [
            {**asdict(r), "median": r.median, "best": r.best, "tasks_per_s": r.tasks / r.median}
            for r in results
        ]
        _common.write_json(args.json, info)


if __name__ == "__main__":
    main()
