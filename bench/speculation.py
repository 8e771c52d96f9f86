"""Speculative duplicates on a heavy-tailed graph: makespan with and without, in one run.

A head without CPUs and 3 one-CPU nodes (tests/harness.py), the third started with
``RAYDAG_TEST_SLOWDOWN=5``. The graph: ``--short`` tasks of 0.1-0.5 s (fixed seed),
a category of ``--long`` tasks of 5-10 s, and one final task reading all of them.

How much (b) can gain is set by the graph. Killed at 60 %, the long task (L = 9.22 s)
costs 0.6 L more without speculation. With it, its duplicate may start only on an
idle CPU, once the short work W is done. Both runs start the long task at about W / 3
(where dask's order puts it, and the best start: sooner, its duplicate waits longer
for a CPU), so off / on is at most (W/3 + 1.6 L + 0.2) / (W/3 + L + 0.1): 1.51 with
16 short tasks (W = 5.1 s), 1.56 with 8 (W = 2.4 s, the default since session 10),
1.60 with none. Short work that ends well before the long tasks is the founding
user's case: 90 % of tasks done in 500 s, a few categories running for hours.

- (a) slowed: every task sleeps 5x longer on the slowed node;
- (b) killed: no slowdown; the node running the first long task is SIGKILLed when
  that task is 60 % done (a fresh node joins afterwards).

Each scenario runs without speculation, then with it, seeded with the first run's
record (``raydag.speculation.seed``: what a production run would have from the day
before); ``--repeats`` times, interleaved. Before every run each node gets a warm
worker process (the task's module imported): a fresh node (after a kill), or one
whose worker a cancelled copy took down, would otherwise start the run seconds late,
and which run that hits is luck. Makespan is timed from the first task's start (the
log every task writes), not from the call. The lower bound is max(critical path,
total work / CPUs) at nominal speed. "long at" is when the long task's first copy
started, "copy after" how long after it its other copy (duplicate, or restart) did.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

import dask
import ray

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.join(HERE, "..", "tests"), HERE, os.environ.get("PYTHONPATH")) if p
)

from _common import print_header, table, write_json  # noqa: E402
from harness import MultiNodeCluster  # noqa: E402
from test_speculation import graph, runs  # noqa: E402

import raydag  # noqa: E402

SLOWDOWN = 5.0
SLOW_ENV = {"RAYDAG_TEST_SLOWDOWN": str(SLOWDOWN)}
slowed: set[str] = set()  # the slowed node's id; a replacement of it is slowed too
SETTINGS = {
    "raydag.speculation.quantile": 0.9,
    "raydag.speculation.min-samples": 5,
    "raydag.speculation.long-task": "3s",
    "raydag.speculation.min-runtime": "0.5s",
    "raydag.speculation.slow-node": 3,  # the default
}


def heavy_tailed(short: int, long: int, slow: bool, seed: int = 0) -> dict[str, tuple]:
    rng = random.Random(seed)
    spec: dict[str, tuple] = {}
    for i in range(long):
        spec[f"long-{i}"] = (rng.uniform(5.0, 10.0), slow, ())
    for i in range(short):
        spec[f"short-{i}"] = (rng.uniform(0.1, 0.5), slow, ())
    spec["total"] = (0.1, slow, tuple(spec))
    return spec


def lower_bound(spec: dict[str, tuple], cpus: int) -> float:
    work = sum(s for s, _, _ in spec.values())
    path = max(s for s, _, deps in spec.values() if not deps) + spec["total"][0]
    return max(path, work / cpus)


def _warm() -> str:
    import test_speculation  # noqa: F401  (the tasks' module, once per worker process)

    return ray.get_runtime_context().get_node_id()


def warm() -> None:
    """A worker process on every node with CPUs, started and idle, before a run."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    fn = ray.remote(num_cpus=1)(_warm)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    ray.get(
        [
            fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
            for n in nodes
        ]
    )


