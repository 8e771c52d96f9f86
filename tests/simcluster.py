"""A simulated large cluster for the real state machine, in simulated time (no Ray).

The real ``raydag.core.state.State`` is fed the events the Ray layer would report
(``TaskStarted``, ``TaskFinished`` with sizes, ``NodeDied``, ``CpusChanged``, ``Tick``,
``StoresSampled``), and its instructions are carried out the way Ray would: a
``Submit`` runs as a copy on a node (a soft node choice is honoured if that node has a
free CPU, a duplicate runs on its node only, anything else goes where Ray's locality
would send it: the node holding most of its input bytes if it has a free CPU, else the
node with the most free CPUs; a copy whose input is gone with its node fails to fetch
it, ``InputLost``, as on Ray without retries of its own); ``Cancel`` stops a copy;
``Release`` frees its value's bytes in the node's store. Nodes are evicted as a batch
pool evicts them (a Poisson rate per node-hour) and replaced after a delay by fresh
nodes. A value whose node is evicted is gone, unless a copy running on another node
has read it: then, as Ray does, that copy of it becomes the primary, and it lives on
there (``test_speculation.py``'s
``test_insured_again_though_its_input_went_with_the_first_copys_node``). Every call into
the state machine is timed with ``time.process_time`` apart from the simulator's own work.

Shared by ``bench/simcluster.py`` (280 nodes x 12 CPUs, the founding user's graph at
60k-330k tasks) and ``tests/test_sim.py`` (a small one, checked).

Example::

    graph = seed_graph(2_000, seed=1)
    sim = Sim(graph, Cluster(nodes=20, cpus=4), policies=True, evictions=[(600.0, 3)])
    result = sim.run()
    assert result.complete and result.waves == 1
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from raydag.core.checkpoints import Checkpoints
from raydag.core.events import (
    Cancel,
    Checkpoint,
    CheckpointFailed,
    CheckpointWritten,
    CpusChanged,
    Fail,
    InputLost,
    NodeDied,
    Recover,
    Release,
    StoresSampled,
    Submit,
    TaskErred,
    TaskFinished,
    TaskStarted,
    Tick,
)
from raydag.core.fusion import Fusion
from raydag.core.placement import Placement
from raydag.core.records import MEMORY
from raydag.core.recovery import Recovery
from raydag.core.speculation import Speculation
from raydag.core.state import State

Key = Hashable
POLICIES = ("fusion", "placement", "speculation")  # what ``Sim``'s ``without`` may name
WALL0 = 1_700_000_000.0
MB = 2**20

# The founding user's skim, per chain of one dataset (subgraph): stage, mean seconds,
# output bytes. Runtimes are lognormal around the mean (sigma 0.5): seconds to minutes.
STAGES = (
    ("load", 60.0, 150 * MB),
    ("process", 420.0, 60 * MB),
    ("select", 120.0, 20 * MB),
    ("fill", 60.0, 5 * MB),
    ("write", 30.0, 1 * MB),
)
COMBINE = ("combine", 10.0, 2 * MB)  # a fan-in of chain ends
FINAL = ("final", 60.0, 2 * MB)  # each subgraph's last task: 100 combines in
HEAVY = ("heavy", 3600.0)  # ~500 process tasks of about an hour (their own category)
SIGMA = 0.5
HEAVY_SIGMA = 0.2


@dataclass
class Graph:
    """A graph with every task's runtime and output size fixed in advance."""

    dependencies: dict
    priorities: dict
    outputs: list
    durations: dict
    sizes: dict

    def __len__(self) -> int:
        return len(self.dependencies)

    def critical_path(self) -> float:
        """The longest chain of runtimes (the keys are in topological order)."""
        finish: dict = {}
        for k, deps in self.dependencies.items():
            finish[k] = self.durations[k] + max((finish[d] for d in deps), default=0.0)
        return max(finish.values())

    @property
    def work(self) -> float:
        return sum(self.durations.values())


