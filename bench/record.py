"""The run record and report at the founding user's scale (#19, deliverable 6), no Ray.

The real state machine runs the seed's graph (``tests/simcluster.py``'s ``seed_graph``)
on the simulated 280 x 12 cluster, in simulated time, once without and once with a
``Recorder`` observing it, each in a process of its own. Per run: what the driver
holds at the end (``tracemalloc``: the state machine, and the transcript if recorded),
the state machine's CPU; for the recorded run, the transcript's entries, the time to
build the events table, to write the record (parquet) and its size, the time to render
the report and the HTML's size.

    python bench/record.py [--sizes 60000,330000] [--evictions 0.02] [--policies off]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

import _common

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)


def child(size: int, recorded: bool, evictions: float, policies: bool) -> dict:
    sys.path.insert(0, os.path.join(TREE, "tests"))
    from simcluster import WALL0, Cluster, Sim, seed_graph

    from raydag.observe.record import Recorder
    from raydag.observe.report import write_report

    graph = seed_graph(size, heavy=500, order=False)
    cluster = Cluster(nodes=280, cpus=12, evictions_per_node_hour=evictions)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sim = Sim(graph, cluster, policies=policies)
    rec = None
    if recorded:
        nodes = {sim.node_ids[i]: cluster.cpus for i in sim.alive}
        rec = Recorder(graph, nodes, clock=sim.clock, wall=WALL0)
        spent = [0.0]

        def observe(event: object, out: list) -> None:  # the recorder, timed
            t = time.process_time()
            rec(event, out)
            spent[0] += time.process_time() - t

        sim.observers.append(observe)
    result = sim.run()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out = {
        "tasks": len(graph),
        "recorded": recorded,
        "held": held - base,
        "peak": peak - base,
        "state_cpu": result.driver_cpu,
        "events": result.events,
        "waves": result.waves,
        "complete": result.complete,
    }
    if rec is not None:
        out["record_cpu"] = spent[0]
        out["entries"] = len(rec.transcript)
        record = rec.finish()
        t = time.perf_counter()
        table = record.events_table
        out["table_s"] = time.perf_counter() - t
        out["rows"] = table.num_rows
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            path = record.write(os.path.join(d, "run"))
            out["write_s"] = time.perf_counter() - t
            out["parquet_bytes"] = sum(f.stat().st_size for f in path.iterdir())
            t = time.perf_counter()
            html = write_report(record, os.path.join(d, "report.html"))
            out["report_s"] = time.perf_counter() - t
            out["report_bytes"] = html.stat().st_size
        summary = record.summary()
        out["summary"] = {k: summary[k] for k in ("executions", "recovery_waves", "recomputed")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="60000,330000")
    ap.add_argument("--evictions", type=float, default=0.02, help="per node-hour")
    ap.add_argument("--policies", choices=("on", "off"), default="off")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        size, recorded = int(args.child[0]), args.child[1] == "1"
        out = child(size, recorded, args.evictions, args.policies == "on")
        print(json.dumps(out))
        return
    info = _common.print_header("record: the run record and report at 60k-330k tasks")
    print(f"cluster : 280 x 12 simulated, evictions {args.evictions}/node-h, "
          f"policies {args.policies}")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TREE, os.environ.get("PYTHONPATH", "")]))
    results, rows = [], []
    mb = 2**20
    for size in (int(s) for s in args.sizes.split(",")):
        got = {}
        for recorded in (False, True):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(size)]
            cmd += [str(int(recorded)), "--evictions", str(args.evictions)]
            cmd += ["--policies", args.policies]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            got[recorded] = json.loads(proc.stdout.splitlines()[-1])
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"{size} recorded={recorded}: {json.dumps(got[recorded])} (load {load})")
        off, on = got[False], got[True]
        results.append(got)
        extra = on["held"] - off["held"]
        rows.append([
            on["tasks"], on["events"], on["entries"], f"{off['held'] / mb:.0f}",
            f"{on['held'] / mb:.0f}", f"{extra / mb:.0f}", f"{extra / on['tasks']:.0f}",
            f"{on['record_cpu']:.2f}", f"{100 * on['record_cpu'] / on['state_cpu']:.1f}",
            f"{on['table_s']:.1f}",
            f"{on['write_s']:.1f}", f"{on['parquet_bytes'] / mb:.1f}", f"{on['report_s']:.1f}",
            f"{on['report_bytes'] / mb:.1f}",
        ])  # fmt: skip
    print()
    headers = ["tasks", "events", "entries", "held MB", "+rec MB", "record MB", "B/task",
               "rec CPU s", "% of state", "table s", "write s", "parquet MB", "report s", "html MB"]  # fmt: skip
    print(_common.table(headers, rows))
    print()
    print("held: what the driver holds at the end (tracemalloc) without / with the recorder;")
    print("rec CPU: the recorder's own CPU during the run; % of state: of the state machine's")
    print(f"load avg at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        info["results"] = results
        _common.write_json(args.json, info)


if __name__ == "__main__":
    main()
