"""Recovery after node deaths: raydag (owning recovery, or letting Ray try first) vs ray_dask_get.

On a ``tests/harness.py`` cluster (a head without CPUs, 3 one-CPU worker nodes with a
250 MB store, health checks tuned to notice a crash in about 1.5 s), each scenario runs
every contender failure-free and with nodes SIGKILLed mid-run (each replaced by a fresh
node at once):

  fan-in 6x30    6 groups of 30 inputs (0.2-0.4 s, 1-3 MB each) merged per group,
                 then one final task; the busiest node is killed at 50% of the inputs
  lineage cap    30 inputs (0.3 s, 1 MB) and one final task, on a cluster started with
                 max_lineage_bytes=10000 (Ray's cap is 1 GB: a 300k-task graph of
                 pickled dask tasks exceeds it); the busiest node is killed at 50%
  repeated loss  a 3 s task and 6 short ones; the node running the long task is killed
                 each time it starts again, 4 times (Ray's default max_retries is 3);
                 the 4 replacements are added before the run (a node takes longer to
                 start than the task to finish elsewhere)
  lost late      3 tasks of 8 s (one per node) read by a final task; the node running
                 one of them is killed at 80% of its run
  not needed     30 inputs (1 MB) each reduced to a scalar, then a 4 s task reading the
                 scalars; once it runs, the node that made the most inputs (all
                 consumed) is killed: nothing lost is needed any more

Contenders: ``raydag`` (default: raydag owns recovery, its Ray tasks run with
max_retries=0), ``raydag ray-first`` (``raydag.recovery.ray-first``: Ray's lineage
reconstruction first, raydag steps in when Ray gives up), ``ray_dask_get`` (Ray's own
Dask-on-Ray scheduler). Every task notes each run (start, end, node) in a file under
/tmp, so re-executions are counted the same way for all contenders.

    python bench/recovery.py [--json results.json] [--only fan-in,lost-late]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import _common
import dask
import numpy as np
import ray
from dask._task_spec import Task, TaskRef
from ray.util.dask import ray_dask_get

import raydag
from raydag.stores import store_stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from harness import MultiNodeCluster  # noqa: E402

MiB = 2**20
CONTENDERS = ("raydag", "raydag ray-first", "ray_dask_get")
SMALL_LINEAGE = {"max_lineage_bytes": 10_000}
RUN_TIMEOUT = 240.0


# ---- tasks (defined in __main__: shipped to the workers by value) ---------------------


def note(log: str, kind: str, label: str) -> None:
    node = ray.get_runtime_context().get_node_id()
    line = f"{kind} {label} {node} {os.getpid()} {time.time():.6f}\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def work(label: str, log: str, seconds: float, nbytes: int, value: float, *deps: Any):
    note(log, "start", label)
    time.sleep(seconds)
    total = value + sum(float(np.asarray(d).flat[0]) for d in deps)
    out = np.full(max(1, nbytes // 8), total)
    note(log, "end", label)
    return out


class T(NamedTuple):
    seconds: float
    nbytes: int
    value: float
    deps: tuple = ()


def build(spec: Mapping[str, T], log: str) -> dict:
    return {
        k: Task(k, work, k, log, t.seconds, t.nbytes, t.value, *map(TaskRef, t.deps))
        for k, t in spec.items()
    }


def expected(spec: Mapping[str, T], outputs: list) -> float:
    """The outputs' values, worked out directly (what any scheduler must give)."""
    memo: dict[str, float] = {}

    def value(k: str) -> float:
        if k not in memo:
            memo[k] = spec[k].value + sum(value(d) for d in spec[k].deps)
        return memo[k]

    return sum(value(k) for k in outputs)


# ---- graphs ----------------------------------------------------------------------------


def fan_in_6x30() -> dict[str, T]:
    rng = np.random.default_rng(3)
    spec: dict[str, T] = {}
    for g in range(6):
        parts = []
        for i in range(30):
            k = f"in-{g}-{i}"
            spec[k] = T(float(rng.uniform(0.2, 0.4)), int(rng.uniform(1, 3) * MiB), float(i))
            parts.append(k)
        spec[f"merge-{g}"] = T(0.3, MiB, 0.0, tuple(parts))
    spec["final"] = T(0.2, 8, 0.0, tuple(f"merge-{g}" for g in range(6)))
    return spec


