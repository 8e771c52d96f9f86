"""The HEP skim of examples/hep_skim.py at a small scale, and a 50k-task graph's start-up.

Skim: ``--files`` synthetic NanoAOD files of ``--events`` events (8 x 50k by default,
made once into ``--data``), the same coffea NanoEvents skim (selection, new columns,
parquet written with dask_awkward.to_parquet, a hist.dask histogram) run by

  raydag            dask.compute(..., scheduler=raydag.ray_get)
  ray_dask_get      dask.compute(..., scheduler=ray.util.dask.ray_dask_get), Ray's incumbent
  dask threads      dask.compute(..., scheduler="threads")
  dask sync         dask.compute(..., scheduler="sync"): the work alone, on one core
  coffea futures    processor.Runner(FuturesExecutor(workers=CPUs)): coffea's own local pool
  coffea RayExecutor processor.Runner(raydag.coffea.RayExecutor())

on one embedded Ray (``raydag.connect()``). Each contender runs a small warm-up
(one file: Ray's workers start and import coffea), then ``--repeats`` timed runs,
contenders interleaved round by round. Peak
RSS is sampled every 0.1 s over the driver's whole process tree (its Ray workers,
raylet and object store included, and the futures pool's processes): pages shared
between processes (the object store's) count once per process, so it is an upper
bound. Every run's parquet rows and histogram must equal the first contender's.

Real (``--real``): coffea's own CMS NanoAOD samples (``tests/samples/``: Drell-Yan MC,
dimuon data, ttbar MC in NanoAOD v12 and v15, from coffea's test suite, BSD licence)
through ``coffea.dataset_tools.apply_to_fileset`` in dask mode, as a coffea 2025 analysis
runs: muon and jet selections, an HT histogram (``hist.dask``) and a parquet skim
(``dask_awkward.to_parquet``) per dataset, ``--real-partitions`` partitions per file.
The files are preprocessed once (``preprocess``, sync); each contender then builds the
graph (``apply_to_fileset``, timed apart: the same for all) and computes it; every
contender's row counts and histograms must equal the first's. Contenders: dask
``sync`` (the work alone), ``threads`` (one per CPU), raydag, ``ray_dask_get``. Most of
the work is uproot reading each partition's TTree metadata, the same for every backend.

Graph: one file of ``--events`` events cut into ``--graph-partitions`` partitions (about
3 tasks each after dask-awkward's optimisation: 16,000 make over 50,000), the same skim; the driver's peak RSS while building and submitting it, and the time from
``compute()`` to the first task the driver sees started (a dask callback). The compute
is then interrupted (Ctrl-C, as a user would): only the start-up is measured.

    python bench/hep.py --real [--real-partitions 6] [--repeats 3]
    python bench/hep.py [--files 8] [--events 50000] [--graph-partitions 16000] [--json out.json]
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import gc
import math
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import _common
import dask
import numpy as np
import psutil
from dask.callbacks import Callback
from ray.util.dask import ray_dask_get

import raydag
from raydag import runtime
from raydag.runtime.stores import StoreSampler, shared_reader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hep_skim  # noqa: E402
from coffea import processor  # noqa: E402

from raydag.coffea import RayExecutor  # noqa: E402

MiB = 2**20


class PeakRSS:
    """Samples the RSS of a process tree in a thread: the peak of the sum, and the root's."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.root = psutil.Process()
        self.peak_tree = self.peak_root = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total = own = self.root.memory_info().rss
        for p in self.root.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                total += p.memory_info().rss
        self.peak_tree = max(self.peak_tree, total)
        self.peak_root = max(self.peak_root, own)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ---- the skim --------------------------------------------------------------------


def dask_contender(scheduler: Any, **kwargs: Any):
    def run(files: list[str], out: Path, steps: int, events: int) -> dict:
        return hep_skim.run_dask(files, steps, out, scheduler, **kwargs)

    return run


