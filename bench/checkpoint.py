"""Checkpoints: a driver killed at about 80% and rerun, against one uninterrupted run;
and what checkpoints cost a run without failures.

The compute is ``tests/checkpoint_job.py``'s, scaled down from the founding user's
shape: N loads and N processings of SECONDS each (the long tasks), pairs summed, one
total (80 KB arrays). Each run is a driver process of its own, connected to one local
Ray cluster this script starts (so a SIGKILLed driver loses its objects, as a killed
login node would, and the cluster stays). Times are the compute's own (``raydag.get``,
measured in the driver), but for a killed driver: its wall time from its start.

  (a) kill   a driver SIGKILLed once 80% of its tasks have run, then run again: the
             rerun's time and both together, against an uninterrupted run (all with
             checkpoints at min-cost 0: every result written)
  (c) cost   uninterrupted runs with checkpoints off, at min-cost 0 (every result
             written: the worst case) and at SECONDS (the long tasks' results),
             interleaved, ``--repeat`` times

    python bench/checkpoint.py [--n 12] [--seconds 1.0] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

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


def one_run(work: str, min_cost: str, n: int, seconds: float, kill_at: float = 0.0) -> dict:
    """One driver; ``kill_at``: SIGKILL it once that fraction of the tasks ran."""
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
    if kill_at:
        while p.poll() is None and len(checkpoint_job.ran(log)) < kill_at * tasks:
            time.sleep(0.02)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            killed = True
    p.wait()
    wall = time.perf_counter() - t0
    if not killed and p.returncode != 0:
        raise RuntimeError(f"driver failed: {p.returncode}")
    compute = wall
    if not killed:  # the compute's own time (the driver's start and connect left out)
        with open(f"{out}.seconds") as f:
            compute = float(f.read())
    ran = len(checkpoint_job.ran(log))
    return {"s": compute, "wall": wall, "ran": ran, "tasks": tasks, "killed": killed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
    for attempt in range(3):  # a raylet can time out starting on a loaded machine
        try:
            ray.init(num_cpus=2, include_dashboard=False)
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
        cost: dict = {"off": [], "0s": [], f"{sec}s": []}
        for _ in range(args.repeat):
            for mode in cost:
                cost[mode].append(one_run(work, mode, n, sec)["s"])
        base = statistics.median(cost["off"])
        rows = [
            [mode, statistics.median(v), statistics.median(v) / base, len(v)]
            for mode, v in cost.items()
        ]
        print("(c) failure-free runs, checkpoints off / min-cost 0 / min-cost SECONDS")
        print(_common.table(["checkpoints", "median s", "/ off", "n"], rows))
        results["cost"] = cost
        rows = []
        for _ in range(args.repeat):
            whole = one_run(work, "0s", n, sec)
            first = one_run(work, "0s", n, sec, kill_at=0.8)
            rerun = one_run(work, "0s", n, sec)
            both = first["s"] + rerun["s"]
            rows.append(
                [
                    whole["s"],
                    first["s"],  # killed: its wall time
                    rerun["s"],
                    rerun["s"] / whole["s"],
                    both / whole["s"],
                    f"{first['ran']}+{rerun['ran']}/{whole['tasks']}",
                ]
            )
            results["kill"].append({"whole": whole, "first": first, "rerun": rerun})
        print("(a) driver SIGKILLed at 80% of its tasks, then rerun")
        print(
            _common.table(
                ["whole s", "killed s", "rerun s", "rerun / whole", "both / whole", "tasks run"],
                rows,
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ray.shutdown()
    if args.json:
        _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