def fan_in_30() -> dict[str, T]:
    spec = {f"in-{i}": T(0.3, MiB, float(i)) for i in range(30)}
    spec["final"] = T(0.2, 8, 0.0, tuple(spec))
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
        spec[f"sum-{i}"] = T(0.05, 8, 0.0, (f"in-{i}",))
    spec["tail"] = T(4.0, 8, 0.0, tuple(f"sum-{i}" for i in range(30)))
    return spec


# ---- what happened -----------------------------------------------------------------------


@dataclass
class Run_:
    label: str
    node: str
    start: float
    end: float | None = None


def runs(log: str) -> list[Run_]:
    out: list[Run_] = []
    live: dict[tuple[str, str], Run_] = {}
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                kind, label, node, pid, t = line.split()
                if kind == "start":
                    live[(label, pid)] = r = Run_(label, node, float(t))
                    out.append(r)
                else:
                    live.pop((label, pid)).end = float(t)
    return out


def done(log: str) -> Counter:
    return Counter(r.label for r in runs(log) if r.end is not None)


WAVE_RE = re.compile(r"recovery wave \d+:")


class Waves(logging.Handler):
    """Counts raydag's recovery waves from its log."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if WAVE_RE.search(record.getMessage()):
            self.count += 1


@dataclass
class Result:
    scenario: str
    contender: str
    run: str  # "free" or "faults"
    wall: float | None
    outcome: str
    reexecuted: int = 0  # runs that finished, beyond one per task
    cut: int = 0  # runs cut short by a death
    rerun_seconds: float = 0.0  # task time spent again: re-executions and cut runs
    waves: int | None = None
    deaths: int = 0
    extra: dict = field(default_factory=dict)


class Background:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.t_done = 0.0  # perf_counter when the compute returned or raised
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as e:
            self.error = e
        finally:
            self.t_done = time.perf_counter()
            self.done.set()

    def interrupt(self) -> None:
        if self.thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread.ident), ctypes.py_object(KeyboardInterrupt)
            )
            self.done.wait(10)


def describe(e: BaseException) -> str:
    """The error's type; for Ray's ``RayTaskError(X)`` wrappers, X's."""
    cause = getattr(e, "cause", None)
    return type(cause if isinstance(cause, BaseException) else e).__name__


# ---- the cluster ---------------------------------------------------------------------------


