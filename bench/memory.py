"""Peak object-store memory on the 40-chain graph: raydag against ray_dask_get.

The graph: 40 independent chains; each makes one 25 MiB float64 array, applies 3
elementwise steps (each a separate task making a new 25 MiB array), reduces it to a
scalar, and one final task sums the 40 scalars (201 dask tasks, 1 GiB of arrays made
in all). Every array is an object in Ray's store; only a handful need to exist at once.

Memory is what the raylets report: ``raydag.runtime.stores.StoreSampler`` reads every node's
store stats every ``--interval`` seconds (0.02 by default) and keeps the peak of the sum
over nodes. The contenders alternate, ``--repeats`` runs each (2 by default), because the
machine is shared and one run says little.

After each compute returns, the store is read at once, again after 0.25 s (still before
any ``gc.collect()``), and after ``gc.collect()``: ray_dask_get leaves objects behind
through a reference cycle (ray-project/ray#36653) that only the collector breaks.

The embedded Ray (``raydag.connect()``, shared by both contenders) frees released
objects every 20 ms (``free_objects_period_milliseconds``; Ray's default is 1 s), so a
released object leaves the store quickly under either contender. ``--default-free-period``
starts Ray with the default 1 s instead.

    python bench/memory.py [--repeats 2] [--interval 0.02] [--default-free-period] [--json P]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import _common
import dask
import numpy as np
from ray.util.dask import ray_dask_get

import raydag
from raydag import runtime
from raydag.runtime import stores

MiB = 2**20
ARRAY_BYTES = 25 * MiB
N_CHAINS = 40
N_STEPS = 3
SETTLE = 0.25  # seconds between "right after compute" and the second reading


def make(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes // 8, float(i))


def step(a: np.ndarray) -> np.ndarray:
    return a + 1.0  # a new array, as large as its input


def reduce(a: np.ndarray) -> float:
    return float(a.sum())


def forty_chains(n_chains: int = N_CHAINS, nbytes: int = ARRAY_BYTES) -> Any:
    d_make, d_step, d_reduce = (dask.delayed(f, pure=False) for f in (make, step, reduce))
    scalars = []
    for i in range(n_chains):
        a = d_make(i, nbytes)
        for _ in range(N_STEPS):
            a = d_step(a)
        scalars.append(d_reduce(a))
    return dask.delayed(sum, pure=False)(scalars)


def expected(n_chains: int = N_CHAINS, nbytes: int = ARRAY_BYTES) -> float:
    return float(sum((i + N_STEPS) * (nbytes // 8) for i in range(n_chains)))


def strict_need(cpus: int, nbytes: int = ARRAY_BYTES) -> int:
    """The least the store must hold to keep every CPU busy on this graph.

    With C CPUs, C chains run at once. A step task needs its input array in the store
    while it writes its output array there, so each running chain holds two arrays at
    its worst moment: C * 2 * 25 MiB (100 MiB with 2 CPUs). Scalars are inlined by Ray
    (under 100 KiB) and never reach the store.
    """
    return cpus * 2 * nbytes


@dataclass
class Reading:
    objects: int
    bytes: int

    def __str__(self) -> str:
        return f"{self.objects} / {self.bytes / MiB:.0f}"


def read_store() -> Reading:
    s = stores.store_stats()
    return Reading(sum(x.num_objects for x in s.values()), sum(x.used_bytes for x in s.values()))


def wait_for_store(at_most: int, timeout: float = 10.0) -> Reading:
    """Wait until the store holds at most ``at_most`` bytes (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    r = read_store()
    while r.bytes > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
        r = read_store()
    return r


@dataclass
class Run:
    contender: str
    round: int
    peak_bytes: int
    peak_at: float  # seconds after the compute started
    wall: float
    baseline: Reading
    left_now: Reading
    left_settled: Reading
    left_after_gc: Reading
    rounds: int  # sampling rounds taken during the run
    totals: list[tuple[float, int]] = field(repr=False)


def measure(name: str, round_: int, get: Callable, x: Any, want: float, interval: float) -> Run:
    baseline = read_store()
    with stores.StoreSampler(interval) as sampler:
        t0 = time.monotonic()
        value = dask.compute(x, scheduler=get)[0]
        wall = time.monotonic() - t0
        left_now = read_store()
        time.sleep(SETTLE)
        left_settled = read_store()
    if value != want:
        raise AssertionError(f"{name}: got {value!r}, not {want!r}")
    gc.collect()
    left_after_gc = wait_for_store(baseline.bytes)
    return Run(
        name,
        round_,
        sampler.peak_total_used,
        (sampler.peak_total_time or t0) - t0,
        wall,
        baseline,
        left_now,
        left_settled,
        left_after_gc,
        sampler.rounds,
        [(t - t0, b) for t, b in sampler.totals()],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs per contender, alternating")
    ap.add_argument("--interval", type=float, default=0.02, help="store sampling period (s)")
    ap.add_argument(
        "--default-free-period",
        action="store_true",
        help="start Ray with its default free_objects_period (1 s) instead of raydag's 20 ms",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results (and the series)")
    args = ap.parse_args()

    if args.default_free_period:
        dask.config.set({"raydag.local-ray.free-objects-period": "1s"})
    runtime.connect()
    cpus = int(sum(runtime.cluster.alive_nodes().values()))
    need = strict_need(cpus)
    settings = _common.ray_settings()
    info = _common.print_header(
        "memory: peak object store on 40 chains of 25 MiB arrays",
        {"ray": settings},
    )
    print(
        f"note    : one embedded Ray for both contenders, free_objects_period "
        f"{settings['free_objects_period']} (Ray's default is 1s"
        f"{'; --default-free-period given' if args.default_free_period else ''})"
    )
    print(
        f"graph   : {N_CHAINS} chains x (make 25 MiB + {N_STEPS} steps + reduce) + sum "
        f"= {N_CHAINS * (N_STEPS + 2) + 1} tasks"
    )
    print(
        f"strict  : {cpus} CPUs x 2 arrays (a step's input and output) x 25 MiB "
        f"= {need / MiB:.0f} MiB"
    )
    print(f"sampling: every {args.interval} s, all nodes, peak of the sum over nodes")

    contenders = {"raydag": raydag.ray_get, "ray_dask_get": ray_dask_get}
    x, want = forty_chains(), expected()
    small = forty_chains(2, MiB)
    for get in contenders.values():  # start workers, import numpy in them
        dask.compute(small, scheduler=get)
    gc.collect()
    wait_for_store(0)

    runs: list[Run] = []
    for r in range(1, args.repeats + 1):
        for name, get in contenders.items():
            runs.append(measure(name, r, get, x, want, args.interval))

    rows = []
    for run in runs:
        base = next(o for o in runs if o.contender == "ray_dask_get" and o.round == run.round)
        rows.append(
            [
                run.contender,
                run.round,
                f"{run.peak_bytes / MiB:,.0f}",
                f"{run.peak_bytes / need:.2f}",
                f"{run.peak_bytes / base.peak_bytes:.2f}" if base.peak_bytes else "-",
                str(run.left_now),
                str(run.left_settled),
                str(run.left_after_gc),
                f"{run.wall:.2f}",
                f"{run.rounds}",
            ]
        )
    print()
    print(
        _common.table(
            [
                "contender",
                "run",
                "peak MiB",
                "x strict",
                "x ray_dask_get",
                "left at return",
                f"left +{SETTLE}s",
                "after gc",
                "wall s",
                "samples",
            ],
            rows,
        )
    )
    print()
    print(f"x strict: peak / {need / MiB:.0f} MiB; x ray_dask_get: peak / its peak in the same run")
    print(
        f"left    : objects / MiB in the store when compute() returned, {SETTLE} s later "
        "(no gc yet),\n          and after gc.collect() (waiting up to 10 s for the store to drain)"
    )
    baselines = {str(r.baseline) for r in runs}
    print(f"store before each run (objects / MiB): {', '.join(sorted(baselines))}")

    if args.json:
        info.update(strict_need_bytes=need, interval=args.interval, runs=[asdict(r) for r in runs])
        _common.write_json(args.json, info)


if __name__ == "__main__":
    main()
