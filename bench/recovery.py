"""Recovery after node deaths: raydag (owning recovery, or letting Ray try first) vs ray_dask_get.

On a ``tests/harness.py`` cluster (a head without CPUs, 3 one-CPU worker nodes with a
250 MB store, health checks tuned to notice a crash in about 1.5 s). The tasks, the
cluster handling and the oracle that works out the minimum re-execution from the task
runs are the fault tests' (``tests/chaos.py``).

The skim (the founding user's shape): 26 subgraphs, each 104 inputs read (12 ms), then
calibrated, selected and histogrammed (2 ms each; 256/256/128/128 KiB), then merged by
one task with 104 inputs that writes the subgraph's output and returns a 64 KiB summary
(inline in the driver: never lost); a final task reads the 26 summaries. Three reads take 6 s (the
long tasks). 10,843 dask tasks. Schedules:

  two kills      the busiest node SIGKILLed at 50% of the tasks done, another at 80%,
                 each replaced by a fresh node 2 s later (as a batch pool does)
  lineage cap    the same, on a cluster started with max_lineage_bytes=10000 (Ray's
                 cap is 1 GB: a 300k-task graph of pickled dask tasks exceeds it)
  chaos pool     a node killed every 5 s from 20% done on, each replaced 2 s later

Small cases, once each:

  repeated loss  a 3 s task and 6 short ones; the node running the long task is killed
                 each time it starts again, 4 times (Ray's default max_retries is 3)
  lost late      3 tasks of 8 s (one per node) read by a final task; the node running
                 one of them is killed at 80% of its run
  not needed     30 inputs (1 MB) each reduced to 1 MB, then a 4 s task reading them;
                 once it runs, the node that made most inputs (all consumed) is killed

Contenders: ``raydag`` (default: raydag owns recovery, its Ray tasks run with
max_retries=0), ``raydag ray-first`` (``raydag.recovery.ray-first``: Ray's lineage
reconstruction first, raydag steps in when Ray gives up), ``ray_dask_get``.

    python bench/recovery.py [--repeat 10] [--only two-kills,chaos-pool] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import _common
import dask
import numpy as np
import ray

import raydag

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, os.path.abspath(TESTS))
from chaos import (  # noqa: E402
    Background,
    Clusters,
    Death,
    MiB,
    RaydagLog,
    Spec,
    T,
    build,
    busiest,
    completions,
    describe_error,
    ensure_nodes,
    expected_recovery,
    kill,
    runs,
    wait_until,
)
from harness import MultiNodeCluster  # noqa: E402

KiB = 2**10
CONTENDERS = ("raydag", "raydag ray-first", "ray_dask_get")
SMALL_LINEAGE = {"max_lineage_bytes": 10_000}
RUN_TIMEOUT = 300.0
REPLACE_AFTER = 2.0


def _ray_dask_get() -> Callable:
    """Ray's scheduler, without the patch its package applies to ``dask.persist`` on import."""
    persist, mixin = dask.persist, dask.base.DaskMethodsMixin.persist
    from ray.util.dask import ray_dask_get

    dask.persist, dask.base.DaskMethodsMixin.persist = persist, mixin
    return ray_dask_get


ray_dask_get = _ray_dask_get()


# ---- graphs ------------------------------------------------------------------------------


def skim(
    subgraphs: int = 26,
    fan: int = 104,
    long: tuple = (4, 12, 20),
    long_seconds: float = 6.0,
    long_reads: int = 1,
) -> dict[str, T]:
    """The seed's shape; the subgraphs in ``long`` read ``long_reads`` inputs for
    ``long_seconds`` each (the long tasks)."""
    rng = np.random.default_rng(7)
    spec: dict[str, T] = {}
    for g in range(subgraphs):
        for i in range(fan):
            read = long_seconds if (g in long and i < long_reads) else 0.012
            spec[f"read-{g}-{i}"] = T(read, 256 * KiB, float(rng.integers(10)))
            spec[f"calib-{g}-{i}"] = T(0.002, 256 * KiB, 1.0, (f"read-{g}-{i}",))
            spec[f"select-{g}-{i}"] = T(0.002, 128 * KiB, 0.0, (f"calib-{g}-{i}",))
            spec[f"hist-{g}-{i}"] = T(0.002, 128 * KiB, 0.0, (f"select-{g}-{i}",))
        # Each subgraph ends writing its parquet and returning a summary (64 KiB: Ray
        # keeps it inline in the driver's memory, so no node death loses it).
        spec[f"merge-{g}"] = T(0.05, 64 * KiB, 0.0, tuple(f"hist-{g}-{i}" for i in range(fan)))
    spec["skim"] = T(0.01, 8, 0.0, tuple(f"merge-{g}" for g in range(subgraphs)))
    return spec


