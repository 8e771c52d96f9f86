"""The real state machine on a simulated 280-node x 12-CPU cluster (no Ray).

The founding user's graph (26 subgraphs of chains of depth 5, fan-ins of 25 and 100,
most tasks seconds to minutes, 500 of about an hour) at 60k, 150k and 330k tasks, on a
cluster whose nodes a batch pool evicts (a Poisson rate per node-hour, each replaced
after a delay). Time is simulated (``tests/simcluster.py``): a 5-hour compute takes
minutes. Per run it measures the driver's CPU inside ``State`` (``time.process_time``
around every ``handle``/``start``, apart from the simulator's own work), the driver's
memory, the makespan against its lower bound, the recovery waves and re-executions,
with raydag's policies (fusion, placement, speculation) on and off, or some of them
(``on-speculation``: all but speculation), with checkpoints or not (``+checkpoints``: the
defaults, written and read at ``Cluster.checkpoint_bandwidth``), over several eviction
schedules (``--draws``: which task an eviction hits moves a makespan by an hour, so a
policy is judged on a family of draws, never on one).

    .nox/tests/bin/python bench/simcluster.py                      # about 15 min of CPU
    .nox/tests/bin/python bench/simcluster.py --sizes 60000 --profile
    .nox/tests/bin/python bench/simcluster.py --sizes 60000 --evictions 0.02 \
        --draws 0,1,2,3,4,5 --policies off,off+checkpoints,on,on+checkpoints
    .nox/tests/bin/python bench/simcluster.py --a /tmp/old-main --sizes 60000

Each run is a child process that loads the graph (built and ordered once, pickled). The
driver memory in the table is what ``State()`` and ``start()`` allocate (tracemalloc, in a
child of its own); the JSON also has each run's peak RSS past the loaded graph, which
under-counts (the run reuses heap that loading the graph made resident).
``--a TREE`` runs every compute also with another source tree's raydag (say, a worktree
of main), alternately, for a before/after in one run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pickle
import pstats
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict

import _common

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, os.path.abspath(TESTS))
from simcluster import POLICIES, Cluster, Sim, seed_graph  # noqa: E402

HERE = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def policies(spelled: str) -> dict:
    """``Sim``'s keywords for ``on``, ``off``, or either with policies taken away or
    added: ``on-speculation`` (all on but speculation), ``on-fusion-placement``,
    ``on+checkpoints`` (checkpoints, at the default ``min-cost``, on top: the founding
    user's set-up, with a checkpoint store)."""
    from raydag.core.checkpoints import Checkpoints

    base, *mods = re.split(r"(?=[+-])", spelled)
    if base not in ("on", "off"):
        raise ValueError(f"policies {spelled!r}: start with 'on' or 'off'")
    on = set(POLICIES) if base == "on" else set()
    checkpoints = None
    for mod in mods:
        sign, name = mod[0], mod[1:]
        if name == "checkpoints":
            checkpoints = Checkpoints(enabled=True, store="sim://") if sign == "+" else None
        elif name in POLICIES:
            (on.add if sign == "+" else on.discard)(name)
        else:
            raise ValueError(f"policies {spelled!r}: no policy {name!r}")
    if base == "off" and on:
        raise ValueError(f"policies {spelled!r}: say 'on' less the others, not 'off' plus")
    kw: dict = {"policies": bool(on), "checkpoints": checkpoints}
    if on:
        kw["without"] = sorted(set(POLICIES) - on)
    return kw


def child(args: argparse.Namespace) -> None:
    """One simulated compute (``--child``): the graph from a pickle, the result as JSON.

    Its peak RSS is its own, past the graph: ``VmHWM`` reset once the graph is loaded
    (``/proc/self/clear_refs``), less the RSS then.
    """
    with open(args.child, "rb") as f:
        graph, cluster = pickle.load(f)
    if args.traced:  # what State and start() allocate, by tracemalloc
        tracemalloc.start()
        sim = Sim(graph, cluster, policies=True)
        sim.state.start()
        json.dump({"traced": tracemalloc.get_traced_memory()}, sys.stdout)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass
    rss0 = _common.proc_status("VmRSS")
    prof = cProfile.Profile() if args.profile else None
    sim = Sim(graph, cluster, **policies(args.policies), profile=prof)
    result = asdict(sim.run())
    result["rss_peak"] = _common.proc_status("VmHWM") - rss0
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        result["profile"] = s.getvalue()
    json.dump(result, sys.stdout)


def spawn(path: str, tree: str, *extra: str, hash_seed: int = 0) -> dict:
    """Run a child with ``tree``'s raydag first on the path. Its string hashes are
    seeded (``hash_seed``): the order of a set of keys decides ties, and a run with
    random hashes is not the same compute twice (A and B of one draw would differ by
    more than their trees)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]),
        PYTHONHASHSEED=str(hash_seed),
    )
    out = subprocess.run(
        [sys.executable, __file__, "--child", path, *extra],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="60000,150000,330000")
    ap.add_argument("--nodes", type=int, default=280)
    ap.add_argument("--cpus", type=int, default=12)
    ap.add_argument("--store", default="64GiB", help="each node's object store")
    ap.add_argument(
        "--evictions", default="0,0.02", help="per node-hour (Poisson), comma-separated"
    )
    ap.add_argument("--replace-after", type=float, default=600.0, help="seconds")
    ap.add_argument(
        "--policies",
        default="on,off",
        help="comma-separated: on, off, on less some (on-speculation, on-fusion-placement), "
        "either with checkpoints (on+checkpoints)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile State at the largest size")
    ap.add_argument("--heavy", type=int, default=500, help="tasks of about an hour")
    ap.add_argument("--seed", type=int, default=0, help="the graph's runtimes")
    ap.add_argument(
        "--draws",
        default="0",
        help="seeds of the evictions' schedule, comma-separated: one run per draw "
        "(which tasks an eviction hits moves the makespan by an hour)",
    )
    ap.add_argument(
        "--a", help="also run every compute with this source tree's raydag (A/B, alternately)"
    )
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    # One hash seed for the bench and its children: dask.order breaks ties in set order,
    # and so may a decision of raydag's; with the process's own random seed, equal runs
    # differed by 1-3 h of makespan at 60k tasks (which heavy task an eviction then hits).
    if os.environ.get("PYTHONHASHSEED") is None:
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"}
        )
    from dask.utils import parse_bytes

    rates = [float(x) for x in args.evictions.split(",")]
    header = _common.print_header(
        "simcluster: the state machine on a simulated cluster",
        {
            "cluster": f"{args.nodes} nodes x {args.cpus} CPUs, object store {args.store} each",
            "faults": f"evictions {args.evictions} per node-hour (Poisson), each node "
            f"replaced after {args.replace_after:.0f} s",
            "trees": f"B {HERE}" + (f", A {os.path.abspath(args.a)}" if args.a else ""),
        },
    )
    trees = [("B", HERE)] + ([("A", os.path.abspath(args.a))] if args.a else [])
    sizes = [int(s) for s in args.sizes.split(",")]
    draws = [int(d) for d in args.draws.split(",")]
    results = []
    tmp = tempfile.mkdtemp(prefix="simcluster-")
    for size in sizes:
        t0 = time.perf_counter()
        graph = seed_graph(size, heavy=args.heavy, seed=args.seed)
        intake = time.perf_counter() - t0
        for rate, draw in [(r, d) for r in rates for d in draws]:
            cluster = Cluster(
                nodes=args.nodes,
                cpus=args.cpus,
                store=parse_bytes(args.store),
                evictions_per_node_hour=rate,
                replace_after=args.replace_after,
                seed=draw,
            )
            path = os.path.join(tmp, f"{size}-{rate}-{draw}.pickle")
            with open(path, "wb") as f:
                pickle.dump((graph, cluster), f)
            if rate == rates[0] and draw == draws[0]:
                traced = spawn(path, HERE, "--traced")["traced"]
                print(
                    f"\n{len(graph):,} tasks: graph and dask.order {intake:.1f} s; State + "
                    f"start() allocate {traced[0] / 2**20:,.0f} MiB (tracemalloc)"
                )
            for pol in args.policies.split(","):
                for name, tree in trees:
                    profile = args.profile and size == max(sizes) and pol == "on" and name == "B"
                    extra = ["--policies", pol] + (["--profile"] if profile else [])
                    r = spawn(path, tree, *extra, hash_seed=draw)
                    r.update(
                        size=len(graph),
                        policies=pol,
                        rate=rate,
                        draw=draw,
                        tree=name,
                        state=traced[0],
                    )
                    results.append(r)
                    bound = max(r["critical_path"], r["work_bound"])
                    print(
                        f"  {name} evictions {rate} draw {draw} policies {pol}: makespan "
                        f"{r['makespan'] / 3600:.2f} h ({r['makespan'] / bound:.3f} x bound), "
                        f"driver CPU {r['driver_cpu']:.1f} s, {r['events']:,} events, "
                        f"sim wall {r['sim_wall']:.0f} s",
                        flush=True,
                    )
                    if "profile" in r:
                        print(r.pop("profile"), flush=True)
            os.unlink(path)
    os.rmdir(tmp)
    rows = []
    for r in results:
        bound = max(r["critical_path"], r["work_bound"])
        rows.append(
            [
                f"{r['size']:,}",
                r["rate"],
                r["draw"],
                r["policies"],
                r["tree"],
                f"{r['events']:,}",
                r["driver_cpu"],
                1e6 * (r["driver_cpu"] - r["start_cpu"]) / max(1, r["events"]),
                1e6 * r["driver_cpu"] / r["size"],
                r["start_cpu"],
                100 * r["driver_cpu"] / r["makespan"],
                r["state"] / 2**20,
                r["makespan"] / 3600,
                r["critical_path"] / 3600,
                r["work_bound"] / 3600,
                r["makespan"] / bound,
                r["evictions"],
                r["waves"],
                r["reexecuted"],
                r["killed"],
                r["duplicates"],
                r.get("checkpoints", 0),
                r.get("restored", 0),
                r["wasted_cpu"] / 3600,
                100 * r["peak_store"],
                r["sim_wall"],
                "yes" if r["complete"] else "NO",
            ]
        )
    print()
    print(
        _common.table(
            [
                "tasks",
                "evict/h",
                "draw",
                "pol",
                "tree",
                "events",
                "CPU s",
                "us/event",
                "us/task",
                "start s",
                "CPU %",
                "State MiB",
                "make h",
                "crit h",
                "work h",
                "x bound",
                "evict",
                "waves",
                "re-exec",
                "killed",
                "dups",
                "ckpts",
                "read back",
                "waste CPU-h",
                "store %",
                "wall s",
                "done",
            ],
            rows,
        )
    )
    print()
    print("driver CPU per event type (events x us per event):")
    kinds = sorted({k for r in results for k in r["per_event"]})
    erows = []
    for r in results:
        cells = []
        for k in kinds:
            n, cpu = r["per_event"].get(k, (0, 0.0))
            cells.append(f"{n:,} x {1e6 * cpu / n:.0f}" if n else "-")
        erows.append([f"{r['size']:,}", r["rate"], r["draw"], r["policies"], r["tree"], *cells])
    print(_common.table(["tasks", "evict/h", "draw", "pol", "tree", *kinds], erows))
    makespans: dict[tuple, dict] = {}
    for r in results:
        at = (r["size"], r["rate"], r["tree"])
        makespans.setdefault(at, {}).setdefault(r["draw"], {})[r["policies"]] = r["makespan"]
    pairs = [
        [f"{size:,}", rate, tree, draw, by["on"] / by["off"]]
        for (size, rate, tree), got in makespans.items()
        for draw, by in got.items()
        if "on" in by and "off" in by
    ]
    if pairs:
        print()
        print("makespan, policies on / off, draw by draw (the same evictions' schedule):")
        print(_common.table(["tasks", "evict/h", "tree", "draw", "on / off"], pairs))
    if args.json:
        _common.write_json(args.json, {"header": header, "results": results})


if __name__ == "__main__":
    main()