def seed_graph(
    tasks: int,
    *,
    subgraphs: int = 26,
    combines: int = 100,
    heavy: int = 500,
    seed: int = 0,
    order: bool = True,
) -> Graph:
    """The founding user's shape at about ``tasks`` tasks.

    ``subgraphs`` datasets, each of C chains of ``STAGES`` (depth 5), ``combines``
    fan-ins of C / ``combines`` chain ends, and one final task reading the
    ``combines``; at C = 2,500 (327,626 tasks) the fan-ins are of 25 and 100, the
    shape the issue measured. ``heavy`` process tasks, spread evenly, take about an
    hour. ``order``: priorities from ``dask.order`` (as raydag's graph intake gives
    them); otherwise the construction order.
    """
    chains = max(combines, round((tasks / subgraphs - combines - 1) / len(STAGES)))
    width = math.ceil(chains / combines)
    rng = random.Random(seed)
    deps: dict = {}
    durations: dict = {}
    sizes: dict = {}
    outputs = []
    total_chains = chains * subgraphs
    step = total_chains / heavy if heavy else math.inf
    heavy_at = {int(i * step) for i in range(heavy)}
    n = 0
    for s in range(subgraphs):
        ends = []
        for c in range(chains):
            prev = None
            for stage, mean, nbytes in STAGES:
                name, sigma = stage, SIGMA
                if stage == "process" and n in heavy_at:
                    (name, mean), sigma = HEAVY, HEAVY_SIGMA
                key = (f"{name}-{s:02d}", c)
                deps[key] = () if prev is None else (prev,)
                durations[key] = mean * rng.lognormvariate(-(sigma**2) / 2, sigma)
                sizes[key] = nbytes
                prev = key
            ends.append(prev)
            n += 1
        parts = []
        for j in range(combines):
            group = ends[j * width : (j + 1) * width]
            if not group:
                break
            key = (f"{COMBINE[0]}-{s:02d}", j)
            deps[key] = tuple(group)
            durations[key] = COMBINE[1] * rng.lognormvariate(-(SIGMA**2) / 2, SIGMA)
            sizes[key] = COMBINE[2]
            parts.append(key)
        key = f"{FINAL[0]}-{s:02d}"
        deps[key] = tuple(parts)
        durations[key] = FINAL[1] * rng.lognormvariate(-(SIGMA**2) / 2, SIGMA)
        sizes[key] = FINAL[2]
        outputs.append(key)
    if order:
        from dask.order import order as dask_order

        dsk = {k: (sum, list(v)) for k, v in deps.items()}
        priorities = dask_order(dsk, dependencies={k: set(v) for k, v in deps.items()})
    else:
        priorities = {k: i for i, k in enumerate(deps)}
    return Graph(deps, priorities, outputs, durations, sizes)


@dataclass(frozen=True)
class Cluster:
    """The cluster's size, its stores, and how a batch pool evicts its nodes."""

    nodes: int = 280
    cpus: int = 12
    store: int = 64 * 2**30  # each node's object store
    evictions_per_node_hour: float = 0.0
    replace_after: float = 600.0  # an evicted node's replacement joins this much later
    seed: int = 0
    # the checkpoint store's bandwidth for one value written or read (a shared
    # filesystem or an object store seen from one node), bytes per second
    checkpoint_bandwidth: float = 100 * MB

    def eviction_schedule(self, horizon: float) -> list[tuple[float, int]]:
        """(time, slot): slot ``slot``'s node evicted at ``time``; drawn in advance so
        runs with different policies meet the same evictions."""
        rate = self.evictions_per_node_hour / 3600.0
        if rate <= 0:
            return []
        rng = random.Random(self.seed + 1)
        out = []
        for slot in range(self.nodes):
            t = 0.0
            while True:
                t += rng.expovariate(rate)
                if t > horizon:
                    break
                out.append((t, slot))
                t += self.replace_after  # no eviction before the replacement joined
        return sorted(out)


def cpu_seconds_bound(work: float, cluster: Cluster, evictions: list[tuple[float, int]]) -> float:
    """The earliest time by which the alive CPUs could have done ``work`` CPU-seconds:
    the alive CPUs change at each eviction (one node fewer) and replacement."""
    changes = []
    for t, _ in evictions:
        changes.append((t, -cluster.cpus))
        changes.append((t + cluster.replace_after, cluster.cpus))
    changes.sort()
    cpus = cluster.nodes * cluster.cpus
    t0 = 0.0
    done = 0.0
    for t, delta in changes:
        if done + cpus * (t - t0) >= work:
            break
        done += cpus * (t - t0)
        t0, cpus = t, cpus + delta
    return t0 + (work - done) / cpus