def runner_contender(make_executor):
    def run(files: list[str], out: Path, steps: int, events: int) -> dict:
        return hep_skim.run_runner(files, max(1, events // steps), out, make_executor())

    return run


CPUS = os.cpu_count() or 1
CONTENDERS = {
    "raydag": dask_contender(raydag.ray_get),
    "ray_dask_get": dask_contender(ray_dask_get),
    "dask threads": dask_contender("threads"),
    # one process, one task at a time, nothing else running: the work itself
    "dask sync": dask_contender("sync"),
    "coffea futures": runner_contender(
        lambda: processor.FuturesExecutor(workers=CPUS, status=False)
    ),
    "coffea RayExecutor": runner_contender(lambda: RayExecutor(status=False)),
}


def bench_skim(args: argparse.Namespace) -> list[dict]:
    files = hep_skim.make_dataset(args.data, args.files, args.events)
    warm = hep_skim.make_dataset(args.data / "warm", 1, 2000)
    out = args.data / "out"
    rows, want = [], None
    for run in CONTENDERS.values():
        run(warm, out / "warm", 1, 2000)
    for rep in range(args.repeats):  # contenders interleaved: load spreads over all
        for name, run in CONTENDERS.items():
            shutil.rmtree(out / "skim", ignore_errors=True)
            gc.collect()
            with PeakRSS() as rss, StoreSampler(0.05, reader=shared_reader()) as store:
                result = run(files, out / "skim", args.steps, args.events)
            if name == "raydag":  # the work itself, as raydag's record measured it
                result["task_seconds"] = float(raydag.last_run().tasks.duration.sum())
            if want is None:
                want = result
            elif result["rows"] != want["rows"] or not np.array_equal(result["hist"], want["hist"]):
                raise AssertionError(f"{name} differs: {result['rows']} rows vs {want['rows']}")
            rows.append(
                {
                    "contender": name,
                    "run": rep,
                    "seconds": result["seconds"],
                    "peak_tree_mib": rss.peak_tree / MiB,
                    "peak_driver_mib": rss.peak_root / MiB,
                    "peak_store_mib": store.peak_total_used / MiB,
                    "rows": result["rows"],
                    "task_seconds": result.get("task_seconds"),
                }
            )
            print(f"  {name}: {result['seconds']:.2f} s", file=sys.stderr)
    return rows


def skim_table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    base = statistics.median(r["seconds"] for r in by["ray_dask_get"])
    table = []
    for name, rs in by.items():
        med = statistics.median(r["seconds"] for r in rs)
        table.append(
            [
                name,
                med,
                min(r["seconds"] for r in rs),
                max(r["peak_tree_mib"] for r in rs),
                max(r["peak_driver_mib"] for r in rs),
                max(r.get("peak_store_mib", 0.0) for r in rs),
                base / med,
            ]
        )
    work = statistics.median(r["task_seconds"] for r in by["raydag"])
    alone = statistics.median(r["seconds"] for r in by["dask sync"])
    bound = (
        f"\nwork: {work:.3f} s of task execution in raydag's workers (its record, median); "
        f"{alone:.3f} s for the whole skim in one process (sync). On {CPUS} CPUs no "
        f"scheduler can take less than {alone / CPUS:.3f} s, "
        f"{base / (alone / CPUS):.2f}x ray_dask_get's median"
    )
    return (
        bound
        + "\n\n"
        + _common.table(
            [
                "contender",
                "median s",
                "best s",
                "peak RSS MiB",
                "driver MiB",
                "peak store MiB",
                "x ray_dask_get",
            ],
            table,
        )
    )


# ---- the real NanoAOD skim (coffea's samples) --------------------------------------

SAMPLES = Path(__file__).resolve().parents[1] / "tests" / "samples"
REAL = {
    "dy": "nano_dy.root",
    "dimuon": "nano_dimuon.root",
    "tt_v12": "nano_tt_v12.root",
    "tt_v15": "nano_tt_v15.root",
}


class RealSkim(processor.ProcessorABC):
    """Muons and jets selected, an HT histogram and a parquet skim of events with a muon."""

    def __init__(self, out: Path):
        self.out = out

    def process(self, events: Any) -> dict:
        import awkward as ak
        import dask_awkward as dak
        import hist.dask

        mu = events.Muon[(events.Muon.pt > 10) & (abs(events.Muon.eta) < 2.4)]
        jets = events.Jet[(events.Jet.pt > 30) & (abs(events.Jet.eta) < 2.5)]
        ht = ak.sum(jets.pt, axis=1)
        h = hist.dask.Hist.new.Reg(30, 0, 1500, name="ht").Double().fill(ht=ht)
        sel = events[ak.num(mu) >= 1]
        skim = ak.zip(
            {"run": sel.run, "event": sel.event, "nmu": ak.num(sel.Muon), "mu_pt": sel.Muon.pt},
            depth_limit=1,
        )
        where = self.out / events.metadata["dataset"]
        return {
            "ht": h,
            "rows": ak.num(sel, axis=0),
            "write": dak.to_parquet(skim, str(where), compute=False),
        }

    def postprocess(self, accumulator: Any) -> Any:
        return accumulator


def real_fileset(partitions: int) -> dict:
    """The four samples, preprocessed once, cut into ``partitions`` steps each."""
    from coffea.dataset_tools import preprocess

    fileset = {k: {"files": {str(SAMPLES / f): "Events"}} for k, f in REAL.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        available, _ = preprocess(fileset, step_size=10**9, skip_bad_files=False, scheduler="sync")
    for dataset in available.values():
        for spec in dataset["files"].values():
            n = spec["num_entries"]
            step = math.ceil(n / partitions)
            spec["steps"] = [[a, min(a + step, n)] for a in range(0, n, step)]
    return available


REAL_CONTENDERS = {
    "dask sync": "sync",
    "dask threads": "threads",
    "raydag": raydag.ray_get,
    "ray_dask_get": ray_dask_get,
}


def bench_real(args: argparse.Namespace) -> list[dict]:
    from coffea.dataset_tools import apply_to_fileset
    from coffea.nanoevents import NanoAODSchema

    fileset = real_fileset(args.real_partitions)
    out = args.data / "real"
    rows, want = [], None
    for rep in range(-1, args.repeats):  # round -1 warms every contender up, untimed
        for name, scheduler in REAL_CONTENDERS.items():
            shutil.rmtree(out, ignore_errors=True)
            gc.collect()
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = apply_to_fileset(RealSkim(out), fileset, schemaclass=NanoAODSchema)
            built = time.perf_counter() - t0
            kwargs = {"num_workers": CPUS} if scheduler == "threads" else {}
            t0 = time.perf_counter()
            (got,) = dask.compute(graph, scheduler=scheduler, **kwargs)
            seconds = time.perf_counter() - t0
            result = {k: (int(v["rows"]), v["ht"].values().tolist()) for k, v in got.items()}
            if want is None:
                want = result
            elif result != want:
                raise AssertionError(f"{name} differs from {next(iter(REAL_CONTENDERS))}")
            if rep < 0:
                continue
            row = {"contender": name, "run": rep, "seconds": seconds, "build_seconds": built}
            if name == "raydag":
                tasks = raydag.last_run().tasks
                row["task_seconds"] = float(tasks.duration.sum())
                row["ray_tasks"] = int(tasks.group.nunique())
            rows.append(row)
            print(f"  {name}: {seconds:.2f} s (+ {built:.2f} s building)", file=sys.stderr)
    return rows


def real_table(rows: list[dict], partitions: int) -> str:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in by.items()}
    table = [
        [
            name,
            med[name],
            min(r["seconds"] for r in rs),
            statistics.median(r["build_seconds"] for r in rs),
            med["dask sync"] / med[name],
            med["dask threads"] / med[name],
        ]
        for name, rs in by.items()
    ]
    work = statistics.median(r["task_seconds"] for r in by["raydag"])
    return (
        f"{len(REAL)} files x {partitions} partitions; raydag's tasks ran {work:.2f} s in all "
        f"(its record, median); on {CPUS} CPUs the compute can take no less than "
        f"{med['dask sync'] / CPUS:.2f} s (sync / CPUs)\n\n"
        + _common.table(
            ["contender", "median s", "best s", "build s", "x sync", "x threads"], table
        )
    )


# ---- the 50k-task graph: start-up only ------------------------------------------------


class _FirstStart(Callback):
    """Notes when the driver first sees a task start, then interrupts the compute."""

    def __init__(self):
        super().__init__()
        self.at: float | None = None
        self.armed = False  # dask-awkward's optimisation runs the graph on typetracers first

    def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
        if self.armed and self.at is None:
            self.at = time.perf_counter()
            _thread.interrupt_main()


def bench_graph(args: argparse.Namespace) -> dict:
    (path,) = hep_skim.make_dataset(args.data, 1, args.events)
    steps = args.graph_partitions
    seen: dict[str, Any] = {}

    def counting_get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
        seen["called"] = time.perf_counter()
        seen["graph"] = dsk
        first.armed = True
        return raydag.ray_get(dsk, keys, **kwargs)

    gc.collect()
    before = psutil.Process().memory_info().rss
    first = _FirstStart()
    with PeakRSS(interval=0.05) as rss:
        t0 = time.perf_counter()
        write, h = hep_skim.dask_skim([path], steps, args.data / "out" / "graph")
        built = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            with first:
                dask.compute(write, h, scheduler=counting_get)
            raise AssertionError("the compute ran to its end: the first start was not seen")
        except KeyboardInterrupt:
            stopped = time.perf_counter()
    if first.at is None:
        raise AssertionError("interrupted before any task started")
    graph = seen.pop("graph")
    tasks = len(graph)
    del graph, write, h
    return {
        "partitions": steps,
        "tasks": tasks,
        "build_seconds": built,
        "to_get_seconds": seen["called"] - t1,
        "first_start_seconds": first.at - t1,
        "interrupt_seconds": stopped - first.at,
        "driver_peak_mib": rss.peak_root / MiB,
        "driver_before_mib": before / MiB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=4, help="partitions (chunks) per file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graph-partitions", type=int, default=16_000, help="about 3 tasks each")
    parser.add_argument("--real", action="store_true", help="only the real NanoAOD skim")
    parser.add_argument("--real-partitions", type=int, default=6, help="partitions per file")
    parser.add_argument("--skip-skim", action="store_true")
    parser.add_argument("--skip-graph", action="store_true")
    parser.add_argument("--data", type=Path, default=Path("/tmp/raydag-bench-hep"))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=raydag.api.IgnoredArgumentsWarning)

    runtime.connect()
    hep_skim.ship_by_value()
    header = _common.print_header(
        "hep: coffea skim and a 50k-task graph",
        {
            "ray": _common.ray_settings(),
            "skim": f"{args.files} files x {args.events} events, {args.steps} chunks per file",
        },
    )
    results: dict[str, Any] = {**header}
    if args.real:
        results["real"] = bench_real(args)
        print()
        print(real_table(results["real"], args.real_partitions))
        print("x sync, x threads: their median seconds / this one's (>1: faster)")
        args.skip_skim = args.skip_graph = True
    if not args.skip_skim:
        results["skim"] = bench_skim(args)
        print()
        print(skim_table(results["skim"]))
        print(
            "\npeak RSS: the driver's process tree (Ray's workers, raylet and store, the "
            "futures pool)\npeak store: the object store's used bytes, sampled every 50 ms "
            "(Ray contenders)\nx ray_dask_get: its median seconds / this one's (>1: faster)"
        )
    if not args.skip_graph:
        g = results["graph"] = bench_graph(args)
        print()
        print(
            _common.table(
                ["graph", "tasks", "build s", "to get s", "first start s", "driver peak MiB"],
                [
                    [
                        f"1 file x {g['partitions']:,} partitions",
                        f"{g['tasks']:,}",
                        g["build_seconds"],
                        g["to_get_seconds"],
                        g["first_start_seconds"],
                        g["driver_peak_mib"],
                    ]
                ],
            )
        )
        print(
            "first start s: from compute() to the first task seen started (graph "
            "optimisation and raydag's intake included)"
        )
    if args.json:
        _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
