"""The founding user's scale on one driver: 60k to 330k tasks on the embedded Ray (#19).

The graph is the seed's shape, built by ``tests/simcluster.py``'s ``seed_graph`` (26
subgraphs, each chains of depth 5 whose ends meet in fan-ins of 25, and those in one
fan-in of 100), handed to each scheduler's ``get`` as one plain dict (the same dict
for every contender: dask's own materialisation of a collection is not measured).
Two kinds of task:

  tiny    importable functions on small ints: the scheduler's cost alone
  shared  every task of a layer (a stage of a subgraph) calls one ``Layer`` object
          with some state (cuts, column names, a 4 kB array), as dask-awkward's
          tasks each carry their layer's callable: what a scheduler pickles per task
          unless it ships the callable once

Contenders, each in a process of its own (its driver's peak RSS is its own):

  raydag        raydag.ray_get on an embedded Ray (bench/_common.start_ray), its run
                record kept (the default)
  raydag-norecord  the same with raydag.record.enabled=False: the record's cost
  raydag-orderfirst  the same with raydag.scheduling.order-later-above=None: dask.order
                before the first task, as before the provisional order
  threads       dask's threaded scheduler (the machine's cores)
  distributed   distributed.LocalCluster(processes=True, n_workers=2, 1 thread each)
                (skipped, and said so, if distributed is not installed)
  ray_dask_get  Ray's Dask-on-Ray scheduler on an embedded Ray, capped at --ray-cap s

Every contender is capped at --cap seconds (a capped run is killed and its total shown
as "> cap"). Per run: time to the first task started (each leaf task, in whatever
process runs it, creates a mark file if none exists yet: its time is the first task's
start, the same rule for every contender), total, and the driver's peak RSS (VmHWM,
the graph dict included; the RSS with the graph built is shown too). For raydag also
its phases before the first submit, timed inside the compute: graph intake
(``Graph.from_dask`` less ``dask.order``), ordering (``dask.order``: before the first
task, or in a thread meanwhile above ``order-later-above`` tasks), state start
(``State.from_graph`` and ``State.start``); and with --profile, a second raydag run
under cProfile whose top functions (by own time) are printed.

    python bench/scale.py                                    # 60k, 150k, 330k; both kinds
    python bench/scale.py --sizes 330000 --kinds tiny --profile
    python bench/scale.py --sizes 60000 --contenders raydag,threads
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
TESTS = os.path.join(TREE, "tests")
CONTENDERS = (
    "raydag",
    "raydag-norecord",
    "raydag-orderfirst",
    "threads",
    "distributed",
    "ray_dask_get",
)


# ---- the tasks (importable as ``scale``: workers import them by reference) ----------


def leaf(mark: str) -> int:
    """A chain's first task; the first one to run anywhere leaves the mark."""
    if not os.path.exists(mark):
        try:
            with open(mark, "x") as f:
                f.write(repr(time.time()))
        except FileExistsError:
            pass
    return 1


def step(x: int) -> int:
    return x + 1


def fanin(xs: list) -> int:
    return sum(xs)


class Layer:
    """One layer's callable, with some state, as dask-awkward's are (importable class,
    state pickled with every task that carries it, unless shipped once)."""

    def __init__(self, name: str) -> None:
        import numpy as np

        self.name = name
        self.cuts = {f"cut{i}": (float(i), 2.0 * i) for i in range(20)}
        self.columns = [f"{name}_column_{i}" for i in range(40)]
        self.weights = np.linspace(0.0, 1.0, 512)  # 4 kB

    def __call__(self, *args: Any) -> int:
        if args and isinstance(args[0], str):  # a leaf: its argument is the mark
            return leaf(args[0])
        if args and isinstance(args[0], list):
            return sum(args[0])
        return args[0] + 1 if all(lo <= hi for lo, hi in self.cuts.values()) else -1


def build(size: int, kind: str, mark: str) -> tuple[dict, list]:
    """The seed's shape at about ``size`` tasks, as a dask graph of ``kind`` tasks."""
    sys.path.insert(0, TESTS)
    from dask.utils import key_split
    from simcluster import seed_graph

    g = seed_graph(size, heavy=0, order=False)
    layers: dict[str, Layer] = {}
    dsk: dict = {}
    for k, deps in g.dependencies.items():
        name = key_split(k)
        many = name in ("combine", "final")  # the fan-ins (a list of inputs, maybe of one)
        if kind == "tiny":
            fn: Any = leaf if not deps else fanin if many else step
        else:
            layer = k[0] if isinstance(k, tuple) else k  # a stage of one subgraph
            fn = layers.get(layer) or layers.setdefault(layer, Layer(layer))
        dsk[k] = (fn, mark) if not deps else (fn, list(deps)) if many else (fn, deps[0])
    return dsk, list(g.outputs)