def repeated_loss() -> dict[str, T]:
    spec = {f"side-{i}": T(0.2, MiB, float(i)) for i in range(6)}
    spec["long"] = T(3.0, MiB, 1000.0)
    spec["final"] = T(0.1, 8, 0.0, ("long", *(f"side-{i}" for i in range(6))))
    return spec


def lost_late() -> dict[str, T]:
    spec = {f"long-{i}": T(8.0, MiB, float(i)) for i in range(3)}
    spec["final"] = T(0.1, 8, 0.0, tuple(spec))
    return spec


def not_needed() -> dict[str, T]:
    spec: dict[str, T] = {}
    for i in range(30):
        spec[f"in-{i}"] = T(0.15, MiB, float(i))
        spec[f"sum-{i}"] = T(0.05, MiB, 0.0, (f"in-{i}",))
    spec["tail"] = T(4.0, 8, 0.0, tuple(f"sum-{i}" for i in range(30)))
    return spec


def expected(spec: Spec, outputs: list) -> float:
    """The outputs' values, worked out directly (what any scheduler must give)."""
    memo: dict[str, float] = {}

    def value(k: str) -> float:
        if k not in memo:
            memo[k] = spec[k].value + sum(value(d) for d in spec[k].deps)
        return memo[k]

    return sum(value(k) for k in outputs)


# ---- one run -----------------------------------------------------------------------------


@dataclass
class Result:
    scenario: str
    contender: str
    run: str  # "free" or "faults"
    wall: float | None
    outcome: str
    deaths: int = 0
    reexecuted: int = 0  # finished runs beyond one per task
    # What the deaths made necessary (tests/chaos.py's oracle): the lost results still
    # needed and their released inputs, and the runs counted in ``ended``.
    minimum: int = 0
    cut: int = 0  # runs killed with their node
    # Runs on a dying node that noted their end, but whose result never reached the
    # driver (Ray failed the task with the node): they ran to their end, then again.
    ended: int = 0
    waves: int | None = None
    extra: dict = field(default_factory=dict)


# Kills nodes while a compute runs, appending each death to the list it is given.
Chaos = Callable[[MultiNodeCluster, str, Background, list], None]