@dataclass
class Running:
    copy: int
    keys: tuple
    kept: tuple
    node: int
    start: float
    end: float
    cpus: float
    restore: tuple = ()  # keys read back from their checkpoints, not computed
    inputs: tuple = ()  # read from the stores when it started


@dataclass
class Result:
    """What one simulated compute measured."""

    tasks: int
    complete: bool
    failed: str | None
    makespan: float
    critical_path: float
    work_bound: float
    events: int
    driver_cpu: float  # process_time inside State.handle/start, seconds
    start_cpu: float  # of it, State() and start()
    sim_wall: float
    waves: int
    evictions: int
    executions: int  # keys run to their end, counting every copy that finished
    reexecuted: int  # of those, beyond each key's first
    killed: int  # copies that died with their node
    cancelled: int  # copies cancelled while running (duplicates' losers, preempted)
    duplicates: int
    wasted_cpu: float  # CPU-seconds of copies killed or cancelled
    peak_store: float  # the fullest store's peak fill (fraction of capacity)
    spilled: int  # the most bytes any store held beyond its capacity
    checkpoints: int = 0  # checkpoints written whole
    restored: int = 0  # keys read back from their checkpoints
    per_event: dict = field(default_factory=dict)  # type -> (count, cpu seconds)

    @property
    def bound(self) -> float:
        return max(self.critical_path, self.work_bound)


