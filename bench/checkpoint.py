"""Checkpoints: a driver killed at about 80% and rerun, against one uninterrupted run;
and what checkpoints cost a run without failures.

The compute is ``tests/checkpoint_job.py``'s, scaled down from the founding user's
shape: N loads and N processings of SECONDS each (the long tasks), pairs summed, one
total (80 KB arrays). Each run is a driver process of its own, connected to one local
Ray cluster this script starts (so a SIGKILLed driver loses its objects, as a killed
login node would, and the cluster stays).

  (a) kill   a driver SIGKILLed at 80% of an uninterrupted run's wall time (measured
             just before, in the same round), then run again: the rerun's wall time
             (its process's start to its end: the driver's start and connect, listing
             the store, reading back, computing the rest) and both together, against
             the uninterrupted run's, measured the same way; all with checkpoints at
             min-cost 0 (every result written). The issue's target is about the work
             redone; a driver's fixed cost (a new Ray job starts its own worker
             processes) is shown beside, as a driver computing 2 empty tasks
  (c) cost   uninterrupted runs with checkpoints off, on with nothing worth writing
             (min-cost 1 hour: the fixed cost), at min-cost 0 (every result
             written: the worst case) and at SECONDS (the long tasks' results),
             interleaved, ``--repeat`` times

  (b) kills  ``--two-kills``: on a ``tests/harness.py`` cluster (a head without CPUs,
             3 one-CPU nodes), ``bench/recovery.py``'s skim scaled down with long tasks
             (SUBGRAPHS subgraphs of FAN inputs, LONG_READS reads of LONG_SECONDS each
             in every subgraph) and its two-kill schedule (the busiest node SIGKILLed at
             50% and 80% of the tasks done, each replaced 2 s later); failure-free and
             two-kill runs with checkpoints off and on (min-cost MIN_COST: the long
             reads are written, the 2-ms steps below them are not), interleaved:
             makespan against the failure-free run's, and tasks re-executed. The
             checkpoint store is a directory under /tmp: every node of this one-machine
             cluster reads and writes it (on a real cluster: a shared filesystem or an
             object store every node reaches). ``--aim long``: each kill takes the node
             holding the most finished long results still needed (a 5-s read's hist
             waiting for its subgraph's merge), where the busiest node's losses are
             mostly 12-ms lineage that no checkpoint is worth: the founding user's
             worst case, an hour-long result lost while its 100-input merge waits

    python bench/checkpoint.py [--n 12] [--seconds 1.0] [--repeat 3] [--json out.json]
    python bench/checkpoint.py --two-kills [--aim long] [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import _common
import ray

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

import checkpoint_job  # noqa: E402

CMD = [sys.executable, "-c", "import checkpoint_job; checkpoint_job.main()"]


def env() -> dict:
    e = dict(os.environ)
    e["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    e["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), TESTS, e.get("PYTHONPATH", "")])
    return e


def one_run(work: str, min_cost: str, n: int, seconds: float, kill_after: float = 0.0) -> dict:
    """One driver process; ``kill_after``: SIGKILL it that many seconds after its start.
    ``wall``: from the process's start to its end (what a user waits: the driver's
    start, connect and the compute); ``s``: the compute's own time (``raydag.get``)."""
    store, log, out = (os.path.join(work, x) for x in ("store", "ran.log", "out.npy"))
    tasks = len(checkpoint_job.graph(log, n, seconds))
    if os.path.exists(log):
        os.remove(log)
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [*CMD, store, log, out, min_cost, str(n), str(seconds)],
        env=env(),
        stderr=subprocess.DEVNULL,
    )
    killed = False
    t_kill = None
    if kill_after:
        try:
            p.wait(kill_after)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            t_kill = time.time()
            killed = True
    p.wait()
    wall = time.perf_counter() - t0
    if not killed and p.returncode != 0:
        raise RuntimeError(f"driver failed: {p.returncode}")
    compute = wall
    if not killed:  # the compute's own time (the driver's start and connect left out)
        with open(f"{out}.seconds") as f:
            compute = float(f.read())
    ran = checkpoint_job.ran(log)
    left = 0.0
    if killed:  # its tasks still running end with its job: count them with it
        time.sleep(seconds)
        ran = checkpoint_job.ran(log)
        # the work not done by the kill (tasks running then are redone whole: no
        # checkpoint saves a running task's work), in task-seconds
        done = {k for k, t in checkpoint_job.ended(log) if t <= t_kill}
        graph = checkpoint_job.graph(log, n, seconds)
        left = sum(checkpoint_job.seconds_of(k, seconds) for k in graph if k not in done)
    return {
        "s": compute,
        "wall": wall,
        "ran": len(ran),
        "tasks": tasks,
        "killed": killed,
        "left": left,
    }


CPUS = 2  # the local Ray's (a) and (c) run on
SUBGRAPHS, FAN, LONG_READS, LONG_SECONDS, MIN_COST = 12, 24, 2, 5.0, "2s"
AIM_WAIT = 20.0  # --aim long: how long a kill waits for a node to hold a long result