class Bench:
    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.clusters = Clusters()
        self.config: dict | None = None
        self.results: list[Result] = []
        self.rlog = RaydagLog()
        logging.getLogger("raydag.runtime").addHandler(self.rlog)
        self.seq = 0

    def cluster(self, nodes: int = 3) -> MultiNodeCluster:
        c = self.clusters.get(self.config)
        ensure_nodes(c, nodes)
        warm_up(c)
        return c

    def run(
        self,
        scenario: str,
        contender: str,
        spec: Spec,
        outputs: list,
        chaos: Chaos | None = None,
        nodes: int = 3,
        config: dict | None = None,
    ) -> Result:
        """One compute, with ``chaos`` killing nodes meanwhile (it returns the deaths);
        ``config``: raydag settings of this compute (``raydag.*`` keys)."""
        c = self.cluster(nodes)
        self.seq += 1
        log = os.path.join(self.logdir, f"{self.seq:03d}.log")
        dsk = build(spec, log)
        if contender == "ray_dask_get":

            def compute() -> Any:
                return ray_dask_get(dsk, outputs)
        else:
            ray_first = contender == "raydag ray-first"

            def compute() -> Any:
                with dask.config.set({"raydag.recovery.ray-first": ray_first, **(config or {})}):
                    return raydag.ray_get(dsk, outputs)

        self.rlog.clear()
        t0 = time.perf_counter()
        t_start = time.time()
        bg = Background(compute)
        deaths: list[Death] = []
        outcome = ""
        chaos_error = None
        if chaos is not None:
            try:
                chaos(c, log, bg, deaths)
            except Exception as e:  # e.g. the compute ended before the chaos was done
                chaos_error = f"{type(e).__name__}: {e}"
        finished = bg.done.wait(RUN_TIMEOUT)
        wall = time.perf_counter() - t0 if finished else None
        if not finished:
            bg.interrupt()
            outcome = "hung"
        elif bg.error is not None:
            outcome = describe_error(bg.error)
        else:
            got = float(sum(np.asarray(v).flat[0] for v in bg.value))
            outcome = "ok" if got == expected(spec, outputs) else f"WRONG ({got})"
        if finished and bg.error is None:
            wall = self._wall(log, t_start, wall)
        bg.value = None
        res = self._account(scenario, contender, spec, outputs, log, deaths, wall, outcome)
        if chaos is not None:
            res.run = "faults"
            res.extra["chaos_error"] = chaos_error
            res.extra["deaths"] = [(d.node, d.t_kill) for d in deaths]
            res.extra["log"] = log
        self.results.append(res)
        print(
            f"  {scenario:13} {contender:17} {res.run:6} {res.wall or float('nan'):7.1f} s  "
            f"{outcome:24} deaths {res.deaths}, re-executed {res.reexecuted} "
            f"(minimum {res.minimum}), cut {res.cut}+{res.ended}, waves {res.waves}",
            flush=True,
        )
        if chaos_error or (res.waves is not None and res.waves != res.extra.get("lossy")):
            print(f"    chaos: {chaos_error}; waves: {res.extra.get('waves')}", flush=True)
        for what in ("more", "fewer", "wave sizes"):
            if res.extra.get(what):
                print(f"    {what}: {res.extra[what]}", flush=True)
        if outcome == "hung":  # its thread may still use the cluster: start afresh
            self.clusters.close()
        return res

    @staticmethod
    def _wall(log: str, t_start: float, wall: float | None) -> float | None:
        """The makespan: from the compute's call to its last task's end (the driver's own
        return, seconds later under ray_dask_get's cleanup, is not the cluster's work)."""
        ends = [r.end for r in runs(log) if r.end is not None]
        return max(ends) - t_start if ends else wall

    def _account(self, scenario, contender, spec, outputs, log, deaths, wall, outcome) -> Result:
        ours = contender != "ray_dask_get"
        for d in deaths:
            d.t_seen = (self.rlog.seen(d) if ours else None) or d.t_dead
        if ours:
            self.rlog.note_cuts(deaths)
        done = runs(log)
        got = completions(log)
        exp = expected_recovery(spec, outputs, done, deaths)
        minimum = sum(len(r) for r in exp.recompute) + len(exp.cut)
        waves = self.rlog.waves()
        extra = {
            "waves": [(w.lost, w.recompute, w.reason) for w in waves],
            "lossy": sum(bool(lost) for lost in exp.lost),
        }
        if ours:
            # Task by task against the oracle, and each wave against its death's loss:
            # equal totals could hide one task too many and another too few.
            extra["more"] = dict(got - exp.completions)
            extra["fewer"] = dict(exp.completions - got)
            sizes = [(len(lost), len(exp.recompute[i])) for i, lost in enumerate(exp.lost) if lost]
            if [(w.lost, w.recompute) for w in waves] != sizes:
                extra["wave sizes"] = {
                    "raydag": [(w.lost, w.recompute) for w in waves],
                    "oracle": sizes,
                }
        return Result(
            scenario,
            contender,
            "faults" if deaths else "free",
            wall,
            outcome,
            deaths=len(deaths),
            reexecuted=sum(n - 1 for n in got.values()),
            minimum=minimum,
            cut=sum(1 for r in done if r.end is None),
            ended=len(exp.cut),
            waves=len(waves) if ours else None,
            extra=extra,
        )

    def close(self) -> None:
        self.clusters.close()


def _warm(x: Any) -> float:
    return float(np.asarray(x).sum())


def warm_up(c: MultiNodeCluster) -> None:
    """A task on every node first: a fresh node needs seconds to start its worker."""
    f = ray.remote(_warm)
    refs = [f.options(resources={n.name: 0.01}).remote(np.zeros(2)) for n in c.alive]
    ray.get(refs, timeout=120)
    gc.collect()


# ---- kill schedules ----------------------------------------------------------------------


# The harness is not meant for two threads at once: a node starting while another is killed.
_cluster_lock = threading.Lock()


def kill_one(c: MultiNodeCluster, node_id: str) -> Death:
    with _cluster_lock:
        return kill(c, node_id)


def replace_later(c: MultiNodeCluster) -> None:
    """A fresh node ``REPLACE_AFTER`` s after a death, as a batch pool sends one."""

    def add() -> None:
        time.sleep(REPLACE_AFTER)
        try:
            with _cluster_lock:
                c.add_node()  # the harness retries a node that misses Ray's start deadline
        except Exception as e:
            logging.getLogger(__name__).warning("could not add a node: %s", e)

    threading.Thread(target=add, daemon=True).start()


