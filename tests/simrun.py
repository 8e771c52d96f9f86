"""A simulated compute: the real state machine on a fake two-node cluster, recorded.

For tests of the run record and the report that need faults (a retry, a node lost
and recovered, a failure, a duplicate) without a cluster and in a second. Time is
simulated: every transition happens at a known time, so the record can be checked
exactly.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from raydag.core.events import (
    Cancel,
    CpusChanged,
    Fail,
    NodeDied,
    Submit,
    TaskErred,
    TaskFinished,
)
from raydag.core.fusion import Fusion
from raydag.core.state import State
from raydag.observe.record import Recorder, RunRecord
from raydag.runtime.stores import Sample

WALL0 = 1_700_000_000.0
NODES = {"a" * 56: 2.0, "b" * 56: 2.0}
NODE_A, NODE_B = NODES


def graph(width: int = 12) -> tuple[dict, dict, list]:
    """load-i -> clean-i -> (pairs) combine-j -> total; a flaky task, a slow one."""
    deps: dict = {}
    for i in range(width):
        deps[("load", i)] = ()
        deps[("clean", i)] = (("load", i),)
    for j in range(width // 2):
        deps[("combine", j)] = (("clean", 2 * j), ("clean", 2 * j + 1))
    deps["flaky-0"] = (("combine", 0),)
    deps["total"] = tuple(("combine", j) for j in range(1, width // 2)) + ("flaky-0",)
    order = list(deps)
    priorities = {k: i for i, k in enumerate(order)}
    return deps, priorities, ["total"]


def duration(key) -> float:
    name = key[0] if isinstance(key, tuple) else key
    return {"load": 0.30, "clean": 0.12, "combine": 0.20, "flaky-0": 0.1, "total": 0.05}[name]


@dataclass
class Running:
    copy: int
    keys: tuple
    node: str
    worker: int
    start: float


class Sim:
    """Runs ``State`` against a fake cluster: 2 nodes x 2 worker processes."""

    def __init__(
        self,
        *,
        kill_at: float | None = 1.0,
        fail: bool = False,
        duplicate: bool = True,
        wall: float = WALL0,
    ):
        self.wall = wall
        deps, prio, outputs = graph()
        self.state = State(deps, prio, outputs, capacity=4, fusion=Fusion(enabled=False))
        self.t = 0.0
        self.alive = dict(NODES)
        self.rec = Recorder(
            nodes=self.alive, alive_nodes=lambda: self.alive, clock=lambda: self.t, wall=wall
        )
        self.rec.meta["graph"] = {"tasks": len(deps), "outputs": 1}
        self.kill_at = kill_at
        self.fail = fail
        self.duplicate = duplicate
        self.flaky_failed = False
        self.free = [(n, 100 * k + w) for k, n in enumerate(NODES) for w in range(2)]
        self.running: dict[int, Running] = {}
        self.queue: list[Submit] = []
        self.done: list[tuple[float, int]] = []  # (end time, copy)
        self.samples: list[Sample] = []

    def step(self, event) -> None:
        out = self.state.start() if event is None else self.state.handle(event)
        self.rec(event, out)
        for ins in out:
            if isinstance(ins, Submit):
                self.submit(ins)
            elif isinstance(ins, Cancel):
                r = self.running.pop(ins.copy, None)
                if r is not None:
                    self.release(r.node, r.worker)

    def submit(self, sub: Submit) -> None:
        self.queue.append(sub)
        self.dispatch()

    def release(self, node: str, worker: int) -> None:
        if node in self.alive:
            self.free.append((node, worker))
        self.dispatch()

    def dispatch(self) -> None:
        """Start queued Ray tasks on free worker processes, as Ray would."""
        while self.queue and self.free:
            sub = self.queue.pop(0)
            if sub.copy not in self.state.copies and sub.copy != 10_000:
                continue  # cancelled before it started
            node, worker = self.free.pop(0)
            r = Running(sub.copy, sub.keys, node, worker, self.t + 0.01)
            self.running[sub.copy] = r
            end = r.start + sum(duration(k) for k in sub.keys)
            heapq.heappush(self.done, (end, sub.copy))

    def sample(self) -> None:
        for n in self.alive:
            held = len(self.state.held_on(n))
            self.samples.append(
                Sample(self.rec.mono0 + self.t, n, held * 8 * 2**20, 512 * 2**20, 0, held)
            )

    def run(self) -> RunRecord:
        self.step(None)
        next_sample = 0.0
        while not self.state.done and self.done:
            end, gid = heapq.heappop(self.done)
            while next_sample <= end:
                self.t = next_sample
                self.sample()
                next_sample += 0.1
            if self.kill_at is not None and end >= self.kill_at:
                self.t = self.kill_at
                self.kill_at = None
                self.kill(NODE_B)
            r = self.running.get(gid)
            if r is None or r.start > end:
                continue
            self.t = end
            if r.keys[-1] == "flaky-0" and not self.flaky_failed:
                self.flaky_failed = True
                self.running.pop(gid)
                self.release(r.node, r.worker)
                error = RuntimeError("flaky: the worker died")
                if self.fail:
                    self.step(TaskErred(gid, r.keys[-1], ValueError("bad input")))
                    break
                self.step(TaskErred(gid, r.keys[-1], error, worker_died=True))
                continue
            if self.duplicate and r.keys[-1] == ("combine", 2):
                self.duplicate = False
                self.speculate(r)
                continue
            self.finish(r)
        self.t += 0.05
        self.sample()
        self.rec.add_samples(self.samples)
        failed = any(isinstance(i, Fail) for _, _, out in self.rec.transcript for i in out)
        record = self.rec.finish(RuntimeError("bad input") if failed else None)
        record.meta["id"] = "simulated"
        return record

    def finish(self, r: Running) -> None:
        self.running.pop(r.copy)
        self.release(r.node, r.worker)
        durations = {k: duration(k) for k in r.keys}
        started = self.wall + r.start
        self.step(TaskFinished(r.copy, durations, 8 * 2**20, r.node, started, r.worker))

    def speculate(self, r: Running) -> None:
        """What a speculative copy that wins looks like in the transcript.

        The state machine does not duplicate work (yet); this feeds the recorder the
        transitions a duplicate would make: a second Submit of the same key while the
        first runs, the copy finishing first, the original cancelled.
        """
        key = r.keys[-1]
        group = self.state.copies[r.copy].id
        inputs = tuple(self.state.tasks[key].dependencies)
        copy = Submit(10_000, group, r.keys, inputs, 0, None, duplicate=True)
        self.rec.transcript.append((self.t - 0.16, None, [copy]))
        self.running.pop(r.copy)
        started = self.wall + self.t - 0.15
        finished = TaskFinished(r.copy, {key: 0.15}, 8 * 2**20, NODE_A, started, 1)
        out = self.state.handle(finished)  # the state machine takes the copy's value
        self.rec(
            TaskFinished(10_000, {key: 0.15}, 8 * 2**20, NODE_A, started, 1),
            [Cancel(r.copy), *out],
        )
        self.release(r.node, r.worker)
        for ins in out:
            if isinstance(ins, Submit):
                self.submit(ins)

    def kill(self, node: str) -> None:
        del self.alive[node]
        self.free = [s for s in self.free if s[0] != node]
        for gid, r in list(self.running.items()):
            if r.node == node:
                self.running.pop(gid)
                self.step(TaskErred(gid, r.keys[-1], RuntimeError("node died"), node_died=True))
        self.step(NodeDied(node, f"node died: {node[:12]}"))  # the state machine finds the losses
        self.step(CpusChanged(2))