class Bench:
    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.cluster: MultiNodeCluster | None = None
        self.config: dict | None = None
        self.results: list[Result] = []
        self.waves = Waves()
        logging.getLogger("raydag.runtime").addHandler(self.waves)

    def use(self, system_config: dict | None = None) -> MultiNodeCluster:
        if self.cluster is None or self.config != system_config:
            self.close()
            self.cluster = MultiNodeCluster(system_config=system_config).__enter__()
            self.config = system_config
        self.settle()
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.__exit__(None, None, None)
            self.cluster = None

    def settle(self, nodes: int = 3) -> None:
        """``nodes`` alive nodes, warm, stores empty (ray_dask_get leaves a cycle: gc)."""
        c = self.cluster
        assert c is not None
        while len(c.alive) > nodes:
            extra = c.alive[-1]
            c.kill(extra)
            c.wait_dead(extra)
        while len(c.alive) < nodes:
            c.add_node()
        warm_up(c)
        gc.collect()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if not sum(s.num_objects for s in store_stats().values()):
                    break
            except Exception:
                pass
            time.sleep(0.2)

    def kill(self, node_id: str, replace: bool = True) -> None:
        c = self.cluster
        assert c is not None
        node = c.by_id(node_id)
        c.kill(node)
        c.wait_dead(node)
        if replace:
            c.add_node()

    def busiest(self, log: str, prefix: str, exclude: tuple = ()) -> str:
        assert self.cluster is not None
        alive = [n.node_id for n in self.cluster.alive if n.node_id not in exclude]
        count = Counter(r.node for r in runs(log) if r.end and r.label.startswith(prefix))
        return max(alive, key=lambda n: count.get(n, 0))

    def run(
        self,
        scenario: str,
        contender: str,
        spec: Mapping[str, T],
        outputs: list,
        chaos: Callable[[str, Background], int] | None = None,
        nodes: int = 3,
    ) -> Result:
        """One compute, with ``chaos(log, bg)`` (which kills nodes, returns how many) meanwhile."""
        self.settle(nodes)
        tag = f"{scenario}-{contender}-{'faults' if chaos else 'free'}".replace(" ", "_")
        log = os.path.join(self.logdir, tag + ".log")
        dsk = build(spec, log)
        if contender == "ray_dask_get":

            def compute() -> Any:
                return ray_dask_get(dsk, outputs)
        else:
            ray_first = contender == "raydag ray-first"

            def compute() -> Any:
                with dask.config.set({"raydag.recovery.ray-first": ray_first}):
                    return raydag.ray_get(dsk, outputs)

        self.waves.count = 0
        t0 = time.perf_counter()
        bg = Background(compute)
        deaths = 0
        outcome = ""
        try:
            if chaos is not None:
                deaths = chaos(log, bg)
        except Exception as e:  # the compute ended (failed) before the chaos was done
            outcome = f"chaos: {e}"
        finished = bg.done.wait(RUN_TIMEOUT)
        wall = bg.t_done - t0
        if not finished:
            bg.interrupt()
            outcome = "hung"
        elif bg.error is not None:
            outcome = describe(bg.error)
        else:
            got = float(sum(np.asarray(v).flat[0] for v in bg.value))
            outcome = "ok" if got == expected(spec, outputs) else f"WRONG ({got})"
        bg.value = None
        all_runs = runs(log)
        finished_runs = [r for r in all_runs if r.end is not None]
        per_task = Counter(r.label for r in finished_runs)
        extra_runs = sorted(finished_runs, key=lambda r: r.end)
        seen: set = set()
        rerun_s = 0.0
        for r in extra_runs:
            if r.label in seen:
                rerun_s += r.end - r.start
            seen.add(r.label)
        cut = [r for r in all_runs if r.end is None]
        res = Result(
            scenario,
            contender,
            "faults" if chaos else "free",
            wall if outcome != "hung" else None,
            outcome,
            reexecuted=sum(n - 1 for n in per_task.values()),
            cut=len(cut),
            rerun_seconds=rerun_s + sum(_cut_seconds(r, all_runs) for r in cut),
            waves=self.waves.count if contender != "ray_dask_get" else None,
            deaths=deaths,
        )
        self.results.append(res)
        print(
            f"  {scenario:14} {contender:17} {res.run:6} {res.wall or float('nan'):7.1f} s  "
            f"{outcome:30} re-executed {res.reexecuted}, cut {res.cut}, waves {res.waves}",
            flush=True,
        )
        if outcome == "hung":  # its thread may still hold the cluster: start afresh
            self.close()
            self.use(self.config)
        return res


def _warm(x: Any) -> float:
    return float(np.asarray(x).sum())


def warm_up(c: MultiNodeCluster) -> None:
    """A task on every node first: a fresh node needs seconds to start its worker."""
    f = ray.remote(_warm)
    refs = [f.options(resources={n.name: 0.01}).remote(np.zeros(2)) for n in c.alive]
    ray.get(refs, timeout=120)


def _cut_seconds(r: Run_, all_runs: list[Run_]) -> float:
    """How long a cut run ran: until the next run of the same task started (an upper bound)."""
    later = [x.start for x in all_runs if x.label == r.label and x.start > r.start]
    return (min(later) - r.start) if later else 0.0


def wait_for(pred: Callable[[], Any], bg: Background, what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if bg.done.is_set():
            raise RuntimeError(f"the compute ended before {what}")
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout} s for {what}")


# ---- scenarios -------------------------------------------------------------------------------


def kill_busiest_at(b: Bench, prefix: str, count: int) -> Callable[[str, Background], int]:
    def chaos(log: str, bg: Background) -> int:
        wait_for(lambda: sum(done(log).values()) >= count, bg, f"{count} tasks done")
        b.kill(b.busiest(log, prefix))
        return 1

    return chaos


def kill_long_repeatedly(b: Bench, times: int) -> Callable[[str, Background], int]:
    def chaos(log: str, bg: Background) -> int:
        seen: set = set()
        for n in range(times):
            assert b.cluster is not None
            alive = {x.node_id for x in b.cluster.alive}

            def fresh(alive: set = alive) -> Run_ | None:
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
                r = wait_for(fresh, bg, "the long task to start again", timeout=60)
            except RuntimeError:
                return n
            seen.add((r.node, r.start))
            time.sleep(0.3)
            # Replacements were added before: starting one takes longer than the task.
            b.kill(r.node, replace=False)
        return times

    return chaos