def kills_at(
    fractions: tuple[float, ...],
    total: int,
    choose: Callable[[MultiNodeCluster, str, Background], str | None] | None = None,
) -> Chaos:
    """A node killed (and replaced) at each fraction of the ``total`` tasks done: the
    busiest, or the one ``choose(cluster, log, bg)`` names (None: the compute ended)."""

    def chaos(c: MultiNodeCluster, log: str, bg: Background, deaths: list) -> None:
        for f in fractions:
            want = int(f * total)
            wait_until(lambda w=want: sum(completions(log).values()) >= w, f"{want} done", bg, 240)
            node = choose(c, log, bg) if choose else busiest(c, log, lambda k: True)
            if node is None:
                return
            deaths.append(kill_one(c, node))
            replace_later(c)

    return chaos


def every(seconds: float, start: float, total: int, most: int = 8) -> Chaos:
    def chaos(c: MultiNodeCluster, log: str, bg: Background, deaths: list) -> None:
        want = int(start * total)
        wait_until(lambda: sum(completions(log).values()) >= want, f"{want} done", bg, 240)
        while len(deaths) < most and not bg.done.is_set():
            if len(c.alive) > 1:
                deaths.append(kill_one(c, busiest(c, log, lambda k: True)))
                replace_later(c)
            if bg.done.wait(seconds):
                break

    return chaos


def kill_long_repeatedly(times: int) -> Chaos:
    def chaos(c: MultiNodeCluster, log: str, bg: Background, deaths: list) -> None:
        seen: set = set()
        for _ in range(times):
            alive = {x.node_id for x in c.alive}

            def fresh(alive: set = alive):
                return next(
                    (
                        r
                        for r in runs(log)
                        if r.label == "long"
                        and r.end is None
                        and r.node in alive
                        and (r.node, r.start) not in seen
                    ),
                    None,
                )

            try:
                r = wait_until(fresh, "the long task to start again", bg, 60)
            except (AssertionError, TimeoutError):
                break
            seen.add((r.node, r.start))
            time.sleep(0.3)
            # Replacements were added before: starting one takes longer than the task.
            deaths.append(kill_one(c, r.node))

    return chaos


def kill_late(fraction: float) -> Chaos:
    def chaos(c: MultiNodeCluster, log: str, bg: Background, deaths: list) -> None:
        r = wait_until(
            lambda: next((r for r in runs(log) if r.label == "long-0" and r.end is None), None),
            "long-0 to start",
            bg,
        )
        time.sleep(max(0.0, r.start + 8.0 * fraction - time.time()))
        deaths.append(kill_one(c, r.node))
        replace_later(c)

    return chaos


def kill_consumed() -> Chaos:
    def chaos(c: MultiNodeCluster, log: str, bg: Background, deaths: list) -> None:
        tail = wait_until(
            lambda: next((r for r in runs(log) if r.label == "tail"), None), "tail to start", bg
        )
        time.sleep(0.3)
        deaths.append(
            kill_one(c, busiest(c, log, lambda k: k.startswith("in-"), exclude=[tail.node]))
        )
        replace_later(c)

    return chaos


# ---- the tables ----------------------------------------------------------------------------


def summary(results: list[Result]) -> str:
    """One row per scenario and contender: runs, completions, makespan against the
    contender's failure-free run, re-executions against the minimum, waves per death."""
    free: dict[tuple, list[float]] = {}
    for r in results:
        if r.run == "free" and r.outcome == "ok" and r.wall:
            free.setdefault((r.scenario.split(" ")[0], r.contender), []).append(r.wall)
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.contender, r.run), []).append(r)
    rows = []
    for (scenario, contender, run), rs in groups.items():
        ok = [r for r in rs if r.outcome == "ok"]
        walls = [r.wall for r in ok if r.wall]
        base = free.get((scenario.split(" ")[0], contender)) or free.get(
            (scenario.split(" ")[0], "raydag")
        )
        med = statistics.median(walls) if walls else None
        ratio = med / statistics.median(base) if med and base and run == "faults" else None
        worst = max(walls) / statistics.median(base) if walls and base and run == "faults" else None
        fails = Counter(r.outcome for r in rs if r.outcome != "ok")
        rows.append(
            (
                scenario,
                contender,
                run,
                f"{len(ok)}/{len(rs)}",
                med,
                ratio,
                worst,
                sum(r.deaths for r in rs),
                sum(r.reexecuted for r in rs),
                sum(r.minimum for r in rs),
                None if rs[0].waves is None else sum(r.waves or 0 for r in rs),
                ", ".join(f"{k} x{n}" for k, n in fails.items()) or "",
            )
        )
    headers = [
        "scenario",
        "contender",
        "run",
        "ok",
        "median s",
        "x free",
        "worst x free",
        "deaths",
        "re-executed",
        "minimum",
        "waves",
        "failures",
    ]
    return _common.table(headers, rows)