class Sim:
    """Run ``State`` on a simulated cluster until the compute is done."""

    def __init__(
        self,
        graph: Graph,
        cluster: Cluster,
        *,
        policies: bool = True,
        without: Iterable[str] = (),
        checkpoints: Checkpoints | None = None,
        evictions: list[tuple[float, int]] | None = None,
        horizon: float = 48 * 3600.0,
        poll: float = 0.25,
        validate_every: int = 0,
        profile=None,
        observers=(),
    ):
        self.g = graph
        self.c = cluster
        self.horizon = horizon
        self.poll = poll
        self.validate_every = validate_every
        self.profile = profile
        # called with every event (None: the start) and its instructions, as the Ray
        # layer's observers are (a run record: ``Recorder(clock=sim.clock)``)
        self.observers = list(observers)
        if evictions is None:
            evictions = cluster.eviction_schedule(horizon)
        self.evictions = evictions
        self.policies = policies
        self.t = 0.0
        self.seq = 0
        self.heap: list = []  # (time, seq, kind, payload)
        self.node_ids: list[str] = []  # node index -> id
        self.slot_node: list[int] = []  # slot -> its current node index (or -1)
        self.alive: set[int] = set()
        self.free: list[float] = []  # node index -> free CPUs
        # nodes by free CPUs (ints: deterministic), for Ray-like spreading
        self.by_free: dict[int, set] = defaultdict(set)
        self.used: list[int] = []  # store bytes per node
        self.peak_used: list[int] = []
        self.values: dict = {}  # key -> (node index, bytes): Ray objects
        self.running: dict[int, Running] = {}  # copy -> Running
        self.waiting: list[Submit] = []  # submitted, no CPU yet (FIFO)
        self.pinned: dict[int, list[Submit]] = defaultdict(list)  # duplicates for a node
        self.runs: Counter = Counter()  # key -> executions finished
        self.inbox: list = []  # events to report before the next timed one
        self.cpu = 0.0
        self.start_cpu = 0.0
        self.per_event: dict[str, list] = defaultdict(lambda: [0, 0.0])
        self.events = 0
        self.killed = self.cancelled = self.duplicates = 0
        self.wasted = 0.0
        self.waves = 0
        self.evicted = 0
        self.spilled = 0
        self.written = self.restored = 0
        for _ in range(cluster.nodes):
            self.slot_node.append(self._join())
        t0 = time.process_time()
        # ``without``: the policies left off, to tell what each does
        off = set(POLICIES) if not policies else set(without)
        if off - set(POLICIES):
            raise ValueError(f"no such policy: {sorted(off - set(POLICIES))}")
        kw = dict(
            fusion=Fusion(enabled="fusion" not in off),
            placement=Placement(enabled="placement" not in off),
            speculation=Speculation(enabled="speculation" not in off),
        )
        self.state = State(
            graph.dependencies,
            graph.priorities,
            graph.outputs,
            capacity=cluster.nodes * cluster.cpus,
            nodes={self.node_ids[i]: cluster.cpus for i in self.alive},
            recovery=Recovery(ray_first=False),
            checkpoints=checkpoints,
            **kw,
        )
        self.start_cpu = time.process_time() - t0
        self.cpu += self.start_cpu
        self.ticking = policies  # the Ray layer ticks for speculation, samples for placement

    # ---- the cluster --------------------------------------------------------------

    def _join(self) -> int:
        i = len(self.node_ids)
        self.node_ids.append(f"{i:04d}" + "n" * 52)
        self.alive.add(i)
        self.free.append(float(self.c.cpus))
        self.by_free[self.c.cpus].add(i)
        self.used.append(0)
        self.peak_used.append(0)
        return i

    def _take(self, node: int, cpus: float) -> None:
        f = self.free[node]
        self.by_free[int(f)].discard(node)
        self.free[node] = f - cpus
        self.by_free[int(f - cpus)].add(node)

    def _give(self, node: int, cpus: float) -> None:
        if node not in self.alive:
            return
        f = self.free[node]
        self.by_free[int(f)].discard(node)
        self.free[node] = f + cpus
        self.by_free[int(f + cpus)].add(node)

    def _spread(self, cpus: float) -> int | None:
        """Ray's spreading: the node with the most free CPUs (lowest index on a tie)."""
        for f in range(self.c.cpus, int(math.ceil(cpus)) - 1, -1):
            nodes = self.by_free.get(f)
            if nodes:
                return min(nodes) if len(nodes) < 8 else next(iter(nodes))
        return None

    def _where(self, sub: Submit, cpus: float) -> int | None:
        if sub.node is not None:
            i = self._index.get(sub.node)
            if sub.duplicate:
                return i if i in self.alive and self.free[i] >= cpus else None
            if i in self.alive and self.free[i] >= cpus:
                return i
        held: dict = {}
        for d in sub.inputs:
            v = self.values.get(d)
            if v is not None:
                held[v[0]] = held.get(v[0], 0) + v[1]
        if held:
            best = max(held, key=lambda n: (held[n], -n))
            if self.free[best] >= cpus and best in self.alive:
                return best
        return self._spread(cpus)

    # ---- the state machine --------------------------------------------------------

    def step(self, event) -> None:
        prof = self.profile
        t0 = time.process_time()
        if prof is not None:
            prof.enable()
        out = self.state.start() if event is None else self.state.handle(event)
        if prof is not None:
            prof.disable()
        dt = time.process_time() - t0
        self.cpu += dt
        if event is None:
            self.start_cpu += dt
        else:
            self.events += 1
            rec = self.per_event[type(event).__name__]
            rec[0] += 1
            rec[1] += dt
            if self.validate_every and self.events % self.validate_every == 0:
                self.state.validate_state()
        for observe in self.observers:
            observe(event, out)
        self.carry_out(out)

    def carry_out(self, out: list) -> None:
        for ins in out:
            if isinstance(ins, Submit):
                if ins.duplicate:
                    self.duplicates += 1
                self.waiting.append(ins)
            elif isinstance(ins, Cancel):
                self._cancel(ins.copy)
            elif isinstance(ins, Release):
                self._free_value(ins.key)
            elif isinstance(ins, Recover):
                self.waves += 1
                for k in ins.recompute:
                    self._free_value(k)
            elif isinstance(ins, Fail):
                self.failure = f"{ins.key!r}: {ins.error}"
            elif isinstance(ins, Checkpoint):  # written beside the readers: no CPU taken
                v = self.values.get(ins.key)
                if v is None:  # lost before the write began
                    self.inbox.append(CheckpointFailed(ins.key, "value gone", lost=True))
                else:
                    t = self.t + v[1] / self.c.checkpoint_bandwidth
                    self._push(t, "written", (ins.key, v[0], v[1]))
        if self.waiting:
            self._dispatch()

    def _free_value(self, key: Key) -> None:
        v = self.values.pop(key, None)
        if v is not None:
            self.used[v[0]] -= v[1]

    def _cancel(self, copy: int) -> None:
        r = self.running.pop(copy, None)
        if r is None:
            self.waiting = [s for s in self.waiting if s.copy != copy]
            for subs in self.pinned.values():
                subs[:] = [s for s in subs if s.copy != copy]
            return
        self.cancelled += 1
        self.wasted += (self.t - r.start) * r.cpus
        self._give(r.node, r.cpus)

    def _dispatch(self) -> None:
        """Start what was submitted where Ray would, while CPUs are free."""
        left = []
        for sub in self.waiting:
            cpus = float((sub.resources or {}).get("CPU", 1))
            node = self._where(sub, cpus)
            if node is None:
                if sub.duplicate:
                    i = self._index.get(sub.node)
                    if i in self.alive:
                        self.pinned[i].append(sub)
                    else:  # its node is gone: Ray cannot schedule it
                        self.inbox.append(
                            TaskErred(
                                sub.copy, sub.root, RuntimeError("unschedulable"), node_died=True
                            )
                        )
                else:
                    left.append(sub)
                continue
            self._run(sub, node, cpus)
        self.waiting = left

    def _seconds(self, key: Key, restore: tuple) -> float:
        if key in restore:
            return self.g.sizes[key] / self.c.checkpoint_bandwidth
        return self.g.durations[key]

    def _run(self, sub: Submit, node: int, cpus: float) -> None:
        gone = tuple(k for k in sub.inputs if k not in self.values)
        if gone:  # lost with their node: on Ray (no retries of its own) the copy fails
            self.inbox.append(InputLost(sub.copy, gone, "input lost with its node"))
            return
        self._take(node, cpus)
        end = self.t + sum(self._seconds(k, sub.restore) for k in sub.keys)
        self.running[sub.copy] = Running(
            sub.copy, sub.keys, sub.kept, node, self.t, end, cpus, sub.restore, sub.inputs
        )
        self.restored += len(sub.restore)
        self._push(end, "finish", sub.copy)
        if sub.notify and end - self.t > sub.notify_after:  # as the worker: not if ended
            self.inbox.append(TaskStarted(sub.copy, self.node_ids[node], WALL0 + self.t))

    def _push(self, t: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def _finish(self, copy: int) -> None:
        r = self.running.pop(copy, None)
        if r is None:  # cancelled or killed meanwhile
            return
        self._give(r.node, r.cpus)
        for k in r.keys:
            if k not in r.restore:
                self.runs[k] += 1
        sizes = tuple(self.g.sizes[k] for k in r.kept)
        for k, nbytes in zip(r.kept, sizes, strict=True):
            self._free_value(k)  # a duplicate's value replaces the first's
            self.values[k] = (r.node, nbytes)
            self.used[r.node] += nbytes
        used = self.used[r.node]
        if used > self.peak_used[r.node]:
            self.peak_used[r.node] = used
            self.spilled = max(self.spilled, used - self.c.store)
        durations = {k: self._seconds(k, r.restore) for k in r.keys}
        self.step(
            TaskFinished(
                copy,
                durations,
                sum(sizes),
                self.node_ids[r.node],
                WALL0 + r.start,
                0,
                sizes if len(r.kept) > 1 else (),
            )
        )
        pinned = self.pinned.get(r.node)
        if pinned:
            self.waiting.extend(pinned)
            pinned.clear()
            self._dispatch()

    def _evict(self, slot: int) -> None:
        node = self.slot_node[slot]
        if node not in self.alive:
            return
        self.evicted += 1
        self.alive.discard(node)
        self.by_free[int(self.free[node])].discard(node)
        self.free[node] = 0.0
        readers: dict = {}  # value -> the nodes of copies that read it, running elsewhere
        for r in self.running.values():
            if r.node != node:
                for d in r.inputs:
                    readers.setdefault(d, []).append(r.node)
        for k in [k for k, v in self.values.items() if v[0] == node]:
            nbytes = self.values[k][1]
            self._free_value(k)
            if k in readers:  # Ray makes a reader's copy the primary: it lives on there
                home = min(readers[k])
                self.values[k] = (home, nbytes)
                self.used[home] += nbytes
        dead = [r for r in self.running.values() if r.node == node]
        name = self.node_ids[node]
        self.step(NodeDied(name, f"evicted: {name[:12]}"))
        self.step(CpusChanged(self._cpus()))
        for r in dead:
            if self.running.pop(r.copy, None) is None:
                continue  # cancelled by the death's wave
            self.killed += 1
            self.wasted += (self.t - r.start) * r.cpus
            self.step(TaskErred(r.copy, r.keys[-1], RuntimeError("node died"), node_died=True))
        for sub in self.pinned.pop(node, []):
            self.step(TaskErred(sub.copy, sub.root, RuntimeError("unschedulable"), node_died=True))
        self.slot_node[slot] = -1
        self._push(self.t + self.c.replace_after, "join", slot)

    def clock(self) -> float:
        """The simulated time (seconds since the start), for a ``Recorder``."""
        return self.t

    def _cpus(self) -> float:
        return float(len(self.alive) * self.c.cpus)

    def _tick(self) -> None:
        idle = {self.node_ids[i]: self.free[i] for i in self.alive}
        st = self.state
        if st.placer.settings.enabled:
            stores = {self.node_ids[i]: (self.used[i], self.c.store) for i in self.alive}
            self.step(StoresSampled(stores, idle))
        if st.speculator.enabled:
            self.step(Tick(WALL0 + self.t, idle))

    # ---- the run ------------------------------------------------------------------

    def run(self) -> Result:
        wall0 = time.perf_counter()
        self._index = {n: i for i, n in enumerate(self.node_ids)}
        self.failure = None
        for t, slot in self.evictions:
            self._push(t, "evict", slot)
        if self.ticking:
            self._push(self.poll, "tick", None)
        self.step(None)
        while not self.state.done:
            while self.inbox and not self.state.done:
                self.step(self.inbox.pop(0))
            if self.state.done or not self.heap:
                break
            t, _, kind, payload = heapq.heappop(self.heap)
            if t > self.horizon:
                break
            self.t = t
            if kind == "finish":
                self._finish(payload)
            elif kind == "tick":
                self._tick()
                self._push(t + self.poll, "tick", None)
            elif kind == "evict":
                self._evict(payload)
            elif kind == "written":  # the write read the value from its node's store
                key, node, nbytes = payload
                if node in self.alive:
                    self.written += 1
                    self.step(CheckpointWritten(key, nbytes))
                else:
                    self.step(CheckpointFailed(key, "its node died", lost=True))
            elif kind == "join":
                self.slot_node[payload] = node = self._join()
                self._index[self.node_ids[node]] = node
                self.step(CpusChanged(self._cpus()))
                self._dispatch()
        st = self.state
        complete = (
            st.done and not st.stopped and all(st.tasks[k].state == MEMORY for k in st.outputs)
        )
        executions = sum(self.runs.values())
        return Result(
            tasks=len(self.g),
            complete=complete,
            failed=self.failure,
            makespan=self.t,
            critical_path=self.g.critical_path(),
            work_bound=cpu_seconds_bound(
                self.g.work, self.c, [e for e in self.evictions if e[0] <= self.t]
            ),
            events=self.events,
            driver_cpu=self.cpu,
            start_cpu=self.start_cpu,
            sim_wall=time.perf_counter() - wall0,
            waves=self.waves,
            evictions=self.evicted,
            executions=executions,
            reexecuted=executions - len(self.runs),
            killed=self.killed,
            cancelled=self.cancelled,
            duplicates=self.duplicates,
            wasted_cpu=self.wasted,
            peak_store=max(self.peak_used) / self.c.store,
            spilled=max(0, self.spilled),
            checkpoints=self.written,
            restored=self.restored,
            per_event={k: tuple(v) for k, v in self.per_event.items()},
        )