def deaths_cost(log: str, deaths: list, nodes: int) -> float:
    """What the deaths cost whatever is recomputed, in makespan (an estimate with
    perfect balance): each dead node's CPU missing from its kill until its replacement
    runs its first task, and the work its running tasks had done, lost; over the
    ``nodes`` CPUs."""
    from chaos import runs

    done = runs(log)
    lost = 0.0
    for node, t_kill in deaths:
        before = {r.node for r in done if r.start < t_kill}
        fresh = [r.start for r in done if r.node not in before and r.start > t_kill]
        lost += (min(fresh) if fresh else t_kill) - t_kill
        lost += sum(t_kill - r.start for r in done if r.node == node and r.end is None)
    return lost / nodes


def holding_long_results(c: Any, log: str, bg: Any) -> str | None:
    """The kills' target with ``--aim long``: as soon as a node holds finished long work
    still needed (the ``hist`` of a long read, its subgraph's merge not started), the
    node holding the most: the founding user's worst case, an hour-long result lost
    while it waits for its merge. After ``AIM_WAIT`` s with none held, the busiest."""
    from chaos import busiest, runs

    waits_for = {f"hist-{g}-{i}": f"merge-{g}" for g in range(SUBGRAPHS) for i in range(LONG_READS)}
    deadline = time.monotonic() + AIM_WAIT
    while time.monotonic() < deadline:
        last: dict = {}  # label -> its latest run (a recomputed value is where it was made last)
        for r in runs(log):
            last[r.label] = r
        alive = {n.node_id for n in c.alive}
        held = Counter(
            r.node
            for label, r in last.items()
            if label in waits_for
            and r.end is not None
            and waits_for[label] not in last
            and r.node in alive
        )
        if held:
            node, n = held.most_common(1)[0]
            print(f"    kill: {node[:8]}, holding {n} long result(s)", flush=True)
            return node
        if bg.done.wait(0.05):
            return None
    print(f"    kill: no long result held in {AIM_WAIT:g} s, the busiest node", flush=True)
    return busiest(c, log, lambda k: True)


