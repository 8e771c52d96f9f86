"""Two versions of raydag side by side: one benchmark run alternately from two source trees.

A redesign must not cost what it does not say. This runs ``bench/<script>`` of tree A
(say, a worktree of the old main) and of tree B (this one), each with its own raydag on
``PYTHONPATH`` and its own copy of the script, alternately ``--rounds`` times, so that
both see the same machine load; then prints the machine, both versions, and a table of
each measured figure with B's median over A's.

    git worktree add /tmp/old-main <commit>
    .nox/tests/bin/python bench/ab.py --a /tmp/old-main --rounds 2 overhead.py --repeats 3
    .nox/tests/bin/python bench/ab.py --a /tmp/old-main memory.py
    .nox/tests/bin/python bench/ab.py --a /tmp/old-main recovery.py --only two-kills --repeat 2
    .nox/tests_hep/bin/python bench/ab.py --a /tmp/old-main hep.py --real --repeats 2

The figures read from each script's ``--json``: overhead.py, the median seconds per
graph and contender; memory.py, the peak store bytes and wall seconds per contender;
recovery.py, the makespan, re-executions and waves per scenario and contender; hep.py,
each contender's seconds and raydag's speed over dask sync's in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator

import _common


def figures(script: str, data: dict) -> Iterator[tuple[str, float]]:
    """(name, value) of every figure a script's JSON holds."""
    name = os.path.basename(script)
    if name == "overhead.py":
        for r in data["results"]:
            yield f"{r['graph']:7} {r['contender']:>20}  median s", r["median"]
    elif name == "memory.py":
        for r in data["runs"]:
            yield f"{r['contender']:>14}  peak MiB", r["peak_bytes"] / 2**20
            yield f"{r['contender']:>14}  wall s", r["wall"]
    elif name == "recovery.py":
        for r in data["results"]:
            if r["wall"] is None:
                continue
            what = f"{r['scenario']:>18} {r['contender']:>16} {r['run']:6}"
            yield f"{what}  wall s", r["wall"]
            yield f"{what}  re-executed", r["reexecuted"]
            if r.get("waves") is not None:
                yield f"{what}  waves", r["waves"]
    elif name == "hep.py":
        for part in ("skim", "real"):
            rows = data.get(part)
            if not isinstance(rows, list):  # "skim" is also the header's description
                continue
            for r in rows:
                yield f"{part} {r['contender']:>14}  s", r["seconds"]
            sync = [r["seconds"] for r in rows if r["contender"] == "dask sync"]
            for r in rows:  # the machine's speed drifts: a run's ratio to its own baseline
                if r["contender"] == "raydag" and sync:
                    yield (
                        f"{part} {'raydag':>14}  sync s / s",
                        statistics.median(sync) / r["seconds"],
                    )
    else:
        raise SystemExit(
            f"bench/ab.py reads overhead.py, memory.py, recovery.py, hep.py, not {name}"
        )


def run(tree: str, script: str, args: list[str]) -> tuple[dict, str]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    cmd = [sys.executable, os.path.join(tree, "bench", script), *args, "--json", out]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode})")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", required=True, help="tree A (the baseline): a checkout of raydag")
    ap.add_argument("--b", default=os.path.join(os.path.dirname(__file__), ".."), help="tree B")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each tree, alternating")
    ap.add_argument("script", help="overhead.py, memory.py, recovery.py or hep.py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = ap.parse_args()
    trees = {"A": args.a, "B": args.b}
    _common.print_header(
        f"A/B: bench/{args.script} {' '.join(args.args)}",
        {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b), "rounds": args.rounds},
    )
    got: dict[str, dict[str, list[float]]] = {"A": defaultdict(list), "B": defaultdict(list)}
    for i in range(args.rounds):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            data, _ = run(trees[side], args.script, args.args)
            for name, value in figures(args.script, data):
                got[side][name].append(float(value))
            print(f"round {i + 1}: {side} done", flush=True)
    rows = []
    for name in got["B"]:
        a, b = got["A"].get(name), got["B"][name]
        if not a:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = f"{mb / ma:.3f}" if ma else "-"
        rows.append((name, f"{ma:.4g}", f"{mb:.4g}", ratio, len(a), len(b)))
    print()
    print(_common.table(("figure", "A median", "B median", "B / A", "n A", "n B"), rows))
    print("\nB / A below 1: B smaller (faster, less memory, fewer re-executions)")


if __name__ == "__main__":
    main()
