"""The Ray layer's ceiling: the driver's cost per task as the Ray tasks in flight grow.

raydag keeps ``scheduling.in-flight-per-cpu`` Ray tasks in flight per CPU. On 280
nodes of 12 CPUs that is 3,360 at once; whatever the driver loop does per loop over
everything in flight (waiting on every ref, say) grows with it. This machine cannot
run thousands of worker processes, so the tasks in flight are made the other way:
an embedded Ray of ``--cpus`` CPUs, and ``in-flight-per-cpu`` set so that raydag keeps
100, 300, 1,000 or 3,000 Ray tasks submitted and not yet ended (those Ray cannot run
yet wait in its queues, as they do when a cluster is busy). The graph: ``--tasks``
independent tasks that do nothing (``operator.index(i)``, fusion and speculation off, cheap
tasks a full slot, so one dask task is one Ray task and one slot).

With ``--graph shared``, each task calls one instance of a class of ``__main__`` (as
a notebook's or a script's coffea processor, or dask-awkward's callables, which
cloudpickle pickles by value): what ``raydag.runtime.worker.Shipper`` ships once per
compute instead of once per task.

Per level it reports the compute's wall time, tasks per second, and the driver
process's CPU seconds per task (``time.process_time``: every thread of the driver,
Ray's own included), which is the cost the issue asks to stay flat; and the ratio of
that cost to the lowest level's.

With ``--a OLD_TREE``, each level runs from two source trees (A: ``OLD_TREE``, B: this
one), each in its own process with its own Ray, in the order A B B A ... for
``--rounds`` rounds, and the table sets B beside A (the same run, the same load).

    python bench/inflight.py [--levels 100,300,1000,3000] [--tasks 6000] [--a OLD_TREE]
    python bench/inflight.py --graph shared --levels 100 --a OLD_TREE
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)


class Skim:
    """A callable of ``__main__`` with some state and methods, as a processor is."""

    def __init__(self) -> None:
        self.cuts = {f"cut{i}": (i, 2.0 * i) for i in range(20)}
        self.columns = [f"column_{i}" for i in range(40)]

    def __call__(self, i: int) -> int:
        return self.select(i)

    def select(self, i: int) -> int:
        return i if self.passes(i) else -1

    def passes(self, i: int) -> bool:
        return all(lo <= hi for lo, hi in self.cuts.values())


def child(levels: list[int], n_tasks: int, cpus: int, repeats: int, graph: str) -> None:
    """In this process: one embedded Ray; each level's compute, as JSON lines."""
    import dask
    import ray

    import raydag

    sys.path.insert(0, HERE)
    import _common

    _common.start_ray(
        lambda: ray.init(num_cpus=cpus, include_dashboard=False, logging_level="WARNING")
    )
    # operator.index: importable, pickled by reference; a Skim: by value, code and all
    func = operator.index if graph == "nothing" else Skim()
    dsk = {("task", i): (func, i) for i in range(n_tasks)}
    keys = list(dsk)
    settings = {
        "raydag.fusion.enabled": False,
        "raydag.speculation.enabled": False,
        "raydag.scheduling.cheap-task-cost": 1.0,
        "raydag.record.enabled": False,
    }
    with dask.config.set({**settings, "raydag.scheduling.in-flight-per-cpu": 10 / cpus}):
        raydag.ray_get(dsk, keys[:200])  # warm: worker processes up
    for _ in range(repeats):
        for level in levels:
            with dask.config.set({**settings, "raydag.scheduling.in-flight-per-cpu": level / cpus}):
                c0, t0 = time.process_time(), time.perf_counter()
                values = raydag.ray_get(dsk, keys)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert list(values) == list(range(n_tasks))
            print(json.dumps({"level": level, "wall": wall, "cpu": cpu}), flush=True)
    ray.shutdown()


def run_tree(tree: str, args: argparse.Namespace) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        os.path.join(HERE, "inflight.py"),
        "--child",
        "--levels",
        args.levels,
        "--tasks",
        str(args.tasks),
        "--cpus",
        str(args.cpus),
        "--repeats",
        str(args.repeats),
        "--graph",
        args.graph,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="100,300,1000,3000", help="Ray tasks in flight")
    ap.add_argument("--tasks", type=int, default=6000, help="tasks per compute")
    ap.add_argument("--cpus", type=int, default=2, help="the embedded Ray's CPUs")
    ap.add_argument("--repeats", type=int, default=1, help="computes per level per process")
    ap.add_argument("--rounds", type=int, default=1, help="with --a: A B B A ... rounds")
    ap.add_argument("--a", metavar="OLD_TREE", help="also run from this source tree")
    ap.add_argument("--runs", type=int, default=None, help="with --a: only the first N runs")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--graph", choices=("nothing", "shared"), default="nothing")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.child:
        child(levels, args.tasks, args.cpus, args.repeats, args.graph)
        return

    sys.path.insert(0, HERE)
    import _common

    info = _common.print_header("inflight: the driver's cost per task as tasks in flight grow")
    what = "doing nothing" if args.graph == "nothing" else "calling one Skim of __main__"
    print(f"graph   : {args.tasks} independent tasks {what}, {args.cpus} Ray CPUs")
    trees = {"B": TREE} if args.a is None else {"A": os.path.abspath(args.a), "B": TREE}
    order = list(trees) if args.a is None else (["A", "B", "B", "A"] * args.rounds)[: args.runs]
    print(f"trees   : {trees}; order {' '.join(order)}")
    print()
    got: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for name in order:
        for r in run_tree(trees[name], args):
            print(f"{name} {json.dumps(r)}", flush=True)
            got[name, r["level"]].append(r)

    def med(name: str, level: int, what: str) -> float:
        return statistics.median(r[what] for r in got[name, level])

    rows = []
    for name in trees:
        base = med(name, levels[0], "cpu") / args.tasks
        for level in levels:
            per_task = med(name, level, "cpu") / args.tasks
            row = [
                name,
                level,
                f"{med(name, level, 'wall'):.2f}",
                f"{args.tasks / med(name, level, 'wall'):,.0f}",
                f"{1e6 * per_task:.0f}",
                f"{per_task / base:.2f}",
            ]
            if "A" in trees:
                ratio = med("B", level, "cpu") / med("A", level, "cpu")
                row.append(f"{ratio:.2f}" if name == "B" else "")
            rows.append(row)
    headers = ["tree", "in flight", "wall s", "tasks/s", "driver CPU us/task", "x lowest"]
    if "A" in trees:
        headers.append("B / A cpu")
    print(_common.table(headers, rows))
    print()
    print("x lowest: CPU per task over this tree's at the lowest level (flat: 1)")
    if args.json:
        info["results"] = {f"{k[0]} {k[1]}": v for k, v in got.items()}
        _common.write_json(args.json, info)


if __name__ == "__main__":
    main()