def two_kills(repeat: int, aim: str = "busiest") -> dict:
    """(b): makespans and re-executions, checkpoints off and on, failure-free and under
    the two-kill schedule (``aim``: the busiest node, or the node holding long
    results, ``holding_long_results``), interleaved on one cluster."""
    import logging

    import recovery

    logging.getLogger("raydag").setLevel(logging.WARNING)
    logging.getLogger("raydag").propagate = False
    spec = recovery.skim(
        SUBGRAPHS, FAN, tuple(range(SUBGRAPHS)), long_seconds=LONG_SECONDS, long_reads=LONG_READS
    )
    work = tempfile.mkdtemp(prefix="rdg-bench-ckpt-", dir="/tmp")
    b = recovery.Bench(work)
    modes = ("off", "on")
    try:
        b.cluster()
        head = _common.print_header(
            "bench/checkpoint.py --two-kills",
            {
                "cluster": "head (0 CPU) + 3 nodes x 1 CPU; a killed node is replaced "
                f"{recovery.REPLACE_AFTER:g} s later",
                "skim": f"{len(spec)} tasks: {SUBGRAPHS} subgraphs x {FAN} inputs, "
                f"{LONG_READS} reads of {LONG_SECONDS:g} s in each",
                "checkpoints": f"min-cost {MIN_COST}, store a local directory (one machine: "
                "every node reaches it)",
                "kills": "at 50% and 80% of the tasks done: "
                + (
                    "the busiest node"
                    if aim == "busiest"
                    else f"the node holding the most long results (busiest after {AIM_WAIT:g} s)"
                ),
            },
        )
        for i in range(repeat):
            for mode in modes:
                for label in ("free", "two kills"):
                    choose = holding_long_results if aim == "long" else None
                    kills = recovery.kills_at((0.5, 0.8), len(spec), choose)
                    chaos = kills if label != "free" else None
                    conf: dict = {"raydag.checkpoint.enabled": False}
                    if mode == "on":  # a store of its own per run: nothing to resume from
                        store = os.path.join(work, f"store-{i}-{label}")
                        conf = {"raydag.checkpoint.store": store}
                        conf["raydag.checkpoint.min-cost"] = MIN_COST
                    r = b.run(f"skim {label}", f"ckpt {mode}", spec, ["skim"], chaos, config=conf)
                    if chaos is not None:
                        r.extra["deaths cost"] = deaths_cost(r.extra["log"], r.extra["deaths"], 3)
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    free_off = statistics.median(
        r.wall for r in b.results if r.run == "free" and r.contender == "ckpt off"
    )
    for mode in modes:
        mine = [r for r in b.results if r.contender == f"ckpt {mode}"]
        free = statistics.median(r.wall for r in mine if r.run == "free")
        for run in ("free", "faults"):
            rs = [r for r in mine if r.run == run]
            walls = [r.wall for r in rs if r.outcome == "ok"]
            med = statistics.median(walls) if walls else None
            dc = [r.extra["deaths cost"] for r in rs if "deaths cost" in r.extra]
            deaths = statistics.median(dc) if dc else 0.0
            rows.append(
                [
                    mode,
                    "two kills" if run == "faults" else "none",
                    f"{len(walls)}/{len(rs)}",
                    med,
                    med / free if med else None,
                    med / free_off if med else None,
                    deaths,
                    (med - deaths) / free if med else None,
                    " ".join(str(r.reexecuted) for r in rs),
                    " ".join(str(r.minimum) for r in rs),
                ]
            )
    print("(b) the two-kill schedule, checkpoints off and on")
    print(
        _common.table(
            [
                "checkpoints",
                "kills",
                "ok",
                "median s",
                "x own free",
                "x free (off)",
                "deaths s",
                "x own free, less deaths",
                "re-executed",
                "minimum (no ckpt)",
            ],
            rows,
        )
    )
    print(
        "deaths s: the deaths' own cost in makespan, whatever is recomputed (median; each"
        "\nkilled node's CPU missing until its replacement runs a task, plus the work its"
        "\nrunning tasks had done, over 3 CPUs); re-executed: finished runs beyond one per"
        "\ntask (reads back of checkpoints are not runs); minimum: what the deaths make"
        "\nnecessary without checkpoints (tests/chaos.py)"
    )
    print("load avg at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return {"header": head, "results": [dataclasses.asdict(r) for r in b.results]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--two-kills", action="store_true", help="(b) only, on a multi-node cluster")
    ap.add_argument("--only", choices=("cost", "kill"), help="(c) or (a) alone")
    ap.add_argument(
        "--aim",
        choices=("busiest", "long"),
        default="busiest",
        help="(b): kill the busiest node, or the one holding the most long results",
    )
    args = ap.parse_args()
    if args.two_kills:
        results = two_kills(args.repeat, args.aim)
        if args.json:
            _common.write_json(args.json, results)
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
    for attempt in range(3):  # a raylet can time out starting on a loaded machine
        try:
            # its own, not one found
            ray.init(address="local", num_cpus=CPUS, include_dashboard=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    head = _common.print_header(
        "bench/checkpoint.py", {"n": args.n, "seconds": args.seconds, "repeat": args.repeat}
    )
    work = tempfile.mkdtemp(prefix="raydag-ckpt-bench-")
    n, sec = args.n, args.seconds
    results: dict = {"header": head, "cost": {}, "kill": []}
    try:
        one_run(work, "off", 2, 0.01)  # warm the workers
        if args.only in (None, "cost"):
            # 3600s: on, nothing worth writing (the fixed cost: names, the store's probe
            # and listing)
            cost: dict = {"off": [], "3600s": [], "0s": [], f"{sec}s": []}
            for _ in range(args.repeat):
                for mode in cost:
                    cost[mode].append(one_run(work, mode, n, sec)["s"])
            base = statistics.median(cost["off"])
            rows = [
                [mode, statistics.median(v), statistics.median(v) / base, len(v)]
                for mode, v in cost.items()
            ]
            print(
                "(c) failure-free runs, checkpoints off / on, nothing written (min-cost 1 h) /"
                " min-cost 0 / min-cost SECONDS"
            )
            print(_common.table(["checkpoints", "median s", "/ off", "n"], rows))
            results["cost"] = cost
        if args.only in (None, "kill"):
            rows = []
            for _ in range(args.repeat):
                empty = one_run(work, "off", 2, 0.0)  # a driver's fixed cost: start, connect
                whole = one_run(work, "0s", n, sec)
                first = one_run(work, "0s", n, sec, kill_after=0.8 * whole["wall"])
                rerun = one_run(work, "0s", n, sec)
                # no rerun can beat a driver's fixed cost (its start, Ray's worker start
                # for its job, its exit: the empty driver) plus the work not done by the
                # kill spread over the CPUs (reading the frontier back: ms, left out)
                bound = empty["wall"] + first["left"] / CPUS
                rows.append(
                    [
                        empty["wall"],
                        whole["wall"],
                        first["wall"],
                        rerun["wall"],
                        rerun["wall"] / whole["wall"],
                        bound,
                        bound / whole["wall"],
                        rerun["s"] / whole["s"],
                        (first["wall"] + rerun["wall"]) / whole["wall"],
                        f"{first['ran']}+{rerun['ran']}/{whole['tasks']}",
                    ]
                )
                results["kill"].append(
                    {"empty": empty, "whole": whole, "first": first, "rerun": rerun}
                )
            print(
                "(a) driver SIGKILLed at 80% of an uninterrupted run's wall time, then rerun "
                "(wall: the driver process's start to its end)"
            )
            print(
                _common.table(
                    [
                        "empty s",
                        "whole s",
                        "killed s",
                        "rerun s",
                        "rerun / whole",
                        "bound s",
                        "bound / whole",
                        "compute only",
                        "both / whole",
                        "tasks run",
                    ],
                    rows,
                )
            )
            print(
                "empty: a driver computing 2 tasks of 0 s (the fixed cost of any run); bound:"
                "\nempty + the task-seconds not done by the kill / CPUs (no rerun is faster);"
                "\ncompute only: the rerun's raydag.get time over the uninterrupted run's"
            )
        print("load avg at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ray.shutdown()
    if args.json:
        _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
