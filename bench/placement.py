"""Storage-aware placement (#5): per-node peak store use, bytes spilled, makespan.

On a ``tests/harness.py`` cluster: a head without CPUs and 3 worker nodes of 2 CPUs
and a 100 MiB object store each. Two graphs from ``tests/workloads.py``:

  pile-up  2 chains, one after the other, of 75 steps of 2 MiB that each read the
           step before (Ray's locality keeps a chain on one node) and are all held
           until the chain's fan-in: 150 MiB held at once, 300 MiB (3x one node's
           store) of intermediates in all
  fits     the same shape with values 8x smaller: nothing comes near a store's size

Contenders, in one run, interleaved, each repeated: raydag (placement on, the
default), raydag with placement off (locality only: Ray's placement), and Ray's
``ray_dask_get``. Peaks are the largest ``used`` bytes each node's raylet reported,
sampled every 50 ms (secondary copies included), pinned the largest primary-copy
bytes; spilled is what the raylets spilled during the compute. Each compute runs on a
fresh cluster.

    python bench/placement.py [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _common
import dask
import numpy as np
from ray.util.dask import ray_dask_get

import raydag
from raydag.runtime.stores import StoreSampler

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, os.path.abspath(TESTS))
import workloads  # noqa: E402
from chaos import Clusters  # noqa: E402

MB = 2**20
STORE = 100 * MB
GRAPHS = {  # name: chains(n, length, nbytes)
    "pile-up": dict(n=2, length=75, nbytes=2 * MB, sequential=True),
    "fits": dict(n=2, length=75, nbytes=MB // 4, sequential=True),
}
CONTENDERS = {
    "raydag": (raydag.ray_get, {}),
    "raydag, locality only": (raydag.ray_get, {"raydag.placement.enabled": False}),
    "ray_dask_get": (ray_dask_get, {}),
}


def one(graph: str, contender: str) -> dict:
    """One compute on a fresh cluster: Ray keeps cached copies (and what it restored
    from spill) in the stores after a compute, which would count in the next one's."""
    get, cfg = CONTENDERS[contender]
    spec = GRAPHS[graph]
    clusters = Clusters(nodes=3, cpus=2, store_bytes=STORE)  # retries a slow start
    try:
        c = clusters.get()
        nodes = [n.node_id for n in c.nodes]
        dask.compute(*workloads.chains(1, 10, MB), scheduler=raydag.ray_get)  # warm workers
        g = workloads.chains(**spec)
        with dask.config.set(cfg), StoreSampler(0.05) as s:
            t0 = time.perf_counter()
            got = dask.compute(*g, scheduler=get)
            wall = time.perf_counter() - t0
        primary: dict = {}
        for x in s.samples:  # pinned copies are read in the same round
            primary[x.node] = max(primary.get(x.node, 0), x.primary_bytes)
    finally:
        clusters.close()
    assert np.allclose(got, workloads.chains_expected(spec["n"], spec["length"])), got
    first: dict = {}
    last: dict = {}
    for x in s.samples:
        first.setdefault(x.node, x.spilled_bytes)
        last[x.node] = x.spilled_bytes
    peaks = [s.peak_used.get(n, 0) for n in nodes]
    pinned = [primary.get(n, 0) for n in nodes]
    return {
        "graph": graph,
        "contender": contender,
        "wall_s": wall,
        "peaks": peaks,
        "max_peak": max(peaks),
        "max_over_mean": max(peaks) / (sum(peaks) / len(peaks)),
        "pinned": pinned,
        "max_pinned": max(pinned),
        "spilled": sum(last[n] - first[n] for n in last),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.abspath(TESTS), os.environ.get("PYTHONPATH")) if p
    )
    info = _common.print_header(
        "storage-aware placement",
        {
            "cluster": "head (0 CPUs) + 3 nodes x 2 CPUs, 100 MiB object store each",
            "graphs": ", ".join(
                f"{k}: {v['n']} chains (in turn) x {v['length']} steps x {v['nbytes'] / MB:g} MiB"
                for k, v in GRAPHS.items()
            ),
            "placement": dict(raydag.config.get("placement")),
        },
    )
    results = []
    for r in range(args.repeat):
        for graph in GRAPHS:
            for contender in CONTENDERS:
                res = one(graph, contender)
                results.append(res)
                print(
                    f"  [{r + 1}/{args.repeat}] {graph:8} {contender:22} "
                    f"{res['wall_s']:6.2f} s  peaks "
                    + "/".join(f"{p / MB:.0f}" for p in res["peaks"])
                    + " MiB (pinned "
                    + "/".join(f"{p / MB:.0f}" for p in res["pinned"])
                    + f")  spilled {res['spilled'] / MB:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
    rows = []
    med: dict = {}
    for graph in GRAPHS:
        for contender in CONTENDERS:
            rs = [x for x in results if x["graph"] == graph and x["contender"] == contender]
            m = {
                k: statistics.median(x[k] for x in rs)
                for k in ("wall_s", "max_peak", "max_over_mean", "max_pinned", "spilled")
            }
            med[graph, contender] = m
        base = med[graph, "raydag"]
        for contender in CONTENDERS:
            m = med[graph, contender]
            rows.append(
                [
                    graph,
                    contender,
                    m["wall_s"],
                    m["wall_s"] / base["wall_s"],
                    m["max_peak"] / MB,
                    m["max_over_mean"],
                    m["max_pinned"] / MB,
                    m["spilled"] / MB,
                ]
            )
    print(f"\nmedians of {args.repeat} runs (wall ratio: against raydag on the same graph)")
    print(
        _common.table(
            [
                "graph",
                "contender",
                "wall s",
                "x raydag",
                "max peak MiB",
                "max/mean peak",
                "max pinned MiB",
                "spilled MiB",
            ],
            rows,
        )
    )
    if args.json:
        _common.write_json(args.json, {**info, "results": results})


if __name__ == "__main__":
    main()