def run(
    c: MultiNodeCluster, spec: dict, on: bool, seed: Any, kill_at: float | None
) -> dict[str, Any]:
    fd, log = tempfile.mkstemp(prefix="rdg-bench-spec-", suffix=".log", dir="/tmp")
    os.close(fd)
    killed: list[str] = []

    def chaos() -> None:
        long = sorted(k for k in spec if k.startswith("long-"))[0]
        while not done.is_set():
            starts = [(n, t) for k, lab, n, t in runs(log) if k == "start" and lab == long]
            if starts and time.time() >= starts[0][1] + kill_at * spec[long][0]:
                c.kill(c.by_id(starts[0][0]))
                killed.append(starts[0][0])
                return
            time.sleep(0.02)

    done = threading.Event()
    watcher = threading.Thread(target=chaos, daemon=True) if kill_at is not None else None
    cfg = {**SETTINGS, "raydag.speculation.enabled": on, "raydag.speculation.seed": seed}
    if any(slow for _, slow, _ in spec.values()):
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert slowed & alive, "no slowed node in the cluster"
    warm()
    with dask.config.set(cfg):
        if watcher is not None:
            watcher.start()
        t0 = time.monotonic()
        raydag.ray_get(graph(spec, log), ["total"])
        wall = time.monotonic() - t0
        done.set()
    rec = raydag.last_run()
    rs = runs(log)
    os.unlink(log)
    first = min(t for *_, t in rs)
    span = max(t for *_, t in rs) - first
    long = sorted(k for k in spec if k.startswith("long-"))[0]
    longs = sorted(t for k, lab, _, t in rs if k == "start" and lab == long)
    s = rec.summary()
    if killed:  # (b) may kill the slowed node: (a) must still have one afterwards
        was_slowed = killed[0] in slowed
        new = c.add_node(env_vars=SLOW_ENV if was_slowed else None)
        if was_slowed:
            slowed.clear()
            slowed.add(new.node_id)
    return {
        "makespan": span,
        "wall": wall,
        "long_at": longs[0] - first,
        "copy_after": longs[1] - longs[0] if len(longs) > 1 else None,
        "runs": sum(1 for k, *_ in rs if k == "start"),
        "duplicates": s["duplicates"],
        "won": s["duplicates_won"],
        "saved": s["time_saved_s"],
        "killed": bool(killed),
        "record": rec,
        # every run's start and end, seconds from the first start (for the JSON)
        "log": [(k, lab, n[:8], round(t - first, 3)) for k, lab, n, t in rs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=1)
    ap.add_argument("--kill-at", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    cpus = 3
    with MultiNodeCluster(nodes=2) as c:
        slowed.add(c.add_node(env_vars=SLOW_ENV).node_id)
        graph_desc = (
            f"{args.short} tasks of 0.1-0.5 s, {args.long} of 5-10 s (category 'long'), "
            "1 final task reading all"
        )
        header = print_header(
            "speculation: heavy-tailed graph, a slowed node and a killed node",
            {
                "cluster": "head (0 CPUs) + 3 nodes x 1 CPU; node 3 slowed 5x in (a)",
                "graph": graph_desc,
                "settings": SETTINGS,
                "repeats": f"{args.repeats}, each (a) off, (a) on, (b) off, (b) on",
            },
        )
        rows, out = [], []
        scenarios = (("(a) slowed 5x", True, None), ("(b) killed", False, args.kill_at))
        for rep in range(1, args.repeats + 1):
            for name, slow, kill_at in scenarios:
                spec = heavy_tailed(args.short, args.long, slow)
                lb = lower_bound(spec, cpus)
                off = run(c, spec, False, None, kill_at)
                on = run(c, spec, True, off.pop("record"), kill_at)
                on.pop("record")
                for label, r in (("off", off), ("on", on)):
                    after = r["copy_after"]
                    rows.append(
                        [
                            name,
                            rep,
                            label,
                            round(lb, 2),
                            round(r["makespan"], 2),
                            round(r["makespan"] / lb, 2),
                            round(r["long_at"], 2),
                            None if after is None else round(after, 2),
                            r["runs"],
                            r["duplicates"],
                            r["won"],
                            round(r["saved"], 1),
                        ]
                    )
                speedup = round(off["makespan"] / on["makespan"], 2)
                rows.append(["", rep, "off / on", "", speedup, *[""] * 7])
                out.append(
                    {"scenario": name, "repeat": rep, "lower_bound": lb, "off": off, "on": on}
                )
                for line in table(HEADERS, rows[-3:]).splitlines()[2:]:  # progress
                    print(line, file=sys.stderr, flush=True)
        print()
        print(table(HEADERS, rows))
        print(
            "\nlower bound: max(critical path, total work / 3 CPUs) at nominal speed; "
            "makespan: first task start to last task end; long at: the long task's first\n"
            "start; copy after: its second copy's start after that (duplicate or restart); "
            "saved: the record's estimate"
        )
    if args.json:
        write_json(args.json, {**header, "results": out})


HEADERS = [
    "scenario",
    "rep",
    "speculation",
    "lower bound s",
    "makespan s",
    "x bound",
    "long at s",
    "copy after s",
    "task runs",
    "duplicates",
    "won",
    "saved s",
]


if __name__ == "__main__":
    main()