def kill_late(b: Bench, fraction: float) -> Callable[[str, Background], int]:
    def chaos(log: str, bg: Background) -> int:
        r = wait_for(
            lambda: next((r for r in runs(log) if r.label == "long-0" and r.end is None), None),
            bg,
            "long-0 to start",
        )
        time.sleep(max(0.0, r.start + 8.0 * fraction - time.time()))
        b.kill(r.node)
        return 1

    return chaos


def kill_consumed(b: Bench) -> Callable[[str, Background], int]:
    def chaos(log: str, bg: Background) -> int:
        tail = wait_for(
            lambda: next((r for r in runs(log) if r.label == "tail"), None), bg, "tail to start"
        )
        time.sleep(0.3)
        b.kill(b.busiest(log, "in-", exclude=(tail.node,)))
        return 1

    return chaos


SCENARIOS = ("fan-in", "lineage-cap", "repeated-loss", "lost-late", "not-needed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="also write every result here")
    ap.add_argument("--only", help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    args = ap.parse_args()
    only = args.only.split(",") if args.only else list(SCENARIOS)
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # ray_dask_get's lost refs

    logdir = tempfile.mkdtemp(prefix="rdg-bench-recovery-", dir="/tmp")
    b = Bench(logdir)
    t_start = time.perf_counter()
    try:
        b.use()
        header = _common.print_header(
            "recovery: node deaths, raydag vs ray_dask_get",
            {
                "cluster": "head (0 CPU) + 3 nodes x 1 CPU, 250 MB store each; a killed "
                "node is replaced at once",
                "raydag": f"retries {raydag.config.get('retries')}, "
                f"in-flight-per-cpu {raydag.config.get('scheduling.in-flight-per-cpu')}",
            },
        )
        print()
        if "fan-in" in only:
            spec = fan_in_6x30()
            for contender in CONTENDERS:
                b.run("fan-in 6x30", contender, spec, ["final"])
                b.run("fan-in 6x30", contender, spec, ["final"], kill_busiest_at(b, "in-", 90))
        if "repeated-loss" in only:
            spec = repeated_loss()
            for contender in CONTENDERS:
                b.run("repeated loss", contender, spec, ["final"])
                chaos = kill_long_repeatedly(b, 4)
                b.run("repeated loss", contender, spec, ["final"], chaos, nodes=3 + 4)
        if "lost-late" in only:
            spec = lost_late()
            for contender in CONTENDERS:
                b.run("lost late", contender, spec, ["final"])
                b.run("lost late", contender, spec, ["final"], kill_late(b, 0.8))
        if "not-needed" in only:
            spec = not_needed()
            for contender in CONTENDERS:
                b.run("not needed", contender, spec, ["tail"])
                b.run("not needed", contender, spec, ["tail"], kill_consumed(b))
        if "lineage-cap" in only:
            b.use(SMALL_LINEAGE)
            spec = fan_in_30()
            for contender in CONTENDERS:
                b.run("lineage cap", contender, spec, ["final"])
                b.run("lineage cap", contender, spec, ["final"], kill_busiest_at(b, "in-", 15))
    finally:
        b.close()
        shutil.rmtree(logdir, ignore_errors=True)

    free = {(r.scenario, r.contender): r.wall for r in b.results if r.run == "free"}
    rows = []
    for r in b.results:
        base = free.get((r.scenario, r.contender))
        ratio = r.wall / base if r.run == "faults" and r.wall and base else None
        rows.append(
            (
                r.scenario,
                r.contender,
                r.run,
                r.deaths,
                r.wall,
                ratio,
                r.reexecuted,
                r.cut,
                r.rerun_seconds,
                r.waves,
                r.outcome,
            )
        )
    print()
    print(
        _common.table(
            [
                "scenario",
                "contender",
                "run",
                "deaths",
                "wall s",
                "x free",
                "re-executed",
                "cut",
                "re-run s",
                "waves",
                "outcome",
            ],
            rows,
        )
    )
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.json:
        _common.write_json(args.json, {**header, "results": [asdict(r) for r in b.results]})


if __name__ == "__main__":
    main()
