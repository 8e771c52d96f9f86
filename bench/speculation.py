"""Speculative duplicates: a family of straggler scenarios (issue #17), and #4's graph.

``--family`` (the default): independent tasks of ONE category (``work``) and a final
task reading them all, on 3 or 6 one-CPU nodes, one of which is slowed (2x, 5x, 20x) or
hangs (its tasks sleep ``HANG`` s): the slowed node is started with
``RAYDAG_TEST_SLOWDOWN`` set and the tasks read it (tests/test_speculation.py's
``spin``). Categories mix lengths (half 0.1-0.4 s, half 1-2 s: one function, different
inputs) or not (0.5-1 s); long tasks are #17's 10-60 s scaled down 10x to 1-6 s (half
1-2 s and half 4-6 s, or 3-5 s), for time on a shared machine. Each scenario runs with
speculation off, on, and under ``ray_dask_get``, in one run, and is set against its
own lower bound: the clairvoyant optimum, the best assignment of the tasks to nodes
of known speeds (1, 1/f for the slowed node, 0 for the hung one) plus the final task
(tests/schedule_bound.py; no schedule, with duplicates or not, beats it), printed with
its arithmetic beside the fractional bound max(longest task, total work / summed
speeds), which 7-17 tasks cannot reach. Beside it, what the order's luck costs a
scheduler blind to the lengths of one category's tasks (as every online one is) but
told the nodes' speeds: random orders list-scheduled on the nodes not slowed
(``schedule_bound.blind``; median and 90th percentile over the bound). A hung
``ray_dask_get`` waits ``HANG`` s.

``--issue4``: #4's scenarios, as before:

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
import math
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

import dask
import pandas as pd
import ray

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.join(HERE, "..", "tests"), HERE, os.environ.get("PYTHONPATH")) if p
)

from _common import print_header, table, write_json  # noqa: E402
from harness import MultiNodeCluster  # noqa: E402
from schedule_bound import Bound, blind, bound, speeds_of  # noqa: E402
from test_speculation import HANG, graph, runs, spin  # noqa: E402

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
    ap.add_argument("--issue4", action="store_true", help="#4's scenarios (a) and (b)")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=1)
    ap.add_argument("--kill-at", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help="family: run the scenarios whose name has this")
    ap.add_argument(
        "--simulate",
        action="store_true",
        help="family on the state machine and a simulated cluster (no Ray, no overheads)",
    )
    ap.add_argument(
        "--record",
        action="store_true",
        help="family: keep each raydag run's submits (node, reason) and ends in the JSON",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.issue4:
        issue4(args)
    elif args.simulate:
        simulated(args)
    else:
        family(args)


def issue4(args: argparse.Namespace) -> None:
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


# ---- the family (#17) ------------------------------------------------------------

FAMILY_SETTINGS = {"raydag.record.enabled": True}  # the defaults: nobody tuned them
MARK = {"RAYDAG_TEST_SLOWDOWN": "1"}  # the slowed node; the factor is the task's
LENGTHS = {  # (low, high) seconds, half each for "mixed"
    ("short", "mixed"): ((0.1, 0.4), (1.0, 2.0)),
    ("short", "single"): ((0.5, 1.0), (0.5, 1.0)),
    ("long", "mixed"): ((1.0, 2.0), (4.0, 6.0)),
    ("long", "single"): ((3.0, 5.0), (3.0, 5.0)),
    ("short", "three"): ((0.1, 0.3), (0.6, 0.9), (1.5, 2.0)),  # a third each
    ("long", "three"): ((1.0, 1.5), (2.5, 3.5), (5.0, 6.0)),
}
# (nodes, factor, lengths, mix): factor inf is a hung node
FAMILY = [
    (3, 2.0, "short", "mixed"),
    (3, 5.0, "short", "mixed"),
    (3, 20.0, "short", "mixed"),
    (3, math.inf, "short", "mixed"),
    (3, 5.0, "short", "single"),
    (3, 5.0, "long", "single"),
    (3, 20.0, "long", "mixed"),
    (6, 5.0, "short", "mixed"),
    (6, math.inf, "short", "mixed"),
    (6, 2.0, "long", "single"),
]
# ``--simulate`` only, not fitted to: (nodes, factor, lengths, mix, slowed nodes); factor
# 1 is no slow node (speculation must cost nothing there)
EXTRA = [
    (4, 3.0, "short", "mixed", 2),
    (3, 5.0, "short", "three", 1),
    (3, 2.0, "long", "three", 1),
    (12, 5.0, "short", "mixed", 1),
    (12, 3.0, "short", "three", 3),
    (3, 1.0, "short", "mixed", 1),
    (6, 1.0, "short", "three", 1),
]


def scenario_name(nodes: int, factor: float, lengths: str, mix: str, slowed: int = 1) -> str:
    """``3n 5x short mixed``, ``6n hung short mixed``, ``4n 2 at 3x short mixed``,
    ``3n none short mixed`` (what ``--only`` matches)."""
    pace = "hung" if factor == math.inf else f"{factor:g}x"
    pace = "none" if factor == 1 else pace if slowed == 1 else f"{slowed} at {pace}"
    return f"{nodes}n {pace} {lengths} {mix}"


def family_spec(nodes: int, factor: float, lengths: str, mix: str, seed: int = 0) -> dict:
    """``work-i`` tasks about 2.5 s of work per node (short) or 9 s (long), and ``total``."""
    rng = random.Random(seed)
    ranges = LENGTHS[(lengths, mix)]
    mean = sum(a + b for a, b in ranges) / 2 / len(ranges)
    n = max(nodes, round(nodes * (2.5 if lengths == "short" else 9.0) / mean))
    spec: dict[str, tuple] = {}
    for i in range(n):
        lo, hi = ranges[i % len(ranges)]
        spec[f"work-{i}"] = (round(rng.uniform(lo, hi), 3), factor, ())
    spec["total"] = (0.1, factor, tuple(spec))
    return spec


def family_speeds(spec: dict, nodes: int, factor: float, slowed: int = 1) -> tuple[list, list]:
    """The scenario's task lengths (the final task apart) and node speeds (1, ``1/factor``
    for the slowed nodes, 0 for a hung one)."""
    lengths = [s for k, (s, _, _) in spec.items() if k != "total"]
    speeds = speeds_of(nodes, factor)
    speeds[1:slowed] = speeds[:1] * (slowed - 1)
    return lengths, speeds


def family_bound(spec: dict, nodes: int, factor: float, slowed: int = 1) -> Bound:
    """The clairvoyant optimum (tests/schedule_bound.py): the best assignment of the
    tasks to nodes of known speeds, plus the final task; the fractional bound where the
    search is too big."""
    return bound(*family_speeds(spec, nodes, factor, slowed), spec["total"][0])


def family_blind(spec: dict, nodes: int, factor: float, slowed: int = 1) -> list[float]:
    """``schedule_bound.blind`` of the scenario: what luck in the order of one category's
    tasks, unknown lengths, costs a scheduler that knows the nodes' speeds and keeps
    first copies off those ``raydag.speculation.slow-node`` times slower."""
    avoid = float(raydag.config.default("speculation.slow-node"))
    return blind(*family_speeds(spec, nodes, factor, slowed), spec["total"][0], avoid=avoid)


def run_ray_dask_get(spec: dict, log: str, timeout: float) -> float | None:
    """``ray_dask_get`` on the same graph (old-style tuples); ``None``: not done in time."""
    from ray.util.dask import ray_dask_get

    # the label is no key: in an old-style graph a string naming a key is that key's value
    dsk = {k: (spin, f"rdg:{k}", log, s, slow, *deps) for k, (s, slow, deps) in spec.items()}
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            result["value"] = ray_dask_get(dsk, ["total"])
        except BaseException as e:  # reported below
            result["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    if "error" in result:
        raise result["error"]
    return None if t.is_alive() else 0.0


def family_run(spec: dict, mode: str, timeout: float, record: bool = False) -> dict[str, Any]:
    fd, log = tempfile.mkstemp(prefix="rdg-bench-fam-", suffix=".log", dir="/tmp")
    os.close(fd)
    warm()
    t0 = time.monotonic()
    hung = False
    if mode == "ray_dask_get":
        hung = run_ray_dask_get(spec, log, timeout) is None
    else:
        cfg = {**FAMILY_SETTINGS, "raydag.speculation.enabled": mode == "on"}
        with dask.config.set(cfg):
            raydag.ray_get(graph(spec, log), ["total"])
    wall = time.monotonic() - t0
    rs = runs(log)
    os.unlink(log)
    first = min(t for *_, t in rs)
    ends = [t for k, *_, t in rs if k == "end"]
    span = (time.time() - first) if hung else max(ends) - first
    out: dict[str, Any] = {"makespan": span, "wall": wall, "hung": hung}
    out["runs"] = sum(1 for k, *_ in rs if k == "start")
    # every run's start and end, seconds from the first start (for the JSON)
    out["log"] = [(k, lab, n[:8], round(t - first, 3)) for k, lab, n, t in rs]
    if mode != "ray_dask_get":
        last = raydag.last_run()
        s = last.summary()
        out["duplicates"], out["won"] = s["duplicates"], s["duplicates_won"]
        if record:  # what the scheduler decided: each submit (node, reason) and end
            ev = last.events
            ev = ev[ev.event.isin(["submitted", "finished", "cancelled", "failed"])]
            cols = ["time", "event", "key", "node", "duplicate", "reason"]
            out["record"] = [
                [round(r[0], 3), *(None if pd.isna(v) else str(v) for v in r[1:])]
                for r in ev[cols].itertuples(index=False)
            ]
    return out


def family(args: argparse.Namespace) -> None:
    scenarios = [sc for sc in FAMILY if args.only is None or args.only in scenario_name(*sc)]
    header = print_header(
        "speculation: a family of stragglers (issue #17)",
        {
            "cluster": "head (0 CPUs) + 3 or 6 nodes x 1 CPU; one node slowed or hung",
            "graph": "one category 'work' (mixed or single lengths) + 'total' reading all",
            "lengths": {f"{k[0]} {k[1]}": v for k, v in LENGTHS.items()},
            "scale": "long tasks: #17's 10-60 s scaled 10x down to 1-6 s",
            "settings": "defaults (raydag.yaml), speculation on / off",
            "hang": f"a hung task sleeps {HANG:.0f} s",
            "repeats": args.repeats,
        },
    )
    rows, out = [], []
    with MultiNodeCluster(nodes=2) as c:
        c.add_node(env_vars=MARK)
        size = 3
        for nodes, factor, lengths, mix in sorted(scenarios, key=lambda sc: sc[0]):
            while size < nodes:
                c.add_node()
                size += 1
            spec = family_spec(nodes, factor, lengths, mix)
            b = family_bound(spec, nodes, factor)
            bound, how = b.seconds, b.how
            spans = family_blind(spec, nodes, factor)
            blind_x = [spans[len(spans) // 2] / bound, spans[len(spans) * 9 // 10] / bound]
            name = scenario_name(nodes, factor, lengths, mix)
            for rep in range(1, args.repeats + 1):
                got = {
                    m: family_run(spec, m, HANG + 5, args.record)
                    for m in ("off", "on", "ray_dask_get")
                }
                on, off, rdg = got["on"], got["off"], got["ray_dask_get"]
                rows.append(
                    [
                        name,
                        rep,
                        len(spec) - 1,
                        round(bound, 2),
                        round(b.fractional, 2),
                        "{:.2f} {:.2f}".format(*blind_x),
                        round(off["makespan"] / bound, 2),
                        round(on["makespan"] / bound, 2),
                        (">" if rdg["hung"] else "") + f"{rdg['makespan'] / bound:.2f}",
                        round(on["makespan"] / off["makespan"], 2),
                        round(on["makespan"] / rdg["makespan"], 2),
                        f"{on['duplicates']}/{on['won']}",
                    ]
                )
                out.append(
                    {"scenario": name, "repeat": rep, "bound": bound, "how": how, "blind": blind_x}
                    | got
                )
                print(f"{name} rep {rep}: bound {how}", file=sys.stderr)
                for line in table(FAMILY_HEADERS, rows[-1:]).splitlines()[2:]:
                    print(line, file=sys.stderr, flush=True)
    print()
    print(table(FAMILY_HEADERS, rows))
    print("\nlower bounds (the best assignment to nodes of known speeds + final task):")
    for o in out:
        if o["repeat"] == 1:
            print(f"  {o['scenario']}: {o['how']}")
    print(
        "\nx bound: makespan (first task start to last task end) over the bound (exact unless "
        "said); frac s: the fractional bound, for comparison; blind x: the median and 90th "
        "percentile over the bound of random task orders list-scheduled on the nodes not "
        "slowed (a scheduler blind to lengths, told the speeds); on/off and "
        "on/rdg: makespan ratios in the same repeat; dups: duplicates made/won (on); "
        f">: ray_dask_get not done after {HANG + 5:.0f} s"
    )
    if args.json:
        write_json(args.json, {**header, "results": out})


RATIOS = ("off x", "on x", "rdg x", "on/off", "on/rdg", "dups")


def simulated(args: argparse.Namespace) -> None:
    """The family's graphs on tests/test_speculation_policy.py's simulated cluster."""
    from test_speculation_policy import Cluster, make, simulate

    from raydag.core.speculation import Speculation

    print_header("speculation: the #17 family, simulated (state machine, no Ray)")
    rows, hows = [], []
    for nodes, factor, lengths, mix, slowed in [(*sc, 1) for sc in FAMILY] + EXTRA:
        spec = family_spec(nodes, factor, lengths, mix)
        b = family_bound(spec, nodes, factor, slowed)
        bound = b.seconds
        deps = {k: set(d) for k, (_, _, d) in spec.items()}
        length = {k: sec for k, (sec, _, _) in spec.items()}
        took = {}
        slow = tuple(f"n{i}" for i in range(slowed))
        for on in (False, True):
            state = make(deps, ["total"], nodes, Speculation(enabled=on))
            t, state = simulate(state, Cluster(nodes, slow, factor), length, horizon=HANG)
            took[on] = t if state.done else None
        off = ">" + f"{HANG / bound:.2f}" if took[False] is None else round(took[False] / bound, 2)
        name = scenario_name(nodes, factor, lengths, mix, slowed)
        rows.append([name, len(spec) - 1, round(bound, 2), round(b.fractional, 2), off])
        rows[-1].append(round(took[True] / bound, 2))
        ratio = None if took[False] is None else round(took[True] / took[False], 2)
        rows[-1].append(ratio)
        hows.append(f"  {name}: {b.how}")
        if (nodes, factor, lengths, mix) not in FAMILY:
            rows[-1][0] += " *"
    print(table(["scenario", "tasks", "bound s", "frac s", "off x", "on x", "on/off"], rows))
    print("\n*: not in the family on Ray (--simulate only)")
    print("\nlower bounds (the best assignment to nodes of known speeds + final task):")
    print("\n".join(hows))


FAMILY_HEADERS = ["scenario", "rep", "tasks", "bound s", "frac s", "blind x", *RATIOS]


if __name__ == "__main__":
    main()