# ---- one run, in a child process ----------------------------------------------------


def _timed(owner: Any, name: str, into: dict, phase: str) -> None:
    """Wrap ``owner.name`` so its seconds add up in ``into[phase]``."""
    static = inspect.getattr_static(owner, name)
    orig = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:  # in another thread: ``phase`` (bg), run while the compute goes on
            bg = threading.current_thread() is not threading.main_thread()
            into[phase + " bg" * bg] = into.get(phase + " bg" * bg, 0.0) + time.perf_counter() - t

    if isinstance(static, classmethod):
        setattr(owner, name, staticmethod(timed))
    else:
        setattr(owner, name, timed)


def child(args: argparse.Namespace) -> None:
    import dask

    sys.path.insert(0, HERE)
    import _common

    mark = os.path.join(args.workdir, f"mark-{args.contender}-{os.getpid()}")
    import scale  # the tasks by reference, as a library's are: not this __main__'s

    dsk, outputs = scale.build(args.size, args.kind, mark)
    rss_graph = _common.proc_status("VmRSS")
    phases: dict[str, float] = {}
    prof = None
    if args.contender.startswith("raydag") or args.contender == "ray_dask_get":
        import ray

        import raydag

        if args.contender != "ray_dask_get":
            _common.start_ray()
        else:  # Ray's own settings, as a user of ray_dask_get has them
            _common.start_ray(  # a Ray of its own: never a cluster found on the machine
                lambda: ray.init(address="local", include_dashboard=False, logging_level="WARNING")
            )
        ray.get([ray.remote(lambda: 0).remote() for _ in range(4)])  # workers up
        if args.contender != "ray_dask_get":
            from raydag.core import graph as graph_mod
            from raydag.core.state import State

            _timed(graph_mod.Graph, "from_dask", phases, "intake")
            _timed(graph_mod, "order", phases, "order")
            _timed(State, "from_graph", phases, "state")
            _timed(State, "start", phases, "state")
            get: Any = raydag.ray_get
            if args.contender == "raydag-norecord":  # the record's cost, by difference
                dask.config.set({"raydag.record.enabled": False})
            if args.contender == "raydag-orderfirst":  # ordered before the first task
                dask.config.set({"raydag.scheduling.order-later-above": None})
        else:
            from ray.util.dask import ray_dask_get as get
    elif args.contender == "threads":
        get = dask.threaded.get
    else:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        )
        client = Client(cluster)
        get = client.get
    print(json.dumps({"ready": True}), flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.time()
    with dask.config.set({"raydag.progress.enabled": False}):
        values = get(dsk, outputs)
    total = time.time() - t0
    if prof is not None:
        prof.disable()
    first = None
    if os.path.exists(mark):
        with open(mark) as f:
            first = float(f.read()) - t0
    out: dict[str, Any] = {
        "total": total,
        "first": first,
        "rss_peak": _common.proc_status("VmHWM"),
        "rss_graph": rss_graph,
        "tasks": len(dsk),
        "result": int(sum(values)),
    }
    if "intake" in phases:
        out["phases"] = {
            "intake": phases["intake"] - phases.get("order", 0.0),
            "order": phases.get("order", 0.0),
            "state": phases.get("state", 0.0),
        }
        if "order bg" in phases:  # dask.order in a thread: as far as it got by the end
            out["phases"]["order bg"] = phases["order bg"]
        rec = raydag.last_run()
        out["record"] = rec is not None
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        out["profile"] = s.getvalue()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
        out["profile_cum"] = s.getvalue()
    print(json.dumps(out), flush=True)


def run_child(contender: str, size: int, kind: str, cap: float, workdir: str, profile: bool,
              top: int) -> dict[str, Any]:  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([TREE, HERE, os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--contender", contender]
    cmd += ["--sizes", str(size), "--kinds", kind, "--workdir", workdir, "--top", str(top)]
    if profile:
        cmd.append("--profile")
    os.makedirs(workdir, exist_ok=True)
    errf = open(os.path.join(workdir, f"stderr-{contender}"), "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=errf, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    assert proc.stdout is not None
    ready = None
    deadline = time.time() + SETUP_CAP  # building the graph, starting Ray or the cluster
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    capped = False
    while True:
        timeout = max(0.0, deadline - time.time())
        if not sel.select(timeout):
            capped = True
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            got = json.loads(line)
            if got.get("ready"):
                ready = time.time()
                deadline = ready + cap
            else:
                lines.append(got)
    if capped:
        _stop(proc)
        marks = [f for f in os.listdir(workdir) if f.startswith(f"mark-{contender}-")]
        first = None
        if marks and ready is not None:
            with open(os.path.join(workdir, marks[0])) as f:
                first = float(f.read()) - ready
        return {"capped": cap, "first": first}
    proc.wait()
    errf.seek(0)
    err = errf.read()
    errf.close()
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {err[-1500:]}"}
    return lines[-1]


def _stop(proc: subprocess.Popen) -> None:
    """End a capped child: Ctrl-C first (it aborts its compute, then shuts its Ray or
    cluster down), its own process group killed if it has not ended in 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group the child leads (start_new_session)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="60000,150000,330000")
    ap.add_argument("--kinds", default="tiny,shared")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--cap", type=float, default=600.0, help="seconds a contender may take")
    ap.add_argument("--ray-cap", type=float, default=120.0, help="ray_dask_get's cap")
    ap.add_argument("--profile", action="store_true", help="a profiled raydag run per row")
    ap.add_argument("--top", type=int, default=18, help="profile lines shown")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.size, args.kind = int(args.sizes), args.kinds
        child(args)
        return

    sys.path.insert(0, HERE)
    import _common

    contenders = args.contenders.split(",")
    if "distributed" in contenders:
        try:
            import distributed  # noqa: F401
        except ImportError:
            print("distributed is not installed: its LocalCluster is skipped")
            contenders.remove("distributed")
    info = _common.print_header("scale: the seed's shape at 60k-330k tasks on one driver")
    print(f"caps    : every contender {args.cap:.0f} s, ray_dask_get {args.ray_cap:.0f} s")
    print()
    results: dict[str, Any] = defaultdict(dict)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            got: dict[str, dict] = {}
            for c in contenders:
                cap = args.ray_cap if c == "ray_dask_get" else args.cap
                with tempfile.TemporaryDirectory(prefix="raydag-scale-") as wd:
                    r = run_child(c, size, kind, cap, wd, False, args.top)
                    if args.profile and c == "raydag" and "error" not in r:
                        p = run_child(c, size, kind, cap, wd + "/p", True, args.top)
                        r["profile"] = p.get("profile") or p.get("error")
                        r["profile_cum"] = p.get("profile_cum")
                got[c] = r
                load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                brief = {k: v for k, v in r.items() if not k.startswith("profile")}
                print(f"{size} {kind} {c}: {json.dumps(brief)}  (load {load})", flush=True)
            results[f"{size} {kind}"] = got
            base = got.get("raydag", {})
            for c, r in got.items():
                rows.append(_row(size, kind, c, r, base))
    print()
    print(_common.table(HEADERS, rows))
    print()
    print("x raydag: the contender's total over raydag's (> 1: raydag is faster; '>': capped)")
    print("phases: raydag's intake / order / state start, seconds inside the compute;")
    print("        order in brackets: dask.order in a thread while the compute ran (above")
    print("        raydag.scheduling.order-later-above tasks; not raydag-orderfirst)")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load avg at the end: {load}")
    for key, got in results.items():
        prof = got.get("raydag", {}).get("profile")
        if prof:
            print(f"\n== raydag {key}: cProfile, top functions by own time ==")
            print(_trim(prof))
            print(f"\n== raydag {key}: cProfile, by cumulative time ==")
            print(_trim(got["raydag"].get("profile_cum") or ""))
    if args.json:
        info["results"] = results
        _common.write_json(args.json, info)


SETUP_CAP = 300.0  # seconds a child may take to be ready to compute

HEADERS = ["tasks", "kind", "contender", "first s", "total s", "x raydag", "peak MB",
           "graph MB", "intake", "order", "state"]  # fmt: skip


def _row(size: int, kind: str, c: str, r: dict, base: dict) -> list:
    mb = 2**20
    if "error" in r:
        return [size, kind, c, "error", r["error"].splitlines()[-1][:40]] + [None] * 6
    total = r.get("total")
    shown = f"> {r['capped']:.0f}" if "capped" in r else f"{total:.1f}"
    ratio = None
    if base.get("total"):
        t = r.get("capped", total)
        ratio = ("> " if "capped" in r else "") + f"{t / base['total']:.2f}"
    ph = r.get("phases", {})
    return [
        r.get("tasks", size),
        kind,
        c,
        None if r.get("first") is None else f"{r['first']:.1f}",
        shown,
        ratio,
        None if "rss_peak" not in r else f"{r['rss_peak'] / mb:,.0f}",
        None if "rss_graph" not in r else f"{r['rss_graph'] / mb:,.0f}",
        None if "intake" not in ph else f"{ph['intake']:.1f}",
        f"({ph['order bg']:.1f})" if "order bg" in ph else _seconds(ph.get("order") or None),
        None if "state" not in ph else f"{ph['state']:.1f}",
    ]


def _seconds(x: float | None) -> str | None:
    return None if x is None else f"{x:.1f}"


def _trim(text: str) -> str:
    """pstats' table without its preamble."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("ncalls"):
            return "\n".join(lines[i:])
    return text


if __name__ == "__main__":
    main()