SCENARIOS = ("two-kills", "lineage-cap", "chaos-pool", "repeated-loss", "lost-late", "not-needed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="also write every result here")
    ap.add_argument("--only", help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    ap.add_argument("--repeat", type=int, default=10, help="raydag runs per skim schedule")
    ap.add_argument(
        "--free",
        type=int,
        default=3,
        help="raydag's failure-free runs per skim (the median is 'x free''s base), "
        "spread among the faulted runs",
    )
    args = ap.parse_args()
    only = args.only.split(",") if args.only else list(SCENARIOS)
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # ray_dask_get's lost refs
    # A SIGTERM unwinds like Ctrl-C, so that the cluster's processes are ended.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # raydag's warnings (deaths, waves) go to the wave counter, not the terminal
    logging.getLogger("raydag").setLevel(logging.WARNING)
    logging.getLogger("raydag").propagate = False

    logdir = tempfile.mkdtemp(prefix="rdg-bench-recovery-", dir="/tmp")
    b = Bench(logdir)
    t_start = time.perf_counter()
    spec = skim()
    n = len(spec)
    try:
        b.cluster()
        header = _common.print_header(
            "recovery: node deaths, raydag vs ray_dask_get",
            {
                "cluster": "head (0 CPU) + 3 nodes x 1 CPU, 250 MB store each; a killed "
                f"node is replaced {REPLACE_AFTER:g} s later",
                "skim": f"{n} dask tasks, 26 subgraphs, fan-in 104, 3 tasks of 6 s",
                "raydag": f"retries {raydag.config.get('retries')}, "
                f"in-flight-per-cpu {raydag.config.get('scheduling.in-flight-per-cpu')}",
            },
        )
        print()
        skims = [
            ("two-kills", "two kills", None, kills_at((0.5, 0.8), n)),
            ("chaos-pool", "chaos pool", None, every(5.0, 0.2, n)),
            ("lineage-cap", "lineage cap", SMALL_LINEAGE, kills_at((0.5, 0.8), n)),
        ]
        for name, scenario, system_config, chaos in skims:
            if name not in only:
                continue
            b.config = system_config
            label = "skim" if system_config is None else "skim-capped"
            if not any(r.scenario == label for r in b.results):
                b.run(label, "ray_dask_get", spec, ["skim"])
                k = max(1, args.free)
                free = {round(i * args.repeat / k) for i in range(k)}
            else:  # the other schedule of this skim ran its failure-free runs already
                free = set()
            for i in range(args.repeat):
                if i in free:
                    b.run(label, "raydag", spec, ["skim"])
                b.run(f"{label} {scenario}", "raydag", spec, ["skim"], chaos)
            b.run(f"{label} {scenario}", "raydag ray-first", spec, ["skim"], chaos)
            b.run(f"{label} {scenario}", "ray_dask_get", spec, ["skim"], chaos)
        b.config = None
        small = [
            ("repeated-loss", repeated_loss(), ["final"], lambda: kill_long_repeatedly(4), 7),
            ("lost-late", lost_late(), ["final"], lambda: kill_late(0.8), 3),
            ("not-needed", not_needed(), ["tail"], kill_consumed, 3),
        ]
        for name, small_spec, outputs, make_chaos, nodes in small:
            if name not in only:
                continue
            for contender in CONTENDERS:
                b.run(name, contender, small_spec, outputs, nodes=nodes)
                b.run(f"{name} kill", contender, small_spec, outputs, make_chaos(), nodes=nodes)
    finally:
        b.close()
        shutil.rmtree(logdir, ignore_errors=True)

    print()
    print(summary(b.results))
    print(
        "\nx free: median makespan over the median failure-free run's (worst: the slowest run's);"
        "\nminimum: re-executions the deaths made necessary, from the task runs (tests/chaos.py),"
        "\n         including runs that ended on a dying node but never reached the driver"
    )
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.json:
        _common.write_json(args.json, {**header, "results": [asdict(r) for r in b.results]})


if __name__ == "__main__":
    main()
